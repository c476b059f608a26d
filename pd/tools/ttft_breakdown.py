"""The TTFT breakdown a pdkv router reports per request (`pdkv_timing`, asked for with the header
`x-pdkv-timing: 1`), summarised over a run: the p50 of each stage."""
from __future__ import annotations

import statistics

from pd.router.timeline import STAGES  # the router's own order (one list: a copy here fell behind it once)
from pd.tools.percentile import percentile


def ttft_breakdown(timings: list[dict]) -> dict | None:
    """p50 of each stage (over the requests that report it), of ttft_s and of num_cached_tokens;
    None when no request carried a breakdown."""
    if not timings:
        return None
    stages: dict[str, float] = {}
    names = list(STAGES) + sorted({k for t in timings for k in (t.get("stages") or {})} - set(STAGES))
    for name in names:
        values = [float(t["stages"][name]) for t in timings
                  if isinstance(t.get("stages"), dict) and isinstance(t["stages"].get(name), (int, float))]
        if values:
            stages[name] = percentile(values, 50)
    ttfts = [float(t["ttft_s"]) for t in timings if isinstance(t.get("ttft_s"), (int, float))]
    cached = [float(t["num_cached_tokens"]) for t in timings if isinstance(t.get("num_cached_tokens"), (int, float))]
    return {"num_requests": len(timings), "stages_p50_s": stages,
            "server_ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
            "cached_tokens_p50": percentile(cached, 50) if cached else None,
            "cached_tokens_mean": statistics.fmean(cached) if cached else None}


def format_stages(breakdown: dict) -> str:
    """`parse 0.1, tokenize 0.4, ... ms`: the stages' p50 in the router's order."""
    stages = breakdown["stages_p50_s"]
    names = [s for s in STAGES if s in stages] + [s for s in stages if s not in STAGES]
    return ", ".join(f"{s.removesuffix('_s')} {stages[s] * 1e3:.1f}" for s in names) + " ms"
