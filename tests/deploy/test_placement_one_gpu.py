"""P and D on one GPU: fractional GPU shares placed by a real local Ray that declares one GPU.

Ray accepts a declared GPU count on a machine without one (`ray.init(num_gpus=1)`), and
assigns fractional shares of it for real: probe actors started with the workers' own
actor options (and in their placement-group bundles) report the GPU ids and resources
Ray gave them, and the CUDA_VISIBLE_DEVICES it set.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from collections.abc import Iterator

import pytest
import ray

from pd.cluster.config import DeployConfig, load_deploy_config
from pd.deploy.placement import (actor_options, release_placement, reserve_placement, resource_shortfall,
                                 worker_bundle, worker_roles)

REPO = Path(__file__).resolve().parents[2]
ONE_GPU_YAML = REPO / "deploy" / "gpu-1p1d-one-gpu.yaml"


@pytest.fixture(scope="module", autouse=True)
def one_gpu_ray():
    ray.init(address="local", num_cpus=2, num_gpus=1, object_store_memory=80 * 1024 * 1024, include_dashboard=False)
    try:
        yield
    finally:
        ray.shutdown()


@ray.remote
class Probe:
    def where(self) -> dict:
        import os

        ctx = ray.get_runtime_context()
        return {"node": ctx.get_node_id(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "assigned": ctx.get_assigned_resources(), "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES")}


def _one_gpu_config(**topology) -> DeployConfig:
    """The shipped one-GPU deployment, with CPU reservations this 2-CPU test instance can hold."""
    config = load_deploy_config(ONE_GPU_YAML).replace(topology__cpus_per_worker=0.25)
    return config.replace(**{f"topology__{k}": v for k, v in topology.items()}) if topology else config


def _wait_all_free(timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("GPU", 0.0) < 1.0:
        assert time.monotonic() < deadline, f"GPU not released: {ray.available_resources()}"
        time.sleep(0.1)


@contextlib.contextmanager
def _placed(config: DeployConfig) -> Iterator[list[dict]]:
    """One probe per worker, placed as the workers would be; what Ray gave each, while they hold it."""
    _wait_all_free()
    pg = reserve_placement(config, timeout_s=30)
    probes = [Probe.options(**actor_options(config, pg, i)).remote() for i in range(len(worker_roles(config)))]
    try:
        yield ray.get([p.where.remote() for p in probes], timeout=60)
    finally:
        for p in probes:
            ray.kill(p)
        release_placement(pg)


def test_the_one_gpu_1p1d_config_is_accepted_by_a_cluster_with_one_gpu():
    config = _one_gpu_config()
    assert config.topology.gpus_per_worker == 0.5
    assert worker_bundle(config) == {"CPU": 0.25, "GPU": 0.5}
    assert resource_shortfall(config, ray.cluster_resources()) is None
    # the same topology at one GPU per worker is refused by the same cluster, with the reason
    whole = _one_gpu_config(gpus_per_worker=1.0, gpu_memory_fraction=None)
    assert resource_shortfall(whole, ray.cluster_resources()) == (
        "the topology needs 2 GPU (2 workers x 1), the Ray cluster has 1 (device: cuda asks "
        "topology.gpus_per_worker of a GPU per worker; use device: cpu on a machine without GPUs)")


@pytest.mark.parametrize("placement", ["pack", "spread"])
def test_prefill_and_decode_are_placed_on_the_same_gpu_with_half_of_it_each(placement):
    config = _one_gpu_config(placement=placement)
    with _placed(config) as places:
        assert ray.available_resources().get("GPU", 0.0) == 0.0  # the two halves fill the one GPU
    assert [w for w, _ in worker_roles(config)] == ["prefill-0", "decode-0"]
    for place in places:
        assert place["gpu_ids"] == ["0"] and place["cuda_visible"] == "0"
        assert place["assigned"]["GPU"] == pytest.approx(0.5)
    assert places[0]["node"] == places[1]["node"]
    _wait_all_free()


def test_without_a_placement_group_each_worker_still_asks_for_its_share():
    config = _one_gpu_config(placement="none")
    assert reserve_placement(config) is None
    options = actor_options(config)
    assert options["num_gpus"] == 0.5 and options["scheduling_strategy"] == "SPREAD"
    probes = [Probe.options(**options).remote() for _ in range(2)]
    try:
        places = ray.get([p.where.remote() for p in probes], timeout=60)
    finally:
        for p in probes:
            ray.kill(p)
    assert all(p["gpu_ids"] == ["0"] and p["assigned"]["GPU"] == pytest.approx(0.5) for p in places)
    _wait_all_free()


def test_shares_that_do_not_pack_into_one_gpu_fail_with_the_shortfall_and_release_it():
    config = _one_gpu_config(gpus_per_worker=0.6)  # one 0.6 share per GPU: two need two GPUs
    assert resource_shortfall(config, ray.cluster_resources()) == (
        "the topology needs 2 GPU (2 workers at 0.6 GPU each, 1 per GPU), the Ray cluster has 1 (device: cuda asks "
        "topology.gpus_per_worker of a GPU per worker; use device: cpu on a machine without GPUs)")
    with pytest.raises(RuntimeError, match=r"needs 2 GPU .*has 1"):
        reserve_placement(config, timeout_s=2)
    _wait_all_free()  # the unplaceable group was removed
