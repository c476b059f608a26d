"""`pd.tools.route_bench` end to end on a small workload: 2P2D workers in processes of their own, the
real router, an open-loop (Poisson) load; the figures it prints are for the benchmark, here only
its rules are checked."""
from __future__ import annotations

import pytest
from tests.helpers.e2e import wait_all_free

from pd.tools.route_bench import cli as route_bench
from pd.tools.route_bench import report
from pd.tools.route_bench.workload import BranchingWorkload, BurstWorkload, arrival_offsets


@pytest.mark.timeout(300)
def test_open_loop_run_sends_every_node_at_its_arrival_and_leaves_pools_free():
    work = BranchingWorkload(tenants=2, roots=2, depth=3, one_offs=2, abort_rate=0.2, rate=2.0, seed=3)
    nodes = [n for t in work.trees() for n in t.walk()]
    with route_bench.deployment(route_bench.bench_config(12.0), "prefix_aware", None) as dep:
        run = route_bench.measure(dep, work)
        wait_all_free(dep.url)  # aborted clients included: every block went back to its pool
    row = route_bench.summarize("prefix_aware", work.seed, [run, run])
    assert row["requests"] == 2 * len(run.records) and row["repeats"] == 2  # repeats pool their requests
    row = route_bench.summarize("prefix_aware", work.seed, [run])
    assert row["requests"] + row["aborted"] == len(nodes)
    assert row["aborted"] > 0  # this seed draws client aborts; they are counted apart
    # open loop: the last tree is not sent before its arrival time, whatever the earlier ones took
    assert row["seconds"] >= arrival_offsets(len(work.trees()), work.rate, work.seed)[-1]
    # a child repeats its parent's prompt and reply: prefix_aware finds it on the P that served the parent
    assert 0 < row["hit_rate"] < 1 and 0 < row["oracle"] < 1
    assert row["blocks_p_to_d"] > 0


@pytest.mark.timeout(300)
def test_burst_run_checks_the_index_against_every_cache_and_reports_the_policies_side_by_side():
    work = BurstWorkload(bursts=2, burst_size=3, depth=2, abort_rate=0.2, rate=2.0, seed=1)
    with route_bench.deployment(route_bench.bench_config(12.0), "prefix_aware", None) as dep:
        run = route_bench.measure(dep, work)
        wait_all_free(dep.url)
    # the index was compared with each of the 4 workers' caches after the run, and matched
    assert sorted(run.index_exact) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
    assert all(run.index_exact.values()), run.index_exact
    row = route_bench.summarize("prefix_aware", work.seed, [run])
    assert row["requests"] + row["aborted"] == sum(1 for t in work.trees() for _ in t.walk())
    assert 0 < row["oracle"] < 1 and report.hit_ratio(row) == row["hit_rate"] / row["oracle"]
    # the side-by-side table: prefix_aware's ratios to the others, from the rows it is given
    other = {**row, "policy": "least_loaded", "ttft_p50_s": 2 * row["ttft_p50_s"], "ttft_p90_s": 4 * row["ttft_p90_s"],
             "text_p90_s": 5 * row["text_p90_s"]}
    line = report.format_summary([row, other]).splitlines()[-1]
    assert f"| {report.hit_ratio(row):.3f} |" in line and "| 0.50 | 0.25 | - | - | 0.20 | yes |" in line
    # TTFT is to the first token's chunk; the first visible text comes with it or later (never before)
    assert all(0 < r.ttft_s <= r.text_s for r in run.records)
    assert len(row["records"]) == len(run.records) and {r["run"] for r in row["records"]} == {0}
