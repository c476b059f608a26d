"""Benchmark figures from per-request records: latency percentiles, throughput,
goodput, the workers' transfer figures, and PNG plots.

Definitions (the ones `vllm bench serve` users know):
- TTFT: send -> first streamed chunk with text; E2EL: send -> last chunk;
- TPOT per request: (E2EL - TTFT) / (output tokens - 1), requests with more
  than one output token only (a 1-token request counts TPOT 0 for goodput);
- ITL: every gap between successive chunks, pooled over requests;
- goodput: completed requests per second that meet *every* SLO given.
"""
from __future__ import annotations

import dataclasses
import math
import statistics

from prometheus_client.parser import text_string_to_metric_families

PERCENTILES = (50, 90, 99)


@dataclasses.dataclass
class RequestRecord:
    prompt_len: int
    expected_output_len: int
    success: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = dataclasses.field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarise_ms(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000.0 for v in values_s]
    out = {"mean": statistics.fmean(ms) if ms else 0.0, "median": percentile(ms, 50)}
    for q in PERCENTILES[1:]:
        out[f"p{q}"] = percentile(ms, q)
    return out


def compute_metrics(records: list[RequestRecord], duration_s: float, slos_ms: dict[str, float]) -> dict:
    done = [r for r in records if r.success]
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_tokens for r in done)
    duration_s = max(duration_s, 1e-9)
    good = [r for r in done if _meets(r, slos_ms)] if slos_ms else done
    return {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "request_goodput": len(good) / duration_s if slos_ms else None,
        "slos_ms": slos_ms,
        "ttft_ms": summarise_ms([r.ttft_s for r in done]),
        "tpot_ms": summarise_ms([t for t in (r.tpot_s for r in done) if t is not None]),
        "itl_ms": summarise_ms([g for r in done for g in r.itl_s]),
        "e2el_ms": summarise_ms([r.latency_s for r in done]),
        "errors": sorted({r.error for r in records if r.error})[:10],
    }


def _meets(r: RequestRecord, slos_ms: dict[str, float]) -> bool:
    values = {"ttft": r.ttft_s * 1000, "tpot": (r.tpot_s or 0.0) * 1000, "e2el": r.latency_s * 1000}
    return all(values[k] <= limit for k, limit in slos_ms.items())


def parse_prometheus(text: str) -> dict[str, dict[tuple, float]]:
    """Prometheus text -> sample name -> {sorted label items: value} (prometheus_client's parser)."""
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def transfer_figures(before: str, after: str) -> dict:
    """Workers' KV transfer and cache figures from two /metrics scrapes.

    Transfer counters (bytes, blocks, failures by cause, leases by end) are
    summed over workers as after - before; the load latency (mean and
    histogram p50 / p99), receive GB/s and prefix hit rate are over the run, per
    worker; KV usage per worker as it stands after the run.
    """
    b, a = parse_prometheus(before), parse_prometheus(after)

    def delta(name: str) -> dict[tuple, float]:
        prev = b.get(name, {})
        return {labels: v - prev.get(labels, 0.0) for labels, v in a.get(name, {}).items()}

    out: dict = {}
    for name in sorted(a):
        if not (name.startswith("pdkv_kv_transfer_") and name.endswith("_total")):
            continue
        key = name.removeprefix("pdkv_kv_transfer_").removesuffix("_total")
        for labels, value in delta(name).items():
            extra = [v for k, v in labels if k not in ("model_name", "worker", "role")]
            out[key] = out.get(key, 0.0) + value
            if extra:
                out[f"{key}_{extra[0]}"] = out.get(f"{key}_{extra[0]}", 0.0) + value
    counts, sums = delta("pdkv_kv_transfer_load_seconds_count"), delta("pdkv_kv_transfer_load_seconds_sum")
    received = {_worker(labels): v for labels, v in delta("pdkv_kv_transfer_bytes_recv_total").items()}
    buckets = delta("pdkv_kv_transfer_load_seconds_bucket")
    out["loads"] = sum(counts.values())
    for labels, count in counts.items():
        if count <= 0:
            continue
        worker, seconds = _worker(labels), sums.get(labels, 0.0)
        out.setdefault("load_latency_mean_ms", {})[worker] = seconds / count * 1000
        mine = sorted((float(dict(lbl)["le"]), v) for lbl, v in buckets.items() if _worker(lbl) == worker)
        for q in (50, 99):
            out.setdefault(f"load_latency_p{q}_ms", {})[worker] = _bucket_quantile(mine, q / 100) * 1000
        if seconds > 0:
            out.setdefault("recv_gbps", {})[worker] = received.get(worker, 0.0) / seconds / 1e9
    hits, queries = delta("pdkv_worker_prefix_cache_hits_total"), delta("pdkv_worker_prefix_cache_queries_total")
    out["prefix_hit_rate"] = {_worker(lbl): hits.get(lbl, 0.0) / q for lbl, q in queries.items() if q > 0}
    out["kv_usage"] = {_worker(lbl): v for lbl, v in a.get("pdkv_worker_kv_usage_ratio", {}).items()}
    return out


def _worker(labels: tuple) -> str:
    return dict(labels).get("worker", "?")


def _bucket_quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """Quantile `q` from cumulative (upper bound, count) buckets, linear inside a bucket
    (as PromQL's histogram_quantile); the highest finite bound when it falls in +Inf."""
    if not buckets or buckets[-1][1] <= 0:
        return 0.0
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * ((rank - below) / (count - below) if count > below else 0.0)
        lower, below = bound, count
    return lower


def format_report(metrics: dict, transfer: dict) -> str:
    lines = ["", "=" * 22 + " pdkv load report " + "=" * 22]
    lines.append(f"{'Successful requests:':<36}{metrics['completed']:>12}")
    lines.append(f"{'Failed requests:':<36}{metrics['failed']:>12}")
    lines.append(f"{'Benchmark duration (s):':<36}{metrics['duration_s']:>12.2f}")
    lines.append(f"{'Total input tokens:':<36}{metrics['total_input_tokens']:>12}")
    lines.append(f"{'Total generated tokens:':<36}{metrics['total_output_tokens']:>12}")
    lines.append(f"{'Request throughput (req/s):':<36}{metrics['request_throughput']:>12.2f}")
    lines.append(f"{'Output token throughput (tok/s):':<36}{metrics['output_throughput']:>12.2f}")
    lines.append(f"{'Total token throughput (tok/s):':<36}{metrics['total_token_throughput']:>12.2f}")
    if metrics["request_goodput"] is not None:
        lines.append(f"{'Request goodput (req/s):':<36}{metrics['request_goodput']:>12.2f}")
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        lines.append("-" * 18 + f" {title} " + "-" * max(1, 41 - len(title)))
        for stat, value in metrics[key].items():
            lines.append(f"{f'{stat.capitalize()} (ms):':<36}{value:>12.2f}")
    lines.append("-" * 18 + " Workers (from /metrics) " + "-" * 19)
    for key, value in transfer.items():
        if isinstance(value, dict):
            shown = ", ".join(f"{w}={v:.4g}" for w, v in sorted(value.items())) or "-"
            lines.append(f"{key + ':':<36}{shown}")
        else:
            lines.append(f"{key + ':':<36}{value:>12.6g}")
    if metrics["errors"]:
        lines.append("Errors: " + "; ".join(metrics["errors"]))
    lines.append("=" * 62)
    return "\n".join(lines)


def write_plots(records: list[RequestRecord], path: str) -> None:
    """Histograms of TTFT, TPOT, ITL and E2EL (ms) in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in records if r.success]
    series = {
        "TTFT (ms)": [r.ttft_s * 1000 for r in done],
        "TPOT (ms)": [r.tpot_s * 1000 for r in done if r.tpot_s is not None],
        "ITL (ms)": [g * 1000 for r in done for g in r.itl_s],
        "E2E latency (ms)": [r.latency_s * 1000 for r in done],
    }
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (title, values) in zip(axes.flat, series.items()):
        if values:
            ax.hist(values, bins=min(40, max(5, len(values) // 2)), color="#3b7dd8", alpha=0.85)
            for q, style in ((50, "-"), (99, "--")):
                ax.axvline(percentile(values, q), color="#d8543b", linestyle=style, label=f"p{q}")
            ax.legend()
        ax.set_title(title)
        ax.set_ylabel("count")
    fig.suptitle(f"pdkv latency distributions ({len(done)} requests)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
