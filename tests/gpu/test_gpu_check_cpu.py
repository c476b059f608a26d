"""pd.tools.gpu_check on a machine without CUDA, and its report rendering (no GPU needed)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pd.tools.gpu_check import check as gpu_check
from pd.tools.gpu_check import engine as gpu_engine


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit; this machine has CUDA")
def test_without_cuda_it_exits_nonzero_with_a_clear_message_and_writes_nothing(tmp_path):
    out = tmp_path / "report.md"
    proc = subprocess.run([sys.executable, "-m", "pd.tools.gpu_check", "--out", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr and "torch.cuda.is_available() is False" in proc.stderr
    assert not out.exists() and not out.with_suffix(".json").exists()


def _report(**over) -> dict:
    report = {
        "when": "2026-01-01 00:00:00 UTC", "seconds": 123.4,
        "device": {"name": "NVIDIA H200", "memory_gib": 139.8, "torch": "2.x", "cuda": "12.8", "count": 1},
        "tests": {"ok": True, "summary": "6 passed, 25 deselected in 80.0s", "failed": []},
        "baseline": {"d2h_gbps": 50.1, "h2d_gbps": 48.2, "d2h_then_h2d_gbps": 24.6, "bytes": 1},
        "staging": {"pages_per_copy": 16, "contiguous_d2h_gbps": 40.0, "scattered_d2h_gbps": 30.0},
        "transfer": {"tcp": {"gbps": 3.2, "byte_exact": True}, "shm": {"gbps": 9.9, "byte_exact": True}},
        "engine": {"model": gpu_check.CHECK_MODEL_DOC, "params": 420_000_000, "num_requests": 32, "prompt_len": 512,
                   "decode_steps": 64, "prefill_tokens_per_s": 12345.6, "decode_tokens_per_s": 2345.6},
    }
    report.update(over)
    return report


def test_report_shows_every_figure_beside_the_baseline():
    text = gpu_check.render_markdown(_report())
    for needle in ("NVIDIA H200", "PASSED", "| connector tcp | 3.2 | True |", "| connector shm | 9.9 | True |",
                   "pinned D2H copy (baseline) | 50.1", "scattered ids | 30.0", "12345.6 tokens/s", "2345.6 tokens/s",
                   "Qwen2.5-0.5B-like"):
        assert needle in text, needle
    assert gpu_check.report_ok(_report())


def test_a_failed_test_run_an_error_or_wrong_bytes_make_the_check_fail():
    assert not gpu_check.report_ok(_report(tests={"ok": False, "summary": "1 failed", "failed": ["FAILED x"]}))
    assert not gpu_check.report_ok(_report(engine={"error": "RuntimeError: boom"}))
    assert not gpu_check.report_ok(_report(transfer={"tcp": {"gbps": 1.0, "byte_exact": False}}))
    text = gpu_check.render_markdown(_report(engine={"error": "RuntimeError: boom"},
                                             tests={"ok": False, "summary": "1 failed", "failed": ["FAILED t::x"]}))
    assert "FAILED** - 1 failed" in text and "  - FAILED t::x" in text and "error: RuntimeError: boom" in text


def test_documented_model_is_about_half_a_billion_parameters():
    from pd.engine.kv.layout import KVLayout

    cfg = gpu_engine.CHECK_MODEL
    h, layers, kv = cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads * cfg.head_dim
    per_layer = h * cfg.num_heads * cfg.head_dim * 2 + h * kv * 2 + 3 * h * cfg.intermediate_size
    total = layers * per_layer + 2 * cfg.vocab_size * h
    assert 0.35e9 < total < 0.5e9
    assert KVLayout(cfg, 16).page_size_bytes > 0
