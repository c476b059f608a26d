"""Benchmark figures from per-request records, with `vllm bench serve`'s names.

Definitions (vLLM's):
- TTFT: send -> first streamed chunk with a choice; E2EL: send -> last chunk;
- TPOT per request: (E2EL - TTFT) / (output tokens - 1), requests with more
  than one output token only (a 1-token request counts TPOT 0 for goodput);
- ITL: every gap between successive chunks, pooled over requests;
- goodput: completed requests per second that meet *every* SLO given.
The result is flat: `mean_ttft_ms`, `median_itl_ms`, `p99_tpot_ms`, ... for the
metrics in `--percentile-metrics` and the percentiles in `--metric-percentiles`.
pdkv adds, beside them, how bursty delivery was (`itl_gaps_under_1ms`,
`itl_gaps_under_1ms_share`, `mean_tokens_per_chunk`) and the workers' KV
transfer figures (`pdkv_kv_*`, from two `/metrics` scrapes).
"""
from __future__ import annotations

import dataclasses
import math
import statistics

from prometheus_client.parser import text_string_to_metric_families

from pd.tools.percentile import percentile

METRICS = ("ttft", "tpot", "itl", "e2el")
BURST_GAP_S = 1e-3  # gaps below this are tokens delivered in a burst, not one per engine step


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
    start_time: float = 0.0  # s after the run started
    chunk_times: list[float] = dataclasses.field(default_factory=list)  # s after the run started, per chunk
    generated_text: str = ""
    server_timing: dict | None = None  # a pdkv router's `pdkv_timing` (asked for with x-pdkv-timing: 1)

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def percentile_key(q: float) -> str:
    """vLLM's spelling: 99 -> 'p99', 99.9 -> 'p99.9'."""
    return f"p{int(q)}" if int(q) == q else f"p{q}"


def metric_values_s(records: list[RequestRecord]) -> dict[str, list[float]]:
    done = [r for r in records if r.success]
    return {"ttft": [r.ttft_s for r in done],
            "tpot": [t for t in (r.tpot_s for r in done) if t is not None],
            "itl": [g for r in done for g in r.itl_s],
            "e2el": [r.latency_s for r in done]}


def compute_metrics(records: list[RequestRecord], duration_s: float, slos_ms: dict[str, float],
                    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl"),
                    percentiles: tuple[float, ...] = (99.0,)) -> dict:
    """The run's figures as one flat dict with vLLM's key names (plus pdkv's burst figures)."""
    done = [r for r in records if r.success]
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_tokens for r in done)
    duration_s = max(duration_s, 1e-9)
    good = [r for r in done if _meets(r, slos_ms)] if slos_ms else done
    out = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(records) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration_s,
        "request_goodput": len(good) / duration_s if slos_ms else None,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        **_peaks(done),
    }
    values = metric_values_s(records)
    for name in percentile_metrics:
        ms = [v * 1000.0 for v in values[name]]
        out[f"mean_{name}_ms"] = statistics.fmean(ms) if ms else 0.0
        out[f"median_{name}_ms"] = percentile(ms, 50)
        out[f"std_{name}_ms"] = statistics.pstdev(ms) if ms else 0.0
        for q in percentiles:
            out[f"{percentile_key(q)}_{name}_ms"] = percentile(ms, q)
    gaps = values["itl"]
    num_chunks = sum(len(r.chunk_times) for r in done)
    out.update({
        "num_itl_gaps": len(gaps),
        "itl_gaps_under_1ms": sum(g < BURST_GAP_S for g in gaps),
        "itl_gaps_under_1ms_share": sum(g < BURST_GAP_S for g in gaps) / len(gaps) if gaps else 0.0,
        "mean_tokens_per_chunk": total_out / num_chunks if num_chunks else 0.0,
        "goodput_slos_ms": slos_ms,
        "error_samples": sorted({r.error for r in records if r.error})[:10],
    })
    return out


def _peaks(done: list[RequestRecord]) -> dict:
    """Peak output tokens/s over 1 s buckets, and requests in flight at that peak."""
    buckets: dict[int, float] = {}
    for r in done:
        per_chunk = r.output_tokens / len(r.chunk_times) if r.chunk_times else 0.0
        for t in r.chunk_times:
            buckets[int(t)] = buckets.get(int(t), 0.0) + per_chunk
    if not buckets:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    peak = max(buckets, key=lambda second: buckets[second])
    in_flight = sum(1 for r in done if r.start_time < peak + 1 and r.start_time + r.latency_s >= peak)
    return {"max_output_tokens_per_s": buckets[peak], "max_concurrent_requests": in_flight}


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


def kv_figures(transfer: dict) -> dict:
    """The workers' figures as flat result keys: counters as `pdkv_kv_<name>`, per-worker ones nested."""
    return {f"pdkv_kv_{key}": value for key, value in transfer.items()}


_TITLES = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}


def format_report(result: dict, percentile_metrics: tuple[str, ...], percentiles: tuple[float, ...]) -> str:
    """The console report, laid out like vLLM's, then pdkv's burst and worker figures."""
    lines = ["{:=^60}".format(" Serving Benchmark Result (pdkv) ")]

    def row(label: str, value, fmt: str = "") -> None:
        lines.append(f"{label:<44}{value:>16{fmt}}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result.get("max_concurrency"):
        row("Maximum request concurrency:", result["max_concurrency"])
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    if result["request_goodput"] is not None:
        row("Request goodput (req/s):", result["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", result["max_concurrent_requests"])
    row("Total token throughput (tok/s):", result["total_token_throughput"], ".2f")
    for name in percentile_metrics:
        short, title = _TITLES[name]
        lines.append("{:-^60}".format(f" {title} "))
        row(f"Mean {short} (ms):", result[f"mean_{name}_ms"], ".2f")
        row(f"Median {short} (ms):", result[f"median_{name}_ms"], ".2f")
        for q in percentiles:
            key = percentile_key(q)
            row(f"P{key[1:]} {short} (ms):", result[f"{key}_{name}_ms"], ".2f")
    lines.append("{:-^60}".format(" Token delivery (pdkv) "))
    row("Inter-token gaps:", result["num_itl_gaps"])
    row("Gaps under 1 ms (bursts):",
        f"{result['itl_gaps_under_1ms']} ({100 * result['itl_gaps_under_1ms_share']:.1f}%)")
    row("Mean tokens per chunk:", result["mean_tokens_per_chunk"], ".2f")
    workers = {k.removeprefix("pdkv_kv_"): v for k, v in result.items() if k.startswith("pdkv_kv_")}
    if workers:
        lines.append("{:-^60}".format(" Workers (from /metrics) "))
    for key, value in workers.items():
        if isinstance(value, dict):
            shown = ", ".join(f"{w}={v:.4g}" for w, v in sorted(value.items())) or "-"
            lines.append(f"{key + ':':<44}{shown}")
        else:
            row(key + ":", value, ".6g")
    if result["error_samples"]:
        lines.append("Errors: " + "; ".join(result["error_samples"]))
    lines.append("=" * 60)
    return "\n".join(lines)
