"""pd.tools.gpu_check on a machine without CUDA, and its report rendering (no GPU needed)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import torch

from pd.tools.gpu_check import check as gpu_check
from pd.tools.gpu_check import engine as gpu_engine
from test_engine_compare_cpu import _section as engine_section
from test_served_cpu import _section as served_section
from test_transfer_section_cpu import _section as transfer_section


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit; this machine has CUDA")
def test_without_cuda_it_exits_nonzero_with_a_clear_message_and_writes_nothing(tmp_path):
    out = tmp_path / "report.md"
    proc = subprocess.run([sys.executable, "-m", "pd.tools.gpu_check", "--out", str(out)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr and "torch.cuda.is_available() is False" in proc.stderr
    assert not out.exists() and not out.with_suffix(".json").exists()


def _report(**over) -> dict:
    report = {
        "when": "2026-01-01 00:00:00 UTC", "seconds": 123.4,
        "device": {"name": "NVIDIA H200", "memory_gib": 139.8, "torch": "2.x", "cuda": "12.8", "count": 1},
        "tests": {"ok": True, "summary": "6 passed, 25 deselected in 80.0s", "failed": []},
        "transfer": transfer_section(), "engine": engine_section(), "served": served_section(),
    }
    report.update(over)
    return report


def test_report_shows_every_section_beside_its_anchor():
    text = gpu_check.render_markdown(_report())
    for needle in ("NVIDIA H200", "PASSED", "## KV transfer", "torch.compile", "| 32 | 10000.0 | 8000.0 | 1.25x |",
                   "| colocated (0.5 GPU each) | 8 |", "**identical** (8/8 prompts"):
        assert needle in text, needle
    assert gpu_check.report_ok(_report())


def test_a_failed_test_run_an_error_wrong_bytes_or_differing_tokens_make_the_check_fail():
    assert not gpu_check.report_ok(_report(tests={"ok": False, "summary": "1 failed", "failed": ["FAILED x"]}))
    assert not gpu_check.report_ok(_report(engine={"error": "RuntimeError: boom"}))
    assert not gpu_check.report_ok(_report(transfer=transfer_section(tcp={"gbps": 1.0, "byte_exact": False})))
    differing = served_section()
    differing["greedy"] = {"dtype": "float32", "identical": 7, "prompts": 8}
    assert not gpu_check.report_ok(_report(served=differing))
    text = gpu_check.render_markdown(_report(engine={"error": "RuntimeError: boom"},
                                             tests={"ok": False, "summary": "1 failed", "failed": ["FAILED t::x"]}))
    assert "FAILED** - 1 failed" in text and "  - FAILED t::x" in text and "RuntimeError: boom" in text


def test_sections_run_in_order_and_a_section_left_out_is_not_judged():
    assert gpu_check.SECTIONS[0] == "float32" and gpu_check.SECTIONS[-1] == "served"
    assert gpu_check.parse_sections("served,tests,float32") == ("float32", "tests", "served")
    with pytest.raises(argparse.ArgumentTypeError):
        gpu_check.parse_sections("engine,warp")
    report = _report()
    del report["served"], report["engine"]
    assert gpu_check.report_ok(report) and "## KV transfer" in gpu_check.render_markdown(report)


def test_float32_agreement_is_its_own_section_and_decides_the_check():
    agree = {"prompts": 8, "identical": 8, "tokens_each": 8, "seconds": 20.0}
    report = _report(float32=agree)
    text = gpu_check.render_markdown(report)
    assert "## Float32 greedy agreement" in text and "8/8 prompts identical" in text
    assert text.index("## Float32") < text.index("## Engine beside transformers")
    assert gpu_check.report_ok(report)
    assert not gpu_check.report_ok(_report(float32={**agree, "identical": 7}))
    assert not gpu_check.report_ok(_report(float32={"error": "RuntimeError: boom"}))


def test_dry_run_checks_the_arguments_and_writes_the_plan_without_cuda(tmp_path):
    out = tmp_path / "engine.json"
    ok = subprocess.run([sys.executable, "-m", "pd.tools.gpu_check", "--only", "engine,float32", "--json-only",
                         "--engine-batches", "32,128,1", "--engine-budget-s", "90", "--out", str(out), "--dry-run"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    plan = json.loads(out.read_text())
    assert plan["dry_run"] and plan["sections"] == ["float32", "engine"]
    assert plan["engine_batches"] == [32, 128, 1] and plan["engine_budget_s"] == 90
    bad = subprocess.run([sys.executable, "-m", "pd.tools.gpu_check", "--sections", "engine,warp", "--dry-run",
                          "--out", str(tmp_path / "bad.json")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "subset of float32,engine" in bad.stderr
    assert not (tmp_path / "bad.json").exists()


def test_documented_model_is_about_half_a_billion_parameters():
    from pd.engine.kv.layout import KVLayout

    cfg = gpu_engine.CHECK_MODEL
    h, layers, kv = cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads * cfg.head_dim
    per_layer = h * cfg.num_heads * cfg.head_dim * 2 + h * kv * 2 + 3 * h * cfg.intermediate_size
    total = layers * per_layer + 2 * cfg.vocab_size * h
    assert 0.35e9 < total < 0.5e9
    assert KVLayout(cfg, 16).page_size_bytes > 0


def test_the_prepared_device_session_parses_and_runs_each_section_as_its_own_step():
    """tests/gpu/device_session.sh is what a GPU machine runs as it is: it must parse, and each gpu_check
    section must be one step of it (tests/tools/test_device_session_cpu.py runs its dry form)."""
    script = gpu_check.REPO / "tests" / "gpu" / "device_session.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=30).returncode == 0
    text = script.read_text()
    for section in ("float32", "engine", "transfer", "served"):
        assert f"\ngpu_check {section}" in text, section
    listed = subprocess.run(["bash", str(script), "--print-gpu-tests"], capture_output=True, text=True, timeout=30)
    assert listed.stdout.split() == list(gpu_check.GPU_TEST_ARGS)  # gpu_check's tests section: the same selection


def test_sections_run_float32_first_and_the_report_is_on_disk_before_each_next_part(tmp_path, monkeypatch):
    """main() with every measurement replaced by a recorder (no GPU here): the sections run in SECTIONS'
    order whatever order they are asked in, and each part finds the earlier parts' figures already in the
    JSON report, so a run stopped at any point keeps what it measured."""
    out = tmp_path / "report.json"
    seen: list[tuple[str, list[str]]] = []

    def on_disk() -> list[str]:  # the sections the JSON report holds figures of
        report = json.loads(out.read_text()) if out.exists() else {}
        return sorted(k for k, v in report.items() if k in gpu_check.SECTIONS and v.get("summary") != "not asked for")

    def recorder(name: str, result: dict):
        def measure(*_args, on_part=None, **_kw):
            seen.append((name, on_disk()))
            if on_part is not None:  # a part-way report, as the engine's batches and served's deployments make
                on_part({"partial": True})
                seen.append((f"{name} part", on_disk()))
            return result
        return measure

    monkeypatch.setattr(gpu_check, "cuda_missing_reason", lambda: None)
    monkeypatch.setattr(gpu_check.torch.cuda, "get_device_properties",
                        lambda _i: argparse.Namespace(name="Fake GPU", total_memory=80 << 30))
    monkeypatch.setattr(gpu_check.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(gpu_check.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(gpu_check, "measure_agreement", recorder("float32", {"prompts": 8, "identical": 8,
                                                                             "tokens_each": 8}))
    engine = engine_section()
    del engine["agreement"]  # measured apart, as the float32 section
    monkeypatch.setattr(gpu_check, "measure_engine_compare", recorder("engine", engine))
    monkeypatch.setattr(gpu_check, "measure_transfer", recorder("transfer", transfer_section()))
    monkeypatch.setattr(gpu_check, "run_gpu_tests", recorder("tests", {"ok": True, "summary": "27 passed"}))
    monkeypatch.setattr(gpu_check, "measure_served", recorder("served", served_section()))
    rc = gpu_check.main(["--sections", "served,tests,transfer,engine,float32", "--json-only", "--out", str(out)])
    assert [name for name, _ in seen] == ["float32", "engine", "engine part", "transfer", "tests", "served",
                                          "served part"]
    assert dict(seen) == {"float32": [], "engine": ["float32"], "engine part": ["engine", "float32"],
                          "transfer": ["engine", "float32"], "tests": ["engine", "float32", "transfer"],
                          "served": ["engine", "float32", "tests", "transfer"],
                          "served part": ["engine", "float32", "served", "tests", "transfer"]}
    final = json.loads(out.read_text())
    assert final["sections"] == list(gpu_check.SECTIONS) and final["device"]["name"] == "Fake GPU"
    assert not out.with_suffix(".md").exists()  # --json-only
    assert rc == 0
