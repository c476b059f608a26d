"""The load run as one PNG: latency distributions on log axes, and token timelines.

Distributions use log-spaced bins on a log x axis, so a tail 100x the median
and a pile of sub-millisecond gaps are both visible (a linear axis to the
maximum puts almost every ITL sample in its first bin). The ITL panel marks
1 ms and names the share of gaps below it. The timeline draws, per request,
one dot per streamed chunk at its arrival time: tokens delivered one per
engine step form an even dotted line; bursts show as clumps with gaps between.
"""
from __future__ import annotations

import math

from pd.tools.loadgen.report import BURST_GAP_S, RequestRecord, metric_values_s
from pd.tools.percentile import percentile

MAX_TIMELINE_REQUESTS = 48


def _log_hist(ax, values_ms: list[float], title: str, color: str) -> None:
    positive = [v for v in values_ms if v > 0]
    ax.set_title(title)
    if not positive:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        return
    lo, hi = min(positive), max(positive)
    if hi / lo < 1.01:
        lo, hi = lo / 2, hi * 2
    num_bins = min(60, max(8, len(positive) // 4))
    edges = [lo * (hi / lo) ** (i / num_bins) for i in range(num_bins + 1)]
    ax.hist(positive, bins=edges, color=color, alpha=0.85)
    ax.set_xscale("log")
    from matplotlib.ticker import NullFormatter

    ax.xaxis.set_minor_formatter(NullFormatter())  # a narrow range: minor labels would overlap
    for q, style in ((50, "-"), (99, "--")):
        ax.axvline(percentile(positive, q), color="#d8543b", linestyle=style, label=f"p{q}")
    ax.set_xlabel("ms (log)")
    ax.set_ylabel("count")
    ax.legend(fontsize=8)


def write_plots(records: list[RequestRecord], path: str) -> None:
    """TTFT, TPOT, ITL and E2EL histograms (log axes) and a per-request token timeline, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in records if r.success]
    values = {k: [v * 1000.0 for v in vs] for k, vs in metric_values_s(records).items()}
    fig = plt.figure(figsize=(14, 9))
    grid = fig.add_gridspec(2, 4)
    panels = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL (inter-chunk gaps)"), ("e2el", "E2E latency"))
    for i, (key, title) in enumerate(panels):
        _log_hist(fig.add_subplot(grid[0, i]), values[key], title, "#3b7dd8")
    gaps = values["itl"]
    itl_ax = fig.axes[2]
    if gaps:
        under = sum(g < BURST_GAP_S * 1000 for g in gaps)
        itl_ax.axvline(1.0, color="black", linewidth=0.8)
        itl_ax.set_title(f"ITL: {under}/{len(gaps)} gaps < 1 ms ({100 * under / len(gaps):.1f}%)")
    _timeline(fig.add_subplot(grid[1, :3]), done)
    _tokens_per_chunk(fig.add_subplot(grid[1, 3]), done)
    fig.suptitle(f"pdkv load run: {len(done)} of {len(records)} requests completed")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _timeline(ax, done: list[RequestRecord]) -> None:
    shown = sorted(done, key=lambda r: r.start_time)[:MAX_TIMELINE_REQUESTS]
    for row, r in enumerate(shown):
        ax.plot([r.start_time, r.start_time + r.latency_s], [row, row], color="#cccccc", linewidth=0.8, zorder=1)
        ax.scatter(r.chunk_times, [row] * len(r.chunk_times), s=4, color="#3b7dd8", zorder=2)
        ax.scatter([r.start_time], [row], s=8, marker="|", color="#d8543b", zorder=3)
    ax.set_xlabel("time since the run started (s)")
    ax.set_ylabel("request (by send time)")
    ax.set_title(f"token timeline: one dot per streamed chunk ({len(shown)} of {len(done)} requests; "
                 "| = sent)")


def _tokens_per_chunk(ax, done: list[RequestRecord]) -> None:
    """Tokens a request received per chunk: 1 everywhere when every step is flushed on its own."""
    ratios = [r.output_tokens / len(r.chunk_times) for r in done if r.chunk_times]
    ax.set_title("output tokens per chunk (per request)")
    if ratios:
        top = max(2, math.ceil(max(ratios)))
        ax.hist(ratios, bins=[1 + i * (top - 1) / 20 for i in range(21)], color="#6a9f58")
    ax.set_xlabel("tokens / chunk")
    ax.set_ylabel("requests")
