"""Ray placement of P/D workers, on a simulated two-node cluster (no real GPUs needed).

Ray accepts declared GPU counts on nodes without GPUs, so `device: cuda`
topologies are placed for real here: each worker bundle holds one GPU, and
probe actors started with the workers' own actor options report the node
and GPU ids Ray gave them.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import ray
from ray.cluster_utils import Cluster

from pd.deploy.placement import (actor_options, num_ranks, release_placement, reserve_for, reserve_placement,
                                 resource_shortfall, uses_gangs, worker_bundle, worker_roles)
from pd.cluster.config import ConfigError, DeployConfig, Placement

NODE_GPUS = 2
STORE = 80 * 1024 * 1024


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True,
                head_node_args={"num_cpus": 1, "num_gpus": NODE_GPUS, "object_store_memory": STORE})
    c.add_node(num_cpus=1, num_gpus=NODE_GPUS, object_store_memory=STORE)
    c.wait_for_nodes()
    ray.init(address=c.address, include_dashboard=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@ray.remote
class Probe:
    def where(self) -> tuple[str, list]:
        return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]

    def env(self, name: str) -> str | None:
        import os

        return os.environ.get(name)


def _config(device: str, placement: str, num_prefill: int = 1, num_decode: int = 1,
            gpus_per_worker: float = 1.0, **tp) -> DeployConfig:
    return DeployConfig.from_dict({"topology": {"device": device, "placement": placement, "num_prefill": num_prefill,
                                                "num_decode": num_decode, "cpus_per_worker": 0.25,
                                                "gpus_per_worker": gpus_per_worker, **tp}})


def _wait_all_free(timeout_s: float = 30.0) -> None:
    """Removing a group or killing an actor frees its resources asynchronously."""
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("GPU", 0.0) < 2 * NODE_GPUS or ray.available_resources().get("CPU", 0.0) < 2:
        assert time.monotonic() < deadline, f"resources not released: {ray.available_resources()}"
        time.sleep(0.1)


@contextlib.contextmanager
def _placed(config: DeployConfig) -> Iterator[list[tuple[str, list]]]:
    """Reserves the config's placement group and yields (node, GPU ids) of one probe actor per
    worker, placed as the workers would be; the group is released on exit."""
    _wait_all_free()
    pg = reserve_placement(config, timeout_s=60)
    try:
        probes = [Probe.options(**actor_options(config, pg, i)).remote() for i in range(len(worker_roles(config)))]
        try:
            places = ray.get([p.where.remote() for p in probes], timeout=60)
        finally:
            for p in probes:
                ray.kill(p)
        yield places
    finally:
        release_placement(pg)


def _available_gpus() -> float:
    return ray.available_resources().get("GPU", 0.0)


def test_spread_puts_prefill_and_decode_gpu_workers_on_different_nodes(cluster):
    config = _config("cuda", "spread")
    with _placed(config) as places:
        (p_node, p_gpus), (d_node, d_gpus) = places
    assert p_node != d_node
    assert len(p_gpus) == 1 and len(d_gpus) == 1  # num_gpus=1 per worker


def test_pack_puts_both_on_one_node_each_on_its_own_gpu(cluster):
    config = _config("cuda", "pack")
    with _placed(config) as places:
        (p_node, p_gpus), (d_node, d_gpus) = places
    assert p_node == d_node
    assert len(p_gpus) == 1 and len(d_gpus) == 1 and p_gpus != d_gpus


def test_2p2d_fills_every_gpu_of_both_nodes_with_one_worker_each(cluster):
    config = _config("cuda", "spread", 2, 2)
    with _placed(config) as places:
        assert _available_gpus() == 0
    by_node: dict[str, list] = {}
    for node, gpus in places:
        by_node.setdefault(node, []).extend(gpus)
    assert len(by_node) == 2
    assert all(sorted(g) == sorted(set(g)) and len(g) == NODE_GPUS for g in by_node.values())


def test_half_gpu_shares_pack_two_workers_onto_each_gpu(cluster):
    config = _config("cuda", "pack", 2, 2, gpus_per_worker=0.5)
    with _placed(config) as places:
        assert _available_gpus() == 2 * NODE_GPUS - 2  # four halves: two GPUs' worth
    per_gpu: dict[tuple[str, str], int] = {}
    for node, gpus in places:
        assert len(gpus) == 1
        per_gpu[(node, gpus[0])] = per_gpu.get((node, gpus[0]), 0) + 1
    assert sorted(per_gpu.values()) == [2, 2]


def test_cpu_spread_bundles_hold_no_gpu(cluster):
    config = _config("cpu", "spread")
    assert worker_bundle(config) == {"CPU": 0.25}
    with _placed(config) as places:
        assert places[0][0] != places[1][0] and places[0][1] == [] and places[1][1] == []


def test_none_makes_no_group_and_uses_ray_spread(cluster):
    config = _config("cuda", "none")
    assert reserve_placement(config) is None
    assert actor_options(config)["scheduling_strategy"] == "SPREAD"
    assert actor_options(config)["num_gpus"] == 1


def test_too_many_gpu_workers_fail_with_the_shortfall_and_release_everything(cluster):
    config = _config("cuda", "spread", 3, 2)  # 5 GPUs, the cluster has 4
    with pytest.raises(RuntimeError, match=r"needs 5 GPU .*has 4"):
        reserve_placement(config, timeout_s=2)
    _wait_all_free()  # the unplaceable group was removed


def test_a_worker_process_starts_with_openmp_threads_that_sleep(cluster, monkeypatch):
    """Set before torch loads, in the actor's own process (worker_env): torch's OpenMP threads must not
    spin beside the fused kernels' pool; a caller's own OMP_WAIT_POLICY wins."""
    config = _config("cpu", "none")
    for want in ("PASSIVE", "ACTIVE"):
        if want == "ACTIVE":
            monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
        else:
            monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
        probe = Probe.options(**actor_options(config)).remote()
        try:
            assert ray.get(probe.env.remote("OMP_WAIT_POLICY"), timeout=60) == want
        finally:
            ray.kill(probe)
    _wait_all_free()


def test_resource_shortfall_names_the_missing_gpus_without_a_cluster():
    config = _config("cuda", "spread", 2, 2)
    msg = resource_shortfall(config, {"CPU": 16.0})
    assert "needs 4 GPU" in msg and "has 0" in msg and "device: cpu" in msg
    assert resource_shortfall(config, {"CPU": 16.0, "GPU": 4.0}) is None
    assert resource_shortfall(_config("cpu", "pack"), {"CPU": 0.25}) == \
        "the topology needs 0.5 CPU (2 workers x 0.25), the Ray cluster has 0.25"


@pytest.mark.parametrize("bad", ["gpu", "", None])
def test_placement_setting_is_validated(bad):
    with pytest.raises(ConfigError, match="topology.placement"):
        DeployConfig.from_dict({"topology": {"placement": bad}})
    assert DeployConfig().topology.placement is Placement.SPREAD


def test_tp_gangs_get_a_strict_pack_group_each_with_a_gpu_per_rank(cluster):
    config = _config("cuda", "spread", 1, 2, prefill_tp=2, decode_tp=1)
    assert uses_gangs(config) and num_ranks(config) == 4
    _wait_all_free()
    groups = reserve_for(config, timeout_s=60)
    try:
        assert isinstance(groups, list) and [g.bundle_count for g in groups] == [2, 1, 1]
        names = [ray.util.placement_group_table(g)["name"] for g in groups]
        assert len(set(names)) == 3 and all(n.startswith("pdkv-gang-") for n in names)
        assert all(ray.util.placement_group_table(g)["strategy"] == "STRICT_PACK" for g in groups)
        assert _available_gpus() == 0  # every rank holds a GPU of its own
        p_probes = [Probe.options(**actor_options(config, groups[0], r)).remote() for r in range(2)]
        try:
            (node0, gpus0), (node1, gpus1) = ray.get([p.where.remote() for p in p_probes], timeout=60)
        finally:
            for p in p_probes:
                ray.kill(p)
        assert node0 == node1 and len(gpus0) == len(gpus1) == 1 and gpus0 != gpus1  # one node, one GPU a rank
    finally:
        release_placement(groups)
    _wait_all_free()
    assert not uses_gangs(_config("cuda", "spread"))  # TP 1 everywhere: today's single group


def test_a_gang_larger_than_any_node_fails_naming_the_ranks_and_releases_everything(cluster):
    config = DeployConfig.from_dict({"topology": {"mode": "colocated", "colocated_tp": 4, "device": "cuda",
                                                  "cpus_per_worker": 0.25}})  # 4 GPUs in all, but 2 per node
    assert resource_shortfall(config, ray.cluster_resources()) is None
    with pytest.raises(RuntimeError, match=r"one node per worker gang \(ranks \[4\]"):
        reserve_for(config, timeout_s=2)
    _wait_all_free()


def test_resource_shortfall_counts_every_rank():
    config = _config("cuda", "spread", 1, 2, prefill_tp=4, decode_tp=2)
    msg = resource_shortfall(config, {"CPU": 16.0, "GPU": 6.0})
    assert msg.startswith("the topology needs 8 GPU (8 worker ranks x 1), the Ray cluster has 6 "), msg
    assert resource_shortfall(config, {"CPU": 16.0, "GPU": 8.0}) is None
    assert "3 worker ranks x 0.25" in resource_shortfall(_config("cpu", "pack", prefill_tp=2), {"CPU": 0.5})
