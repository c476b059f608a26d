"""Prometheus text-format metrics for the router (no client library needed).

`RouterMetrics` owns the router's own counters and histograms (requests by
outcome, TTFT, ITL, end-to-end latency, tokens) and renders them together with
per-worker gauges taken from the workers' last stats reports (KV usage, prefix
hit rate, KV transfer bytes / latency / failures).

Guarantees: rendering never raises on odd worker stats (non-numeric values are
skipped); metric and label names are sanitised to Prometheus' alphabet; label
values are escaped.
"""
from __future__ import annotations

import bisect
import re
import threading
from collections.abc import Iterable

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_NAME_BAD = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(raw: str) -> str:
    name = _NAME_BAD.sub("_", raw)
    return name if not name[:1].isdigit() else "_" + name


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    parts = []
    for key, value in sorted(labels.items()):
        escaped = str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
        parts.append(f'{metric_name(key)}="{escaped}"')
    return "{" + ",".join(parts) + "}"


def _fmt(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


class Histogram:
    """Cumulative-bucket histogram; `observe` is thread-safe."""

    def __init__(self, name: str, help_text: str, buckets: Iterable[float] = LATENCY_BUCKETS_S) -> None:
        self.name, self.help_text = name, help_text
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * (len(self.buckets) + 1)
        self._sum = 0.0
        self._count = 0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sum += value
            self._count += 1

    @property
    def count(self) -> int:
        return self._count

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        with self._lock:
            cumulative = 0
            for bound, n in zip(self.buckets + (float("inf"),), self._counts):
                cumulative += n
                lines.append(f'{self.name}_bucket{{le="{_fmt(bound)}"}} {cumulative}')
            lines.append(f"{self.name}_sum {self._sum!r}")
            lines.append(f"{self.name}_count {self._count}")
        return lines


class Counter:
    """Counter with one optional set of label values per sample."""

    def __init__(self, name: str, help_text: str) -> None:
        self.name, self.help_text = name, help_text
        self._values: dict[tuple, float] = {}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._values[key] = self._values.get(key, 0) + amount

    def value(self, **labels: str) -> float:
        return self._values.get(tuple(sorted(labels.items())), 0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} counter"]
        with self._lock:
            for key, value in sorted(self._values.items()):
                lines.append(f"{self.name}{_labels(dict(key))} {_fmt(value)}")
        return lines


# Worker stats keys rendered as gauges: stats key -> (metric name, help).
WORKER_GAUGES = {
    "kv_usage": ("pdkv_worker_kv_usage_ratio", "Fraction of the worker's KV blocks in use"),
    "prefix_hit_rate": ("pdkv_worker_prefix_cache_hit_rate", "Prefix cache hit rate (tokens hit / queried)"),
    "num_running": ("pdkv_worker_num_running", "Requests running on the worker"),
    "num_waiting": ("pdkv_worker_num_waiting", "Requests waiting on the worker"),
    "num_preemptions": ("pdkv_worker_num_preemptions_total", "Preemptions on the worker"),
    "num_free_blocks": ("pdkv_worker_num_free_blocks", "Free KV blocks on the worker"),
    "num_blocks": ("pdkv_worker_num_blocks", "KV blocks in the worker's pool"),
}


class RouterMetrics:
    def __init__(self) -> None:
        self.requests = Counter("pdkv_requests_total", "Completion requests by outcome")
        self.prompt_tokens = Counter("pdkv_prompt_tokens_total", "Prompt tokens received")
        self.generation_tokens = Counter("pdkv_generation_tokens_total", "Tokens generated")
        self.worker_failures = Counter("pdkv_worker_failures_total", "Calls to workers that failed, by worker and cause")
        self.ttft = Histogram("pdkv_time_to_first_token_seconds", "Time to first token")
        self.itl = Histogram("pdkv_inter_token_latency_seconds", "Time between successive tokens of a request")
        self.e2e = Histogram("pdkv_e2e_request_latency_seconds", "End-to-end request latency")
        self.prefill = Histogram("pdkv_prefill_hop_seconds", "Router-side time of the prefill hop (P worker)")

    def render(self, workers: Iterable[tuple[str, str, bool, dict]]) -> str:
        """Prometheus text; `workers` yields (worker_id, role, healthy, last stats)."""
        lines: list[str] = []
        for metric in (self.requests, self.prompt_tokens, self.generation_tokens, self.worker_failures,
                       self.ttft, self.itl, self.e2e, self.prefill):
            lines.extend(metric.render())
        workers = list(workers)
        lines += ["# HELP pdkv_worker_up Whether the worker is in the rotation", "# TYPE pdkv_worker_up gauge"]
        for worker_id, role, healthy, _ in workers:
            lines.append(f"pdkv_worker_up{_labels({'worker': worker_id, 'role': role})} {int(healthy)}")
        for key, (name, help_text) in WORKER_GAUGES.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
            for worker_id, role, _, stats in workers:
                value = stats.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    lines.append(f"{name}{_labels({'worker': worker_id, 'role': role})} {_fmt(value)}")
        lines.extend(_transfer_lines(workers))
        return "\n".join(lines) + "\n"


def _transfer_lines(workers: list[tuple[str, str, bool, dict]]) -> list[str]:
    """Every numeric field of each worker's `transfer` stats as `pdkv_kv_transfer_<field>`."""
    samples: dict[str, list[str]] = {}
    for worker_id, role, _, stats in workers:
        transfer = stats.get("transfer") or {}
        for field, value in _flatten(transfer):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                name = metric_name(f"pdkv_kv_transfer_{field}")
                samples.setdefault(name, []).append(
                    f"{name}{_labels({'worker': worker_id, 'role': role})} {_fmt(value)}")
    lines = []
    for name in sorted(samples):
        lines += [f"# HELP {name} KV transfer figure reported by the worker's connector", f"# TYPE {name} gauge"]
        lines += samples[name]
    return lines


def _flatten(data: dict, prefix: str = "") -> Iterable[tuple[str, object]]:
    for key, value in data.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}_")
        else:
            yield f"{prefix}{key}", value


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Parses Prometheus text into name -> [(labels, value)] (used by the load generator)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    sample = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)$')
    label = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = sample.match(line.strip())
        if not m:
            continue
        try:
            value = float(m.group(4).replace("+Inf", "inf"))
        except ValueError:
            continue
        labels = dict(label.findall(m.group(3) or ""))
        out.setdefault(m.group(1), []).append((labels, value))
    return out
