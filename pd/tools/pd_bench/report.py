"""Figures, the table and the chart of `pd.tools.pd_bench`."""
from __future__ import annotations

import math

from pd.tools.pd_bench.load import Record
from pd.tools.percentile import percentile

KINDS = ("chat", "doc")


def class_figures(records: list[Record]) -> dict:
    ttfts = [r.ttft_s for r in records]
    tpots = [r.tpot_s for r in records if r.tpot_s is not None]
    return {"n": len(records), "ttft_p50": percentile(ttfts, 50, math.nan), "ttft_p90": percentile(ttfts, 90, math.nan),
            "tpot_p50": percentile(tpots, 50, math.nan), "tpot_p90": percentile(tpots, 90, math.nan)}


def idle_figures(records: list[Record]) -> dict:
    """An idle deployment's 2k-token documents: TTFT, the prefill's compute (on P, or the colocated
    worker), the KV transfer as D saw it, and what TTFT adds beyond the prefill (per request)."""
    stages = [(r.timing or {}).get("stages") or {} for r in records]
    stage = {k: [float(st.get(k) or 0.0) for st in stages] for k in ("prefill_compute_s", "kv_transfer_s")}
    beyond = [r.ttft_s - p for r, p in zip(records, stage["prefill_compute_s"], strict=True)]
    return {"n": len(records), "ttft_p50": percentile([r.ttft_s for r in records], 50, math.nan),
            "prefill_p50": percentile(stage["prefill_compute_s"], 50, math.nan),
            "transfer_p50": percentile(stage["kv_transfer_s"], 50, math.nan),
            "beyond_prefill_p50": percentile(beyond, 50, math.nan)}


def identical(records: list[Record], reference: list[Record]) -> tuple[int, int]:
    """(requests with the same tokens as the reference's request of the same prompt, requests
    compared): documents and idle documents, whose prompts match one for one across deployments
    (each kind's records are in prompt order)."""
    same = total = 0
    for kind in ("doc", "idle"):
        mine = [r.token_ids for r in records if r.kind == kind]
        theirs = [r.token_ids for r in reference if r.kind == kind]
        for a, b in zip(mine, theirs, strict=False):
            same, total = same + (a == b), total + 1
    return same, total


def _ms(x: float) -> str:
    return f"{x * 1e3:.0f}" if x == x else "-"


def format_table(figures: dict[str, dict[str, dict]]) -> str:
    """Markdown: one row per (deployment, class)."""
    lines = ["| deployment | class | n | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | TPOT p90 ms |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for label, per_kind in figures.items():
        for kind in KINDS:
            f = per_kind[kind]
            lines.append(f"| {label} | {kind} | {f['n']} | {_ms(f['ttft_p50'])} | {_ms(f['ttft_p90'])} | "
                         f"{_ms(f['tpot_p50'])} | {_ms(f['tpot_p90'])} |")
    return "\n".join(lines)


def format_idle(idle: dict[str, dict]) -> str:
    lines = ["| deployment (idle, one document at a time) | n | TTFT p50 ms | prefill p50 ms | "
             "KV transfer p50 ms | TTFT beyond prefill p50 ms |", "|---|---:|---:|---:|---:|---:|"]
    for label, f in idle.items():
        lines.append(f"| {label} | {f['n']} | {_ms(f['ttft_p50'])} | {_ms(f['prefill_p50'])} | "
                     f"{_ms(f['transfer_p50'])} | {_ms(f['beyond_prefill_p50'])} |")
    return "\n".join(lines)


def format_ratios(figures: dict[str, dict[str, dict]], reference: str = "colocated") -> str:
    ref = figures[reference]["chat"]
    lines = []
    for label, per_kind in figures.items():
        if label == reference:
            continue
        chat = per_kind["chat"]
        lines.append(f"{label}: interactive TPOT p90 {chat['tpot_p90'] / ref['tpot_p90']:.2f}x colocated "
                     f"(target <= 0.5), interactive TTFT p90 {chat['ttft_p90'] / ref['ttft_p90']:.2f}x (target <= 1)")
    return "\n".join(lines)


def plot(figures: dict[str, dict[str, dict]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(figures)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for row, kind in enumerate(KINDS):
        for col, metric in enumerate(("ttft", "tpot")):
            ax = axes[row][col]
            xs = range(len(labels))
            for offset, q, color in ((-0.2, "p50", "#4c78a8"), (0.2, "p90", "#f58518")):
                ax.bar([x + offset for x in xs], [figures[lb][kind][f"{metric}_{q}"] * 1e3 for lb in labels],
                       width=0.4, color=color, label=q)
            ax.set_xticks(list(xs), labels, rotation=15, fontsize=8)
            ax.set_title(f"{kind}: {metric.upper()}")
            ax.set_ylabel("ms")
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
