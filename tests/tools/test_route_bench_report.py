"""`pd.tools.route_bench`'s rows and tables from given records (no processes): the per-seed rows, and
the workload as a whole, every seed's requests pooled."""
from __future__ import annotations

import math
import random

from pd.tools.percentile import percentile
from pd.tools.route_bench import cli, report


def _run(rng: random.Random, n: int, scale: float) -> cli.Run:
    records = []
    for i in range(n):
        ttft = scale * rng.uniform(0.05, 0.3)
        records.append(cli.Record(ttft_s=ttft, prompt_tokens=400, cached_tokens=rng.randrange(0, 400, 16),
                                  best_hit=rng.randrange(0, 400, 16), completion_tokens=8,
                                  workers=("prefill-0", "decode-1"), start_s=0.01 * i,
                                  text_s=ttft + rng.choice((0.0, 0.01))))
    return cli.Run(records, aborted=1, seconds=2.0, blocks_p_to_d=10,
                   index_exact={"prefill-0": True, "decode-1": True})


def _rows(seeds: list[int]) -> list[dict]:
    rng = random.Random(7)
    rows = []
    for seed in seeds:
        for policy, scale in (("prefix_aware", 1.0), ("least_loaded", 1.0 + seed), ("round_robin", 1.5)):
            rows.append(cli.summarize(policy, seed, [_run(rng, 40 + 10 * seed, scale) for _ in range(2)]))
    return rows


def test_a_row_keeps_each_request_with_its_run_and_its_first_token_and_text_times():
    row = _rows([1])[0]
    assert row["requests"] == len(row["records"]) == 100 and {r["run"] for r in row["records"]} == {0, 1}
    assert row["ttft_p90_s"] == percentile([r["ttft_s"] for r in row["records"]], 90, math.nan)
    assert row["text_p90_s"] == percentile([r["text_s"] for r in row["records"]], 90, math.nan)
    assert row["text_p90_s"] >= row["ttft_p90_s"]


def test_one_seed_has_no_pooled_line_and_several_seeds_pool_every_request():
    one = report.format_summary(_rows([1])).splitlines()
    assert len(one) == 3 and not any(line.startswith("| all seeds") for line in one)
    rows = _rows([1, 2, 3])
    lines = report.format_summary(rows).splitlines()
    assert [line.split(" |")[0] for line in lines[2:]] == ["| 1", "| 2", "| 3", "| all seeds"]
    pa = report.pooled([r for r in rows if r["policy"] == "prefix_aware"])
    ll = report.pooled([r for r in rows if r["policy"] == "least_loaded"])
    everyone = [r["ttft_s"] for row in rows if row["policy"] == "prefix_aware" for r in row["records"]]
    assert len(pa["records"]) == len(everyone) == 2 * (50 + 60 + 70)
    # a p90 over every request of every seed: not the mean (or any mix) of the per-seed p90s
    assert pa["ttft_p90_s"] == percentile(everyone, 90, math.nan)
    per_seed = [r["ttft_p90_s"] for r in rows if r["policy"] == "prefix_aware"]
    assert pa["ttft_p90_s"] != sum(per_seed) / len(per_seed)
    prompt = sum(r["prompt_tokens"] for r in pa["records"])
    assert pa["hit_rate"] == sum(r["cached_tokens"] for r in pa["records"]) / prompt
    cells = [c.strip() for c in lines[-1].split("|")[1:-1]]
    assert cells[0] == "all seeds" and cells[1] == f"{report.hit_ratio(pa):.3f}"
    assert cells[5] == f"{pa['ttft_p90_s'] / ll['ttft_p90_s']:.2f}"  # p90 pa/ll
    assert cells[8] == f"{pa['text_p90_s'] / ll['text_p90_s']:.2f}" and cells[9] == "yes"  # first text; 12 checks


def test_a_failed_index_check_in_any_seed_shows_in_the_pooled_line():
    rows = _rows([1, 2])
    rows[-1]["index_checks"][0] = False  # seed 2's round_robin: one worker's index did not match
    lines = report.format_summary(rows).splitlines()
    assert lines[-2].endswith("| NO |") and lines[-1].endswith("| NO |") and lines[-3].endswith("| yes |")
