"""pd.tools.pd_bench's rules, apart from the figures: who is pinned where, what each deployment is
configured with, and how the report reads its records (the benchmark itself prints the figures)."""
from __future__ import annotations

import pytest

from pd.cluster.roles import Role
from pd.tools.pd_bench import cli as pd_bench
from pd.tools.pinned_deployment import REPO
from pd.tools.pd_bench.deploy import Variant, core_pair, deploy_config, variants, worker_plans
from pd.tools.pd_bench.load import Record, Serials, document
from pd.tools.pd_bench.report import identical, idle_figures

SMOLLM2 = REPO / "deploy/smollm2.yaml"


def test_p_and_d_each_get_a_core_and_colocated_both_with_the_same_threads():
    cores = core_pair()
    colocated = worker_plans(Variant("colocated", "none"))
    pd_pair = worker_plans(Variant("1p1d", "loopback"))
    assert [p.role for p in colocated] == [Role.BOTH]
    assert [p.role for p in pd_pair] == [Role.PREFILL, Role.DECODE]
    assert sum(p.threads for p in colocated) == sum(p.threads for p in pd_pair) == 2
    if cores is None:
        pytest.skip("this process may use fewer than two cores: the workers run unpinned")
    assert colocated[0].cpus == cores
    assert (pd_pair[0].cpus, pd_pair[1].cpus) == ((cores[0],), (cores[1],))


def test_each_variant_is_configured_as_named():
    chosen = variants(("loopback", "emulated"))
    assert [v.label for v in chosen][:1] == ["colocated"]
    colocated = deploy_config(chosen[0], SMOLLM2, 200.0, 5.0)
    assert colocated.topology.mode == "colocated"
    loopback = deploy_config(Variant("1p1d", "loopback"), SMOLLM2, 200.0, 5.0)
    assert loopback.topology.mode == "disaggregated"
    assert loopback.transfer.emulated_link is None and loopback.transfer.data_path == "auto"
    emulated = deploy_config(Variant("1p1d", "emulated"), SMOLLM2, 200.0, 5.0)
    assert emulated.transfer.data_path == "tcp"
    assert emulated.transfer.emulated_link is not None
    assert (emulated.transfer.emulated_link.bandwidth_mbps, emulated.transfer.emulated_link.latency_ms) == (200.0, 5.0)
    assert emulated.scheduler.max_model_len >= 2048 + 32  # a 2k-token document and its answer fit
    assert loopback.router.planner.mode == "always_disaggregate"  # the shipped flow unless asked
    planner = {"mode": "planner", "local_prefill_max_tokens": 256}
    planned = deploy_config(Variant("1p1d", "loopback"), SMOLLM2, 200.0, 5.0, planner=planner)
    assert (planned.router.planner.mode, planned.router.planner.local_prefill_max_tokens) == ("planner", 256)
    assert deploy_config(chosen[0], SMOLLM2, 200.0, 5.0, planner=planner).topology.mode == "colocated"


def test_streaming_variants_are_the_modes_the_schema_accepts():
    for variant in variants(("loopback",)):
        if variant.streaming is not None:  # every mode a variant names is one the config validates
            assert deploy_config(variant, SMOLLM2, 200.0, 5.0).transfer.streaming == variant.streaming


def test_every_deployment_gets_the_same_documents_fresh_each():
    serials = Serials(seed=7)
    a = [document(7, serials.take("colocated", "doc"), 1024, 2048) for _ in range(3)]
    b = [document(7, serials.take("1p1d loopback", "doc"), 1024, 2048) for _ in range(3)]
    assert a == b
    assert len({tuple(d[:16]) for d in a}) == 3  # no two documents share a prefix block
    assert all(1024 <= len(d) <= 2048 for d in a)


def _rec(kind: str, ttft: float, tokens: tuple[int, ...] = (), stages: dict | None = None) -> Record:
    return Record(kind, 2000, ttft, 0.01, len(tokens), tokens, {"stages": stages} if stages is not None else None)


def test_report_reads_the_stages_and_compares_documents_in_prompt_order():
    idle = [_rec("idle", 3.0, stages={"prefill_compute_s": 2.0, "kv_transfer_s": 0.8}),
            _rec("idle", 5.0, stages={"prefill_compute_s": 2.5, "kv_transfer_s": 2.0}),
            _rec("idle", 4.0, stages={"prefill_compute_s": 3.5})]
    figures = idle_figures(idle)
    assert figures["beyond_prefill_p50"] == pytest.approx(1.0)  # medians of 1.0, 2.5, 0.5
    assert figures["prefill_p50"] == pytest.approx(2.5)
    assert figures["transfer_p50"] == pytest.approx(0.8)  # a stage that is absent counts as 0
    reference = [_rec("doc", 1, (1, 2)), _rec("chat", 1), _rec("doc", 1, (3, 4)), _rec("idle", 1, (5,))]
    mine = [_rec("chat", 1), _rec("doc", 1, (1, 2)), _rec("doc", 1, (3, 9)), _rec("idle", 1, (5,))]
    assert identical(mine, reference) == (2, 3)


def test_cli_refuses_bad_arguments():
    with pytest.raises(SystemExit):
        pd_bench.main(["--links", "wan"])
    with pytest.raises(SystemExit):
        pd_bench.main(["--doc-max-tokens", "4096"])
