"""Figures of the peer benchmark (pd/tools/peer_bench/cli.py): per wave, per (server, c), ratios.

A wave's tokens/s is its completion tokens over its wall time (first request sent to last
token received). Per (server, c) each figure is the median over the measured rounds of that
round's figure (TTFT/TPOT p50 and p90 over the wave's requests). The TTFT breakdown is the
p50 of each stage of the router's `pdkv_timing` over every measured request of the class.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from pd.tools.loadgen.report import RequestRecord
from pd.tools.percentile import percentile
from pd.tools.ttft_breakdown import ttft_breakdown

FIGURES = ("tokens_per_s", "ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s")


@dataclass
class WaveFigures:
    concurrency: int
    num_ok: int
    num_failed: int
    output_tokens: int
    duration_s: float
    tokens_per_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    tpot_p50_s: float
    tpot_p90_s: float
    prompt_tokens_mean: float
    timings: list[dict] = field(default_factory=list)  # the requests' `pdkv_timing` objects, where sent
    errors: list[str] = field(default_factory=list)


def wave_figures(concurrency: int, records: list[RequestRecord]) -> WaveFigures:
    ok = [r for r in records if r.success]
    ends = [r.start_time + r.latency_s for r in ok]
    starts = [r.start_time for r in records]
    duration = (max(ends) - min(starts)) if ok else 0.0
    tokens = sum(r.output_tokens for r in ok)
    ttft = [r.ttft_s for r in ok]
    tpot = [t for t in (r.tpot_s for r in ok) if t is not None]
    return WaveFigures(
        concurrency=concurrency, num_ok=len(ok), num_failed=len(records) - len(ok), output_tokens=tokens,
        duration_s=duration, tokens_per_s=tokens / duration if duration > 0 else 0.0,
        ttft_p50_s=percentile(ttft, 50), ttft_p90_s=percentile(ttft, 90),
        tpot_p50_s=percentile(tpot, 50), tpot_p90_s=percentile(tpot, 90),
        prompt_tokens_mean=statistics.fmean(r.prompt_len for r in ok) if ok else 0.0,
        timings=[r.server_timing for r in ok if r.server_timing],
        errors=[r.error for r in records if not r.success][:3])


def class_figures(waves: list[WaveFigures]) -> dict:
    """Medians over the measured waves of one (server, c), plus failures and the breakdown."""
    if not waves:
        raise ValueError("no measured waves")
    out: dict = {f: statistics.median(getattr(w, f) for w in waves) for f in FIGURES}
    out["num_rounds"] = len(waves)
    out["num_failed"] = sum(w.num_failed for w in waves)
    out["output_tokens_per_request"] = (sum(w.output_tokens for w in waves) / max(1, sum(w.num_ok for w in waves)))
    out["prompt_tokens_mean"] = statistics.fmean(w.prompt_tokens_mean for w in waves)
    out["breakdown"] = ttft_breakdown([t for w in waves for t in w.timings])
    out["errors"] = [e for w in waves for e in w.errors][:3]
    return out


def ratios(results: dict[str, dict[int, dict]], baseline: str) -> dict[str, dict[int, dict]]:
    """Per other server and c: its tokens/s over the baseline's (above 1: faster) and its
    TTFT/TPOT p50 over the baseline's (below 1: lower)."""
    base = results.get(baseline)
    if not base:
        return {}
    out: dict[str, dict[int, dict]] = {}
    for server, per_c in results.items():
        if server == baseline:
            continue
        for c, fig in per_c.items():
            ref = base.get(c)
            if ref is None:
                continue
            out.setdefault(server, {})[c] = {
                "throughput_x": _div(fig["tokens_per_s"], ref["tokens_per_s"]),
                "ttft_p50_x": _div(fig["ttft_p50_s"], ref["ttft_p50_s"]),
                "tpot_p50_x": _div(fig["tpot_p50_s"], ref["tpot_p50_s"])}
    return out


def served_share(results: dict[str, dict[int, dict]], engine_rates: dict[int, float]) -> dict[str, dict[int, float]]:
    """Per server and c: served tokens/s as a fraction of the engine's in-process rate."""
    return {server: {c: _div(fig["tokens_per_s"], engine_rates[c]) for c, fig in per_c.items() if c in engine_rates}
            for server, per_c in results.items()}


def _div(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")
