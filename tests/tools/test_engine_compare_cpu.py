"""gpu_check's engine-vs-transformers section on the CPU: its arithmetic, its report, and one real run of
both sides (engine and transformers, same weights and prompts) on a tiny model."""
from __future__ import annotations

import pytest

from pd.engine.model.config import ModelConfig
from pd.tools.gpu_check.engine_compare import (CompareSettings, engine_compare_ok, measure_engine_compare, ratios,
                                               render_engine_compare, targets)
from pd.tools.gpu_check.gpu_busy import busy_share

TINY = ModelConfig(vocab_size=260, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2)


def test_busy_share_counts_overlaps_once_and_clips_to_the_window():
    assert busy_share([(0, 10)], (0, 10)) == 1.0
    assert busy_share([(0, 4), (2, 6), (8, 9)], (0, 10)) == pytest.approx(0.7)  # union 0-6 and 8-9
    assert busy_share([(-5, 2), (9, 20)], (0, 10)) == pytest.approx(0.3)
    assert busy_share([], (0, 10)) == 0.0
    with pytest.raises(ValueError):
        busy_share([(0, 1)], (3, 3))


def test_ratios_are_engine_over_transformers():
    r = ratios({"decode_tokens_per_s": 300.0, "prefill_s": 0.2}, {"decode_tokens_per_s": 200.0, "first_token_s": 0.4})
    assert r == {"decode_ratio": 1.5, "prefill_ratio": 0.5}
    assert ratios({"decode_tokens_per_s": 300.0}, {}) == {}


def _section(**over) -> dict:
    def row(ratio, busy, prefill_ratio):
        return {"engine": {"decode_tokens_per_s": 8000.0 * ratio, "prefill_s": 0.1 * prefill_ratio,
                           "busy_share": busy, "step_ms": 3.9, "kernels_per_step": 410.0},
                "hf": {"decode_tokens_per_s": 8000.0, "first_token_s": 0.1},
                "decode_ratio": ratio, "prefill_ratio": prefill_ratio}
    section = {"model": "tiny", "prompt_len": 128, "new_tokens": 64, "hf_compiled": True, "seconds": 150.2,
               "batches": {"32": row(1.25, 0.81, 0.9), "128": row(0.75, 0.6, 1.2), "1": {"skipped": "time budget"}},
               "agreement": {"prompts": 8, "identical": 8, "tokens_each": 8}}
    section.update(over)
    section["targets"] = targets(section)
    return section


def test_targets_say_met_missed_or_unmeasured():
    t = _section()["targets"]
    assert t["decode >= 1.0x transformers (torch.compile) at batch 32"] is True
    assert t["decode >= 1.0x transformers (torch.compile) at batch 128"] is False
    assert t["GPU busy >= 70% of a decode step at batch 32"] is True
    assert t["prefill <= transformers' first-token time (every batch)"] is False
    assert t["float32 greedy tokens identical to transformers"] is True
    bare = targets({"batches": {}, "agreement": {"skipped": "x"}})
    assert all(v is None for v in bare.values())


def test_report_names_torch_compile_and_shows_every_figure():
    text = "\n".join(render_engine_compare(_section()))
    for needle in ("torch.compile", "| 32 | 10000.0 | 8000.0 | 1.25x |", "| 128 | 6000.0 | 8000.0 | 0.75x |",
                   "81%", "| 1 | time budget |", "8/8 prompts identical", "| NO |", "| yes |"):
        assert needle in text, needle
    failed = _section(agreement={"prompts": 8, "identical": 7, "tokens_each": 8,
                                 "first_mismatch": {"prompt": 3, "engine": [1], "transformers": [2]}})
    text = "\n".join(render_engine_compare(failed))
    assert "7/8" in text and "first mismatch" in text
    assert "error: RuntimeError: x" in "\n".join(render_engine_compare({"error": "RuntimeError: x"}))


def test_ok_needs_every_part_and_identical_float32_tokens():
    assert engine_compare_ok(_section())
    without = _section()
    del without["agreement"]  # gpu_check measures it apart (its float32 section): judged there
    assert engine_compare_ok(without) and not engine_compare_ok({**without, "batches": {}})
    assert not engine_compare_ok(_section(agreement={"prompts": 8, "identical": 7, "tokens_each": 8}))
    assert not engine_compare_ok(_section(agreement={"error": "boom"}))
    broken = _section()
    broken["batches"]["32"] = {"error": "CUDA error"}
    assert not engine_compare_ok(broken)


def test_both_sides_run_on_the_cpu_with_a_tiny_model():
    """The whole section (engine and transformers with a static cache, no compile on the CPU) on one
    tiny model: every batch measured, and the float32 greedy tokens of the two sides identical."""
    settings = CompareSettings(model=TINY, device="cpu", batches=(1, 3), prompt_len=8, new_tokens=16, profile_steps=0,
                               agreement_prompts=2, agreement_tokens=4, compile_hf=False, kv_cache_bytes=4 << 20,
                               time_budget_s=120.0)
    parts = []  # what the section held each time it reported a part: float32 agreement first, then each batch
    section = measure_engine_compare(settings, on_part=lambda s: parts.append((sorted(s), list(s["batches"]))))
    assert parts == [(["agreement", "batches", "hf_compiled", "model", "new_tokens", "prompt_len"], []),
                     (["agreement", "batches", "hf_compiled", "model", "new_tokens", "prompt_len", "targets"], ["1"]),
                     (["agreement", "batches", "hf_compiled", "model", "new_tokens", "prompt_len", "targets"],
                      ["1", "3"])]
    assert "error" not in section, section
    for batch in ("1", "3"):
        row = section["batches"][batch]
        assert "error" not in row, row
        assert row["engine"]["decode_tokens_per_s"] > 0 and row["hf"]["decode_tokens_per_s"] > 0
        assert row["decode_ratio"] > 0 and row["prefill_ratio"] > 0
        assert row["same_tokens_bf16"] == f"{batch}/{batch}"  # (float32 here: identical tokens)
    assert section["agreement"]["identical"] == 2
    assert engine_compare_ok(section)
    assert "| 3 |" in "\n".join(render_engine_compare(section))
