"""gpu_check section: the engine beside transformers (static cache + torch.compile), same weights, same prompts.

First, greedy agreement in float32 (engine and transformers on one float32
copy of the weights, each prompt alone; `measure_agreement` runs it alone, as
gpu_check's `float32` section): it is the cheapest part and the one that must
never be cut by the time budget. Then, per batch size (32, 128, 1 by default):
the engine's decode tokens/s, prefill time and GPU-busy share of a decode step,
and transformers' decode tokens/s and time to the first token for the same
prompts. Batches run in the order given, the ones the targets name first, and a
batch that would start after `time_budget_s` is reported as skipped, so the
section stays inside its step of the device session whatever the compile costs.
`on_part` is called with the section after each part, so a caller can write the
figures measured so far before a later part runs (or is killed).

`engine_compare_ok` is true when every measured part ran and, where the
agreement was measured, the float32 tokens are identical; the speed targets of
the GPU issue (decode ratio >= 1.0 at 32 and 128, GPU busy >= 70% at 32, prefill
no slower than transformers' first token, all from this run) are reported beside
it, met or not, in `targets`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pd.engine.model.config import ModelConfig
from pd.tools.gpu_check.engine import CHECK_MODEL, CHECK_MODEL_DOC, check_engine, measure_engine_batch

DECODE_TARGET_BATCHES = (32, 128)
BUSY_TARGET_BATCH, BUSY_TARGET = 32, 0.70


@dataclasses.dataclass(frozen=True)
class CompareSettings:
    model: ModelConfig = CHECK_MODEL
    device: str = "cuda"
    batches: tuple[int, ...] = (32, 128, 1)
    prompt_len: int = 128
    new_tokens: int = 64
    profile_steps: int = 5
    agreement_prompts: int = 8
    agreement_tokens: int = 8
    time_budget_s: float = 200.0
    compile_hf: bool = True  # transformers compiles its decode step (CUDA only)
    kv_cache_bytes: int = 8 << 30
    agreement: bool = True  # False: gpu_check runs it as its own `float32` section


def prompts_for(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(batch)]


def ratios(engine: dict, hf: dict) -> dict:
    """Engine over transformers: decode rate (>= 1 is as fast), prefill time (<= 1 is as fast)."""
    out = {}
    if engine.get("decode_tokens_per_s") and hf.get("decode_tokens_per_s"):
        out["decode_ratio"] = round(engine["decode_tokens_per_s"] / hf["decode_tokens_per_s"], 3)
    if engine.get("prefill_s") and hf.get("first_token_s"):
        out["prefill_ratio"] = round(engine["prefill_s"] / hf["first_token_s"], 3)
    return out


def targets(section: dict) -> dict[str, bool | None]:
    """Each GPU target: met, missed, or None when this run did not measure it."""
    rows = section.get("batches", {})

    def row(b: int) -> dict:
        return rows.get(str(b), {})

    out: dict[str, bool | None] = {}
    for b in DECODE_TARGET_BATCHES:
        ratio = row(b).get("decode_ratio")
        out[f"decode >= 1.0x transformers (torch.compile) at batch {b}"] = None if ratio is None else ratio >= 1.0
    busy = row(BUSY_TARGET_BATCH).get("engine", {}).get("busy_share")
    out[f"GPU busy >= {BUSY_TARGET:.0%} of a decode step at batch {BUSY_TARGET_BATCH}"] = (
        None if busy is None else busy >= BUSY_TARGET)
    prefill = [r["prefill_ratio"] for r in rows.values() if "prefill_ratio" in r]
    out["prefill <= transformers' first-token time (every batch)"] = (
        None if not prefill else all(p <= 1.0 for p in prefill))
    agree = section.get("agreement", {})
    out["float32 greedy tokens identical to transformers"] = (
        None if "identical" not in agree else agree["identical"] == agree.get("prompts"))
    return out


def _batch_row(eng, hf_model, settings: CompareSettings, batch: int) -> dict:
    from pd.tools.gpu_check.hf_compare import measure_hf

    prompts = prompts_for(batch, settings.prompt_len, settings.model.vocab_size, seed=batch)
    measure_engine_batch(eng, prompts, 3, device=settings.device)  # warm-up at this batch's shapes
    engine = measure_engine_batch(eng, prompts, settings.new_tokens, settings.profile_steps, settings.device)
    engine_tokens = engine.pop("tokens")
    timing = measure_hf(hf_model, prompts, settings.new_tokens, compile_decode=settings.compile_hf, warmups=1)
    hf = {"first_token_s": round(timing.first_token_s, 4),
          "decode_tokens_per_s": round(timing.decode_tokens_per_s, 1)}
    same = sum(a == b for a, b in zip(engine_tokens, timing.tokens, strict=True))
    return {"engine": engine, "hf": hf, **ratios(engine, hf), "same_tokens_bf16": f"{same}/{batch}"}


def _agreement(settings: CompareSettings) -> dict:
    import torch

    from pd.tools.gpu_check.hf_compare import hf_greedy_tokens, to_hf_model

    fp32 = dataclasses.replace(settings.model, dtype="float32")
    eng = check_engine(fp32, settings.device, settings.prompt_len + settings.agreement_tokens + 8, 16,
                       min(settings.kv_cache_bytes, 2 << 30))
    prompts = prompts_for(settings.agreement_prompts, settings.prompt_len, fp32.vocab_size, seed=7)
    engine_tokens = measure_engine_batch(eng, prompts, settings.agreement_tokens, device=settings.device)["tokens"]
    hf_model = to_hf_model(eng.runner.model, settings.device, torch.float32)
    hf_tokens = hf_greedy_tokens(hf_model, prompts, settings.agreement_tokens)
    mismatched = [i for i, (a, b) in enumerate(zip(engine_tokens, hf_tokens, strict=True)) if a != b]
    out: dict = {"prompts": len(prompts), "identical": len(prompts) - len(mismatched),
                 "tokens_each": settings.agreement_tokens}
    if mismatched:
        i = mismatched[0]
        out["first_mismatch"] = {"prompt": i, "engine": engine_tokens[i], "transformers": hf_tokens[i]}
    return out


def _guarded(fn, *args) -> dict:
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a failed part is reported, the others still run
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


def measure_agreement(settings: CompareSettings = CompareSettings()) -> dict:
    """Float32 greedy agreement alone (gpu_check's `float32` section); never raises: failures are in the dict."""
    t0 = time.perf_counter()
    out = _guarded(_agreement, settings)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def agreement_ok(agree: dict) -> bool:
    """The agreement ran and every prompt's float32 greedy tokens are identical."""
    return "error" not in agree and "identical" in agree and agree["identical"] == agree["prompts"]


def measure_engine_compare(settings: CompareSettings = CompareSettings(),
                           on_part: Callable[[dict], None] | None = None) -> dict:
    """The comparison section (see the module docstring); never raises: failures are in the dict."""
    t0 = time.perf_counter()
    model_doc = CHECK_MODEL_DOC if settings.model == CHECK_MODEL else repr(settings.model)
    section: dict = {"model": model_doc, "prompt_len": settings.prompt_len, "new_tokens": settings.new_tokens,
                     "hf_compiled": settings.compile_hf, "batches": {}}
    report = on_part or (lambda _section: None)
    if settings.agreement:  # first: it must not be the part a time budget drops
        section["agreement"] = measure_agreement(settings)
        report(section)
    try:
        import torch

        from pd.tools.gpu_check.hf_compare import to_hf_model

        top = max(settings.batches)
        eng = check_engine(settings.model, settings.device, settings.prompt_len + settings.new_tokens + 8,
                           max(top, 16), settings.kv_cache_bytes)
        hf_model = to_hf_model(eng.runner.model, settings.device, settings.model.torch_dtype)
    except Exception as exc:  # noqa: BLE001 - reported, the section ends here
        section["error"] = f"{type(exc).__name__}: {exc}"[:500]
        return section
    for batch in settings.batches:
        if time.perf_counter() - t0 > settings.time_budget_s:
            section["batches"][str(batch)] = {"skipped": f"time budget of {settings.time_budget_s:.0f} s spent"}
            continue
        section["batches"][str(batch)] = _guarded(_batch_row, eng, hf_model, settings, batch)
        section["targets"] = targets(section)
        report(section)
    del eng, hf_model
    if settings.device.startswith("cuda"):
        torch.cuda.empty_cache()
    section["targets"] = targets(section)
    section["seconds"] = round(time.perf_counter() - t0, 1)
    return section


def engine_compare_ok(section: dict) -> bool:
    """Every part ran (nothing errored) and, where the section measured it, the float32 greedy tokens are
    identical (gpu_check measures them apart, as its `float32` section)."""
    parts = [section, *section.get("batches", {}).values()]
    if any("error" in p for p in parts) or not section.get("batches"):
        return False
    return "agreement" not in section or agreement_ok(section["agreement"])


def _fmt(value, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def render_engine_compare(section: dict) -> list[str]:
    """Markdown lines: the side-by-side table, float32 agreement, the targets."""
    lines = ["## Engine beside transformers (static cache + torch.compile), same weights and prompts", "",
             f"- model: {section.get('model', '?')}; {section.get('prompt_len')} prompt tokens, "
             f"{section.get('new_tokens')} new tokens per request, greedy; transformers decode compiled: "
             f"{section.get('hf_compiled')}; section took {section.get('seconds', '?')} s"]
    if "error" in section:
        return [*lines, f"- error: {section['error']}"]
    lines += ["", "| batch | engine decode tok/s | transformers + torch.compile decode tok/s | decode ratio | "
                  "engine prefill s | transformers first token s | prefill ratio | engine GPU busy | "
                  "engine step ms | kernels/step |", "|---|---|---|---|---|---|---|---|---|---|"]
    for batch, row in section.get("batches", {}).items():
        if "engine" not in row:
            lines.append(f"| {batch} | {row.get('skipped') or 'error: ' + str(row.get('error'))} |||||||||")
            continue
        e, h = row["engine"], row["hf"]
        lines.append(f"| {batch} | {_fmt(e.get('decode_tokens_per_s'))} | {_fmt(h.get('decode_tokens_per_s'))} | "
                     f"{_fmt(row.get('decode_ratio'), '.2f')}x | {_fmt(e.get('prefill_s'))} | "
                     f"{_fmt(h.get('first_token_s'))} | {_fmt(row.get('prefill_ratio'), '.2f')} | "
                     f"{_fmt(e.get('busy_share'), '.0%')} | {_fmt(e.get('step_ms'))} | "
                     f"{_fmt(e.get('kernels_per_step'))} |")
    if "agreement" in section:
        lines += ["", *render_agreement(section["agreement"])]
    lines += ["", "| target | met |", "|---|---|"]
    for name, met in section.get("targets", {}).items():
        lines.append(f"| {name} | {'unmeasured' if met is None else 'yes' if met else 'NO'} |")
    return lines


def render_agreement(agree: dict) -> list[str]:
    """Markdown lines of the float32 greedy agreement (its own section in gpu_check, a line in this one)."""
    if "identical" not in agree:
        return [f"- float32 greedy agreement: {agree.get('skipped') or 'error: ' + str(agree.get('error'))}"]
    lines = [f"- float32 greedy agreement: {agree['identical']}/{agree['prompts']} prompts identical "
             f"({agree['tokens_each']} tokens each)"]
    if "first_mismatch" in agree:
        lines.append(f"  - first mismatch: {agree['first_mismatch']}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """`python -m pd.tools.gpu_check.engine_compare [--out engine_compare.md]`: this section alone."""
    parser = argparse.ArgumentParser(prog="python -m pd.tools.gpu_check.engine_compare",
                                     description="the engine beside transformers on one GPU")
    parser.add_argument("--out", default="engine_compare.md", help="markdown report (JSON goes beside it)")
    parser.add_argument("--batches", default="32,128,1", help="comma-separated batch sizes, in run order")
    parser.add_argument("--budget-s", type=float, default=CompareSettings.time_budget_s)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    settings = CompareSettings(batches=tuple(int(b) for b in args.batches.split(",")), time_budget_s=args.budget_s)
    out = Path(args.out)

    def write(section: dict) -> None:  # after each part too: a run stopped later keeps what it measured
        out.write_text("\n".join(render_engine_compare(section)) + "\n")
        out.with_suffix(".json").write_text(json.dumps(section, indent=2, sort_keys=True) + "\n")

    section = measure_engine_compare(settings, on_part=write)
    write(section)
    print(out.read_text(), flush=True)
    return 0 if engine_compare_ok(section) else 1


if __name__ == "__main__":
    sys.exit(main())
