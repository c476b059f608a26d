"""gpu_check's served run on the CPU: the same code path end to end (embedded Ray, the router,
`python -m pd.loadgen`, the greedy comparison, the pool audits) with the tiny CPU model, so that the
GPU run cannot fail on a typo; and its rendering and verdict from sections built by hand."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest

from pd.cluster.config import load_deploy_config
from pd.tools.gpu_check.served import (ONE_GPU_CONFIG, ServedPlan, compare_greedy, load_figures, measure_served,
                                       render_served, served_configs, served_ok)

REPO = Path(__file__).resolve().parents[2]
SMALL = ServedPlan(concurrencies=(1, 3), prompts_per_slot=1, input_len=40, output_len=6, greedy_prompts=3,
                   greedy_tokens=8, warmups=1)


def test_served_run_end_to_end_on_the_cpu():
    """As on the GPU: the loads at bfloat16, the greedy comparison on a float32 pair of its own."""
    base = load_deploy_config(REPO / "deploy" / "local.yaml").replace(
        topology__cpus_per_worker=0.1, transfer__timeout_s=10.0, model__dtype="bfloat16")
    section = measure_served(base, SMALL)
    for name in ("colocated", "pd_one_gpu"):
        part = section[name]
        assert "error" not in part, part
        assert [r["concurrency"] for r in part["runs"]] == [1, 3]
        for row in part["runs"]:
            assert row["completed"] == SMALL.num_prompts(row["concurrency"]) and row["failed"] == 0
            assert row["ttft_p50_ms"] > 0 and row["tpot_p50_ms"] > 0 and row["output_tokens_per_s"] > 0
        assert part["pools_all_free"] is True
        assert len(part["greedy_token_ids"]) == SMALL.greedy_prompts
        assert all(len(ids) == SMALL.greedy_tokens for ids in part["greedy_token_ids"])
    assert section["pd_one_gpu"]["topology"] == "1P1D" and section["colocated"]["topology"] == "colocated x1"
    for row in section["pd_one_gpu"]["runs"]:  # every P/D request's KV crossed from P to D, and was timed
        assert row["kv_loads"] >= row["completed"] and row["kv_load_mean_ms"] > 0
        assert "kv_transfer_p50_ms" not in row  # P's first token went to the client: the pull is not in TTFT
    assert all("kv_transfer_p50_ms" not in r for r in section["colocated"]["runs"])
    assert section["greedy"] == {"dtype": "float32", "identical": SMALL.greedy_prompts,
                                 "prompts": SMALL.greedy_prompts}
    for name, part in section["greedy_runs"].items():  # the float32 pair: started, answered, all free
        assert "error" not in part and part["pools_all_free"] is True and "runs" not in part, (name, part)
    assert section["greedy_served_dtype"]["prompts"] == SMALL.greedy_prompts  # reported, not judged
    assert served_ok(section)
    text = "\n".join(render_served(section))
    assert "greedy tokens (float32), 1P1D vs colocated: **identical** (3/3 prompts" in text
    assert "for information, at the served bfloat16:" in text
    assert text.count("| colocated | ") == 2 and text.count("| 1P1D | ") == 2  # cpu: no GPU share to name


def test_the_served_deployments_keep_the_one_gpu_share_and_differ_only_in_topology():
    configs = served_configs(load_deploy_config(ONE_GPU_CONFIG))
    colocated, pd = configs["colocated"].topology, configs["pd_one_gpu"].topology
    assert colocated.mode.value == "colocated" and colocated.num_colocated == 1
    assert (pd.mode.value, pd.num_prefill, pd.num_decode) == ("disaggregated", 1, 1)
    assert colocated.gpus_per_worker == pd.gpus_per_worker == 0.5 and pd.device == "cuda"
    assert configs["colocated"].router.port == 0 == configs["pd_one_gpu"].router.port


def _section() -> dict:
    row = {"concurrency": 8, "completed": 16, "failed": 0, "ttft_p50_ms": 41.5, "ttft_p99_ms": 90.0,
           "tpot_p50_ms": 3.9, "itl_p50_ms": 3.8, "output_tokens_per_s": 2100.4, "duration_s": 1.0}
    pd_row = dict(row, kv_transfer_p50_ms=2.25, kv_load_mean_ms=2.5, kv_loads=16)
    return {"device": "cuda", "model": "m", "dtype": "bfloat16", "ray_gpus": 1.0, "seconds": 80.0,
            "plan": {"input_len": 256, "output_len": 64, "greedy_tokens": 32},
            "colocated": {"gpus_per_worker": 0.5, "runs": [row], "pools_all_free": True},
            "pd_one_gpu": {"gpus_per_worker": 0.5, "runs": [pd_row], "pools_all_free": True},
            "greedy": {"dtype": "float32", "identical": 8, "prompts": 8},
            "greedy_served_dtype": {"identical": 7, "prompts": 8},
            "greedy_runs": {"colocated": {"pools_all_free": True}, "pd_one_gpu": {"pools_all_free": True}}}


def test_render_shows_each_row_the_transfer_and_the_greedy_verdict():
    section = _section()
    lines = render_served(section)
    assert "| colocated (0.5 GPU each) | 8 | 41.5 | 3.9 | 2100.4 | - | 16 ok, 0 failed |" in lines
    assert "| 1P1D (0.5 GPU each) | 8 | 41.5 | 3.9 | 2100.4 | 2.25 | 16 ok, 0 failed |" in lines
    assert "- greedy tokens (float32), 1P1D vs colocated: **identical** (8/8 prompts, 32 tokens each)" in lines
    assert any(line.startswith("- for information, at the served bfloat16: 7/8 prompts identical") for line in lines)
    assert "- pd_one_gpu: decode worker's mean KV load per request: c=8 2.5 ms" in lines
    assert served_ok(section)


@pytest.mark.parametrize("breakage", ["greedy", "failed", "leak", "error", "no_runs", "greedy_pair_leak"])
def test_the_verdict_fails_on_differing_tokens_failed_requests_leaks_and_errors(breakage):
    section = copy.deepcopy(_section())
    if breakage == "greedy":
        section["greedy"] = compare_greedy([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]])
        assert section["greedy"] == {"identical": 1, "prompts": 2, "first_mismatch": {"prompt": 1, "token": 1}}
        assert any("**DIFFER** (1/2 prompts" in line for line in render_served(section))
    elif breakage == "failed":
        section["pd_one_gpu"]["runs"][0]["failed"] = 1
    elif breakage == "leak":
        section["colocated"]["pools_all_free"] = False
        section["colocated"]["pool_audits"] = {"both-0": "3 blocks held"}
        assert any("NOT all free" in line and "3 blocks held" in line for line in render_served(section))
    elif breakage == "error":
        section["pd_one_gpu"] = {"gpus_per_worker": 0.5, "error": "RuntimeError: no GPU"}
        assert any("error: RuntimeError: no GPU" in line for line in render_served(section))
    elif breakage == "no_runs":
        section["colocated"]["runs"] = []
    else:
        section["greedy_runs"]["pd_one_gpu"] = {"pools_all_free": False, "pool_audits": {"decode-0": "1 held"}}
        assert "- pd_one_gpu (float32): KV pools NOT all free after the run: {'decode-0': '1 held'}" \
            in render_served(section)
    assert not served_ok(section)


def test_load_figures_read_loadgens_result_keys():
    result = {"completed": 4, "failed": 0, "median_ttft_ms": 12.345, "p99_ttft_ms": 20.0, "median_tpot_ms": 1.2345,
              "median_itl_ms": 1.1, "output_throughput": 321.06, "duration": 2.5,
              "pdkv_ttft_breakdown": {"stages_p50_s": {"kv_transfer_s": 0.0031}},
              "pdkv_kv_load_latency_mean_ms": {"decode-0": 2.75}, "pdkv_kv_loads": 4.0}
    row = load_figures(8, result)
    assert row == {"concurrency": 8, "completed": 4, "failed": 0, "ttft_p50_ms": 12.35, "ttft_p99_ms": 20.0,
                   "tpot_p50_ms": 1.234, "itl_p50_ms": 1.1, "output_tokens_per_s": 321.1, "duration_s": 2.5,
                   "kv_transfer_p50_ms": 3.1, "kv_load_mean_ms": 2.75, "kv_loads": 4}
