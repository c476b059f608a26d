"""OpenTelemetry tracing for one process (router or worker): its tracer, W3C propagation, export.

`Tracing.start(settings, service_name)` gives a process its own `TracerProvider` (never the global
one: several routers and workers may share a test process, and OpenTelemetry's global provider can be
set only once). Off (`exporter: none`), `Tracing.off()` holds no provider and `enabled` is False: the
callers test `enabled` before they build any attribute, so a request costs one attribute read.

Guarantees:
- context travels as W3C `traceparent` / `tracestate` (`TraceContextTextMapPropagator`), both ways:
  `extract` reads a request's headers, `inject` writes a call's; a malformed header starts a new trace;
- a span whose parent is sampled is sampled (ParentBased); a trace that starts here is kept with
  `sample_ratio`;
- `close()` flushes and shuts the exporter down (bounded by `FLUSH_TIMEOUT_S`);
- `num_spans_started` counts what this process's tracer started (0 while off: the tests check it).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pd.cluster.tracing_config import TracingSettings

logger = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 5.0
EXPORT_TIMEOUT_S = 5.0
_PROPAGATOR = TraceContextTextMapPropagator()
GEN_AI_SYSTEM = "pdkv"


def epoch_ns(perf_s: float) -> int:
    """A `time.perf_counter()` reading as the epoch nanoseconds a span's start or end wants."""
    return time.time_ns() - int((time.perf_counter() - perf_s) * 1e9)


class Tracing:
    """One process's tracing; `enabled` False: no provider, no tracer, no span."""

    def __init__(self, settings: TracingSettings, tracer: trace.Tracer | None = None, provider: Any = None) -> None:
        self.settings = settings
        self._tracer = tracer
        self._provider = provider
        self._lock = threading.Lock()
        self.num_spans_started = 0

    @classmethod
    def off(cls) -> Tracing:
        return cls(TracingSettings())

    @classmethod
    def start(cls, settings: TracingSettings, service_name: str,
              attributes: Mapping[str, str] | None = None) -> Tracing:
        if not settings.enabled:
            return cls.off()
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        resource = Resource.create({"service.name": service_name, **(attributes or {})})
        provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)))
        provider.add_span_processor(BatchSpanProcessor(_exporter(settings, service_name),
                                                       schedule_delay_millis=int(settings.batch_delay_s * 1000)))
        logger.info("tracing on (%s) as %s, sample ratio %s", settings.exporter, service_name, settings.sample_ratio)
        return cls(settings, provider.get_tracer("pdkv"), provider)

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    @property
    def include_content(self) -> bool:
        return self.settings.include_content

    def span(self, name: str, parent: Context | None, kind: SpanKind = SpanKind.INTERNAL,
             attributes: Mapping[str, Any] | None = None, start_s: float | None = None) -> Span:
        """A started span (end it with `end`); `start_s`: a perf_counter reading in the past."""
        assert self._tracer is not None, "Tracing.span called with tracing off (test `enabled` first)"
        with self._lock:
            self.num_spans_started += 1
        start = epoch_ns(start_s) if start_s is not None else None
        return self._tracer.start_span(name, context=parent, kind=kind, attributes=attributes, start_time=start)

    def interval(self, name: str, parent: Context | None, start_s: float, end_s: float,
                 attributes: Mapping[str, Any] | None = None) -> None:
        """A closed span from two perf_counter readings (work measured before the span existed)."""
        self.span(name, parent, attributes=attributes, start_s=start_s).end(end_time=epoch_ns(max(start_s, end_s)))

    def close(self) -> None:
        if self._provider is not None:
            self._provider.force_flush(int(FLUSH_TIMEOUT_S * 1000))
            self._provider.shutdown()
            self._provider, self._tracer = None, None


def extract(headers: Mapping[str, str]) -> Context:
    """The W3C context of incoming headers (an empty context when there is none or it is malformed)."""
    return _PROPAGATOR.extract(headers)


def inject(span: Span) -> dict[str, str]:
    """`traceparent` (and `tracestate`) headers naming `span` as the parent of the callee's spans."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def child_context(span: Span) -> Context:
    return trace.set_span_in_context(span)


def end_span(span: Span, error: str | None = None, end_s: float | None = None) -> None:
    """Ends `span`, as an error when `error` names one (OpenTelemetry's `error.type`)."""
    if error is not None:
        span.set_attribute("error.type", error)
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=epoch_ns(end_s) if end_s is not None else None)


def _exporter(settings: TracingSettings, service_name: str) -> Any:
    if settings.exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        # each export (retries included) gives up after EXPORT_TIMEOUT_S: a collector that is down costs
        # dropped spans, never a stalled shutdown
        return OTLPSpanExporter(endpoint=settings.endpoint, timeout=EXPORT_TIMEOUT_S)
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    if settings.exporter == "console":
        return ConsoleSpanExporter(service_name=service_name)
    assert settings.file_dir is not None  # validated with the config
    directory = Path(settings.file_dir)
    directory.mkdir(parents=True, exist_ok=True)
    out = open(directory / f"spans-{service_name}-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115 - the exporter's
    return ConsoleSpanExporter(service_name=service_name, out=out,
                               formatter=lambda span: span.to_json(indent=None) + "\n")
