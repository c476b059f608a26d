"""Smoke tests of `python -m kvcache.bench` on tiny traces (no timing assertions)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcache import bench
from kvcache.audit import assert_all_free

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--requests", "12", "--prompt-min", "20", "--prompt-max", "90", "--prefix-len", "40",
        "--decode-steps", "5", "--num-blocks", "64", "--vocab", "500", "--seed", "7"]
ANCHOR_KEYS = {"vllm_version", "torch_version", "args", "wall_s", "manager_ops",
               "manager_time_s", "manager_ops_per_s", "ops_per_s_wall", "requests_per_s_wall",
               "prefix_hit_rate", "prompt_tokens", "hit_tokens", "alloc_failures", "mean_us",
               "total_s", "free_blocks_end"}


def run_cli(*argv, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "kvcache.bench", *argv], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)
    return proc


def json_line(proc) -> dict:
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("JSON:")]
    assert len(lines) == 1, proc.stdout
    return json.loads(lines[0][5:])


def test_generate_dump_and_replay_agree(tmp_path):
    trace = tmp_path / "trace.jsonl"
    generated = json_line(run_cli(*TINY, "--dump-trace", str(trace)))
    assert ANCHOR_KEYS <= generated.keys()
    assert generated["free_blocks_end"] == 63
    assert generated["manager_ops"] == 12 * (3 + 5)  # hit + prompt + 5 decodes + free
    lines = trace.read_text().splitlines()
    assert len(lines) == 12 and set(json.loads(lines[0])) == {"id", "prompt", "decode", "shared"}

    replayed = json_line(run_cli(*TINY, "--trace", str(trace), "--concurrency", "4"))
    for key in ("prefix_hit_rate", "prompt_tokens", "free_blocks_end", "manager_ops"):
        assert replayed[key] == generated[key], key
    assert replayed["prefix_hit_rate"] > 0  # the shared system prefix is hit


def test_xxhash_same_decisions():
    sha = json_line(run_cli(*TINY, "--concurrency", "3"))
    xx = json_line(run_cli(*TINY, "--concurrency", "3", "--hash", "xxhash"))
    assert (xx["hit_tokens"], xx["free_blocks_end"]) == (sha["hit_tokens"], sha["free_blocks_end"])


def test_in_process_run_leaves_pool_free():
    args = bench.parse_args(TINY + ["--concurrency", "5"])
    trace = bench.trace_for(args)
    mgr = bench.make_manager(args)
    result = bench.run(args, trace, mgr)
    assert result["alloc_failures"] == 0
    assert_all_free(mgr)


def test_pool_pressure_counts_failures():
    args = bench.parse_args(TINY + ["--num-blocks", "12", "--concurrency", "8"])
    mgr = bench.make_manager(args)
    result = bench.run(args, bench.trace_for(args), mgr)
    assert result["alloc_failures"] > 0
    assert_all_free(mgr)


def test_bad_trace_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "0", "prompt": [1, 2]}\n')
    proc = run_cli("--trace", str(bad))
    assert proc.returncode != 0
    assert "bad.jsonl:1: not a trace line" in proc.stderr


def test_vs_vllm_flags_are_validated(tmp_path):
    proc = run_cli("--vs-vllm", str(tmp_path / "no-venv"), "--requests", "2")
    assert proc.returncode != 0 and "no python in vLLM venv" in proc.stderr
    proc = run_cli("--vs-vllm", "--trace", "x.jsonl")
    assert proc.returncode != 0 and "--vs-vllm uses the generated trace" in proc.stderr


def test_vs_vllm_same_trace_and_decisions():
    """With the anchor venv present: one tiny round each side, identical trace and decisions."""
    venv = Path(os.environ.get("PDKV_VLLM_VENV", bench.DEFAULT_VENV))
    if not (venv / "bin" / "python").exists():
        pytest.skip("vLLM anchor venv not found (set PDKV_VLLM_VENV)")
    if not Path(bench.DEFAULT_ANCHOR).exists():
        pytest.skip(f"anchor script {bench.DEFAULT_ANCHOR} not found")
    result = json_line(run_cli(*TINY, "--concurrency", "4", "--vs-vllm", str(venv),
                               "--rounds", "1", timeout=600))
    assert result["trace_identical"] is True
    assert result["decisions_agree"] is True, result["disagreements"]
    assert result["ratio_median"] > 0
