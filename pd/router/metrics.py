"""The router's Prometheus metrics, on `prometheus_client`.

`RouterMetrics` owns one `CollectorRegistry` per router (several routers can
live in one process) holding two kinds of series:
- the router's own, recorded as requests pass: requests by outcome, prompt and
  generated tokens, finished requests by reason, TTFT / inter-token / end-to-end
  latency, the prefill hop, failed worker calls, failed and throttled authentications;
- per-worker figures, read by `WorkerStatsCollector` at scrape time from the
  stats of the router's last worker poll: KV usage, queue depths, prefix cache,
  preemptions, engine time, KV transfer bytes / latency / failures.

Where vLLM has a metric for the same thing, it is exported under vLLM's name as
well (`vllm:time_to_first_token_seconds`, `vllm:num_requests_running`, ...), so
a vLLM Grafana dashboard shows pdkv. Per-worker vLLM series name the worker in
an `engine` label, pdkv ones in `worker`.

Guarantees: every series carries `model_name`; counts are counters (`*_total`),
levels are gauges, latencies are histograms, and there are no percentile
gauges; a scrape does no I/O and never waits on a worker; odd worker stats
(missing or non-numeric values) are skipped, never raised.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

# `*_created` series double the exposition and no dashboard reads them (vLLM turns them off as well).
prometheus_client.disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # the format `generate_latest` writes
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclasses.dataclass(frozen=True)
class WorkerFigures:
    """One worker as the router last saw it: rotation state and its last polled stats."""

    worker_id: str
    role: str
    healthy: bool
    stats: Mapping[str, Any]


class RouterMetrics:
    """The router's metrics; `record_*` are thread-safe, `render` reads only memory."""

    def __init__(self, model_name: str, workers: Callable[[], Iterable[WorkerFigures]] = tuple) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._requests = self._counter("pdkv_requests", "Requests to the generation endpoints, each once, by outcome "
                                      "(ok, client_disconnected, error_<status>)", "outcome")
        self._prompt_tokens = self._counters(("pdkv_prompt_tokens", "vllm:prompt_tokens"), "Prompt tokens received")
        self._generation_tokens = self._counters(("pdkv_generation_tokens", "vllm:generation_tokens"),
                                                 "Tokens generated")
        self._success = self._counter("vllm:request_success", "Requests finished, by finish reason",
                                      "finished_reason")
        self._worker_failures = self._counter("pdkv_worker_failures", "Calls to workers that failed, by cause",
                                              "worker", "cause")
        self._ttft = self._histograms(("pdkv_time_to_first_token_seconds", "vllm:time_to_first_token_seconds"),
                                      "Time from request arrival to its first token")
        self._itl = self._histograms(("pdkv_inter_token_latency_seconds", "vllm:inter_token_latency_seconds",
                                      "vllm:time_per_output_token_seconds"),
                                     "Time between successive tokens of a request")
        self._e2e = self._histograms(("pdkv_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds"),
                                     "Time from request arrival to its last token")
        self._prefill_hop = self._histograms(("pdkv_prefill_hop_seconds",),
                                             "Router-side time of the prefill hop (P worker)")
        self._route_decisions = self._counter("pdkv_route_decisions", "Worker choices, by role and routing mode "
                                              "(exact / degraded / fallback for prefix_aware, else the policy)",
                                              "role", "mode")
        self._hit_predicted = self._counter("pdkv_prefix_hit_tokens_predicted",
                                            "Prompt tokens the KV index predicted as cached on the chosen worker",
                                            "role")
        self._hit_actual = self._counter("pdkv_prefix_hit_tokens_actual",
                                         "Prompt tokens the chosen worker reported as served from its prefix cache",
                                         "role")
        self._hit_mispredicted = self._counter("pdkv_prefix_hit_mispredictions",
                                               "Requests whose actual prefix hit differed from the prediction", "role")
        self._kv_batches = self._counter("pdkv_kv_event_batches", "KV event batches received, by outcome "
                                         "(applied, duplicate, buffered, gap, restart, heartbeat; dropped: bad_mac, "
                                         "malformed, wrong_worker, unknown_worker)", "outcome")
        self._kv_resyncs = self._counter("pdkv_kv_index_resyncs", "KV index resynchronisations, by kind", "kind")
        self._plans = self._counter("pdkv_planner_decisions", "Where P/D requests were prefilled, by kind "
                                    "(remote, remote_prefix, local) and reason (fixed, best, explore, cold_start, "
                                    "no_prefill, short)",
                                    "kind", "reason")
        self._plan_error = Histogram("pdkv_planner_ttft_prediction_error_seconds",
                                     "|measured - predicted| TTFT of planned requests, by kind",
                                     ("model_name", "kind"), registry=self.registry, buckets=LATENCY_BUCKETS_S)
        self._plan_unpredicted = self._counter("pdkv_planner_unpredicted", "Planned requests with no prediction "
                                               "(a figure still had no samples), by kind", "kind")
        self._auth_failures = self._counter("pdkv_auth_failures", "Requests refused for a wrong or missing key "
                                            "(401), by the key the path takes (api_key, admin_key)", "key")
        self._auth_throttled = self._counter("pdkv_auth_throttled", "Requests refused with 429 because their "
                                             "address failed to authenticate too often (router.auth_throttle)")
        for key in ("api_key", "admin_key"):  # at 0 from the start: an alert on their rate needs the series
            self._auth_failures.labels(model_name, key)
        self._auth_throttled.labels(model_name)
        self._ttft_stages = Histogram("pdkv_ttft_stage_seconds", "Time to first token by stage (pd.router.timeline: "
                                      "parse, tokenize, admission, route, prefill_queue, prefill_compute, "
                                      "kv_transfer, decode_queue, decode_compute, first_chunk)",
                                      ("model_name", "stage"), registry=self.registry, buckets=LATENCY_BUCKETS_S)
        self.registry.register(WorkerStatsCollector(model_name, workers))

    # -- recording --------------------------------------------------------
    def record_outcome(self, outcome: str) -> None:
        """One request to a generation endpoint ended: `ok`, `client_disconnected` or `error_<http status>`
        (pd.router.completions.count_outcome; each request exactly once)."""
        self._requests.labels(self.model_name, outcome).inc()

    def record_prompt_tokens(self, num_tokens: int) -> None:
        for counter in self._prompt_tokens:
            counter.inc(num_tokens)

    def record_tokens(self, num_tokens: int, seconds: float, first: bool) -> None:
        """`num_tokens` arrived `seconds` after the arrival (first) or after the previous tokens."""
        for histogram in self._ttft if first else self._itl:
            histogram.observe(seconds)
        for counter in self._generation_tokens:
            counter.inc(num_tokens)

    def record_request_end(self, finish_reason: str | None, seconds: float) -> None:
        """A prompt's token stream ended `seconds` after arrival (`finish_reason` None: it broke off)."""
        for histogram in self._e2e:
            histogram.observe(seconds)
        if finish_reason is not None:
            self._success.labels(self.model_name, finish_reason).inc()

    def record_prefill_hop(self, seconds: float) -> None:
        for histogram in self._prefill_hop:
            histogram.observe(seconds)

    def record_worker_failure(self, worker_id: str, cause: str) -> None:
        self._worker_failures.labels(self.model_name, worker_id, cause).inc()

    def record_route(self, role: str, mode: str, predicted_hit: int | None) -> None:
        self._route_decisions.labels(self.model_name, role, mode).inc()
        if predicted_hit:
            self._hit_predicted.labels(self.model_name, role).inc(predicted_hit)

    def record_actual_hit(self, role: str, actual_hit: int, predicted_hit: int | None) -> None:
        self._hit_actual.labels(self.model_name, role).inc(actual_hit)
        if predicted_hit is not None and predicted_hit != actual_hit:
            self._hit_mispredicted.labels(self.model_name, role).inc()

    def record_plan(self, kind: str, reason: str) -> None:
        self._plans.labels(self.model_name, kind, reason).inc()

    def record_plan_ttft(self, kind: str, predicted_s: float | None, measured_s: float) -> None:
        if predicted_s is None:
            self._plan_unpredicted.labels(self.model_name, kind).inc()
        else:
            self._plan_error.labels(self.model_name, kind).observe(abs(measured_s - predicted_s))

    def declare_ttft_stages(self, stages: Iterable[str]) -> None:
        """Every stage's series from the start (`pd.router.timeline.STAGES` names): which ones a request
        fills depends on its path, and a series first seen mid-run would look like new traffic."""
        for stage in stages:
            self._ttft_stages.labels(self.model_name, stage.removesuffix("_s"))

    def record_ttft_stages(self, stages: Mapping[str, float]) -> None:
        """One request's TTFT stages (`pd.router.timeline.STAGES` names, seconds); the `_s` is dropped."""
        for stage, seconds in stages.items():
            self._ttft_stages.labels(self.model_name, stage.removesuffix("_s")).observe(seconds)

    def record_auth_failure(self, key: str) -> None:
        """A 401 on a path that takes `key` (api_key or admin_key)."""
        self._auth_failures.labels(self.model_name, key).inc()

    def record_auth_throttled(self) -> None:
        self._auth_throttled.labels(self.model_name).inc()

    def record_kv_batch(self, outcome: str) -> None:
        self._kv_batches.labels(self.model_name, outcome).inc()

    def record_kv_resync(self, kind: str) -> None:
        self._kv_resyncs.labels(self.model_name, kind).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition (format 0.0.4, `CONTENT_TYPE`)."""
        return generate_latest(self.registry)

    # -- construction -----------------------------------------------------
    def _counter(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(name, doc, ("model_name", *labels), registry=self.registry)

    def _counters(self, names: tuple[str, ...], doc: str) -> list:
        return [self._counter(name, doc).labels(self.model_name) for name in names]

    def _histograms(self, names: tuple[str, ...], doc: str) -> list:
        return [Histogram(name, doc, ("model_name",), registry=self.registry, buckets=LATENCY_BUCKETS_S)
                .labels(self.model_name) for name in names]


# Per-worker series from the worker's stats: (stats key, pdkv name, vLLM name or None, help).
_WORKER_GAUGES = (
    ("kv_usage", "pdkv_worker_kv_usage_ratio", "vllm:kv_cache_usage_perc",
     "Fraction of the worker's KV blocks in use (1 = full)"),
    ("num_running", "pdkv_worker_num_running", "vllm:num_requests_running", "Requests running on the worker"),
    ("num_waiting", "pdkv_worker_num_waiting", "vllm:num_requests_waiting", "Requests waiting on the worker"),
    ("num_waiting_for_remote_kvs", "pdkv_worker_num_waiting_for_remote_kvs", None,
     "Requests waiting for their KV from a prefill worker"),
    ("num_held_for_transfer", "pdkv_worker_num_held_for_transfer", None,
     "Finished prefills whose blocks are held for a decode worker's pull"),
    ("num_free_blocks", "pdkv_worker_num_free_blocks", None, "Free KV blocks on the worker"),
    ("num_blocks", "pdkv_worker_num_blocks", None, "KV blocks in the worker's pool"),
    ("kv_audit_worst_diff", "pdkv_kv_audit_worst_diff", None,
     "Largest relative difference the KV audit found between received and recomputed KV since start (0: bitwise)"),
)
_WORKER_COUNTERS = (
    ("prefix_cache_queries", "pdkv_worker_prefix_cache_queries", "vllm:prefix_cache_queries",
     "Prompt tokens looked up in the prefix cache"),
    ("prefix_cache_hits", "pdkv_worker_prefix_cache_hits", "vllm:prefix_cache_hits",
     "Prompt tokens found in the prefix cache"),
    ("num_preemptions", "pdkv_worker_preemptions", "vllm:num_preemptions", "Requests preempted on the worker"),
    ("num_steps", "pdkv_worker_engine_steps", None, "Engine steps run"),
    ("num_errors", "pdkv_worker_engine_errors", None, "Engine steps that failed"),
    ("num_aborted", "pdkv_worker_requests_aborted", None, "Requests aborted because their consumer went away"),
    ("num_rejected", "pdkv_worker_requests_rejected", None, "Requests the worker refused"),
    ("kv_audit_checked", "pdkv_kv_audit_checked", None,
     "Received KV blocks a decode worker recomputed and compared (transfer.kv_audit_rate)"),
    ("kv_audit_mismatched", "pdkv_kv_audit_mismatched", None,
     "Audited KV blocks that differ from the decode worker's recompute beyond transfer.kv_audit_tolerance"),
    ("kv_audit_skipped", "pdkv_kv_audit_skipped", None,
     "Sampled KV audits not run (the request ended first, no full block pulled, or no scratch block free)"),
)
_ENGINE_PHASES = ("schedule", "model", "update")  # stats key `<phase>_s`: seconds spent since start
_TRANSFER_COUNTERS = (
    ("bytes_sent", "pdkv_kv_transfer_bytes_sent", "KV bytes sent to decode workers"),
    ("blocks_sent", "pdkv_kv_transfer_blocks_sent",
     "KV blocks sent to decode workers (transfer.streaming layer: layer slices)"),
    ("bytes_recv", "pdkv_kv_transfer_bytes_recv", "KV bytes received from prefill workers"),
    ("blocks_recv", "pdkv_kv_transfer_blocks_recv",
     "KV blocks received from prefill workers (transfer.streaming layer: layer slices)"),
    ("malformed_frames", "pdkv_kv_transfer_malformed_frames", "Side-channel frames dropped as malformed"),
    ("stream_parts_published", "pdkv_kv_stream_parts_published",
     "Streamed KV parts a prefill worker published (transfer.streaming: chunk or layer)"),
    ("stream_parts_received", "pdkv_kv_stream_parts_received",
     "Streamed KV parts a decode worker landed and verified (transfer.streaming: chunk or layer)"),
)
# Transfer counts by a label: (stats key holding {label value: count}, name, label, help).
_TRANSFER_LABELLED = (
    ("failures", "pdkv_kv_transfer_failures", "cause", "KV loads that failed, by cause"),
    ("leases_ended", "pdkv_kv_transfer_leases_ended", "end", "Producer block leases ended, by how"),
    ("handshakes_refused", "pdkv_kv_transfer_handshakes_refused", "reason", "KV handshakes refused, by reason"),
)


class WorkerStatsCollector:
    """Per-worker series, built at each scrape from `workers()` (the router's last poll).

    Workers out of the rotation export only `pdkv_worker_up 0`: their last
    figures are stale, and a series that stops is what Prometheus expects of a
    target that went away.
    """

    def __init__(self, model_name: str, workers: Callable[[], Iterable[WorkerFigures]]) -> None:
        self._model_name = model_name
        self._workers = workers

    def collect(self) -> Iterator[Metric]:
        workers = list(self._workers())
        up = GaugeMetricFamily("pdkv_worker_up", "Whether the worker is in the rotation",
                               labels=("model_name", "worker", "role"))
        for w in workers:
            up.add_metric((self._model_name, w.worker_id, w.role), 1.0 if w.healthy else 0.0)
        yield up
        live = [w for w in workers if w.healthy]
        for kind, table in ((GaugeMetricFamily, _WORKER_GAUGES), (CounterMetricFamily, _WORKER_COUNTERS)):
            for key, name, vllm_name, doc in table:
                yield self._family(kind, name, doc, "worker", ((w, w.stats.get(key)) for w in live))
                if vllm_name is not None:
                    yield self._family(kind, vllm_name, doc, "engine", ((w, w.stats.get(key)) for w in live))
        yield from self._engine_time(live)
        transfer = [(w, w.stats.get("transfer") or {}) for w in live]
        for key, name, doc in _TRANSFER_COUNTERS:
            yield self._family(CounterMetricFamily, name, doc, "worker", ((w, t.get(key)) for w, t in transfer))
        for key, name, label, doc in _TRANSFER_LABELLED:
            yield self._labelled(name, doc, label, ((w, t.get(key)) for w, t in transfer))
        yield self._load_latency(transfer)

    def _family(self, kind, name: str, doc: str, worker_label: str, values) -> Metric:
        family = kind(name, doc, labels=("model_name", worker_label, "role"))
        for w, raw in values:
            value = _number(raw)
            if value is not None:
                family.add_metric((self._model_name, w.worker_id, w.role), value)
        return family

    def _labelled(self, name: str, doc: str, label: str, values) -> Metric:
        family = CounterMetricFamily(name, doc, labels=("model_name", "worker", "role", label))
        for w, counts in values:
            if not isinstance(counts, Mapping):
                continue
            for label_value, raw in sorted(counts.items()):
                value = _number(raw)
                if value is not None:
                    family.add_metric((self._model_name, w.worker_id, w.role, str(label_value)), value)
        return family

    def _engine_time(self, live: list[WorkerFigures]) -> Iterator[Metric]:
        family = CounterMetricFamily("pdkv_worker_engine_seconds", "Engine time spent since start, by step phase",
                                     labels=("model_name", "worker", "role", "phase"))
        for w in live:
            for phase in _ENGINE_PHASES:
                value = _number(w.stats.get(f"{phase}_s"))
                if value is not None:
                    family.add_metric((self._model_name, w.worker_id, w.role, phase), value)
        yield family

    def _load_latency(self, transfer: list[tuple[WorkerFigures, Mapping]]) -> Metric:
        family = HistogramMetricFamily("pdkv_kv_transfer_load_seconds", "Time a decode worker took to load a "
                                       "request's KV from a prefill worker", labels=("model_name", "worker", "role"))
        for w, t in transfer:
            count, total = _number(t.get("loads_ok")), _number(t.get("load_seconds"))
            buckets = _buckets(t.get("load_latency_buckets"))
            if count is None or total is None or buckets is None:
                continue
            family.add_metric((self._model_name, w.worker_id, w.role), buckets + [("+Inf", count)], total)
        return family


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return float(value)


def _buckets(raw: Any) -> list[tuple[str, float]] | None:
    """[[bound, cumulative count], ...] from the worker -> prometheus_client's bucket list."""
    try:
        return [(floatToGoString(float(bound)), float(count)) for bound, count in raw]
    except (TypeError, ValueError):
        return None
