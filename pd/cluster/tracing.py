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
- a span's id can be chosen before the span exists (`new_span_id`, then `span(..., span_id=)`): D
  names its pull span in the PULL frames before the pull is measured, so P's serving of it is a child;
- `num_spans_started` counts what this process's tracer started (0 while off: the tests check it).
"""
from __future__ import annotations

import itertools
import logging
import os
import random
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

_FILE_NUMBERS = itertools.count()
_SPAN_IDS = random.SystemRandom()

logger = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 5.0
EXPORT_TIMEOUT_S = 5.0
_PROPAGATOR = TraceContextTextMapPropagator()
GEN_AI_SYSTEM = "pdkv"


def epoch_ns(perf_s: float, clock=time.perf_counter) -> int:
    """A `clock` reading (`time.perf_counter()`, or `time.monotonic` given) as the epoch nanoseconds
    a span's start or end wants."""
    return time.time_ns() - int((clock() - perf_s) * 1e9)


class _ChosenIds:
    """The SDK's random ids, except a span id chosen in advance for the next span this thread starts."""

    def __init__(self) -> None:
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

        self._random = RandomIdGenerator()
        self._chosen = threading.local()

    def choose(self, span_id: int) -> None:
        self._chosen.span_id = span_id

    def generate_span_id(self) -> int:
        chosen = getattr(self._chosen, "span_id", 0)
        if chosen:
            self._chosen.span_id = 0
            return chosen
        return self._random.generate_span_id()

    def generate_trace_id(self) -> int:
        return self._random.generate_trace_id()

    def is_trace_id_random(self) -> bool:
        return self._random.is_trace_id_random()


class Tracing:
    """One process's tracing; `enabled` False: no provider, no tracer, no span."""

    def __init__(self, settings: TracingSettings, tracer: trace.Tracer | None = None, provider: Any = None,
                 ids: _ChosenIds | None = None) -> None:
        self.settings = settings
        self._tracer = tracer
        self._provider = provider
        self._ids = ids
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
        ids = _ChosenIds()
        provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)),
                                  id_generator=ids)  # type: ignore[arg-type]  # (duck-typed IdGenerator)
        provider.add_span_processor(BatchSpanProcessor(_exporter(settings, service_name),
                                                       schedule_delay_millis=int(settings.batch_delay_s * 1000)))
        logger.info("tracing on (%s) as %s, sample ratio %s", settings.exporter, service_name, settings.sample_ratio)
        return cls(settings, provider.get_tracer("pdkv"), provider, ids)

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    @property
    def include_content(self) -> bool:
        return self.settings.include_content

    def new_span_id(self) -> int:
        """A span id for a span to start later (`span(..., span_id=)`)."""
        return _SPAN_IDS.getrandbits(64) or 1  # its own generator: a seeded global `random` must not repeat ids

    def span(self, name: str, parent: Context | None, kind: SpanKind = SpanKind.INTERNAL,
             attributes: Mapping[str, Any] | None = None, start_s: float | None = None, span_id: int = 0,
             links: Any = None, clock=time.perf_counter) -> Span:
        """A started span (end it with `end`); `start_s`: a `clock` reading in the past; `span_id`: one
        from `new_span_id`."""
        assert self._tracer is not None and self._ids is not None, \
            "Tracing.span called with tracing off (test `enabled` first)"
        with self._lock:
            self.num_spans_started += 1
        start = epoch_ns(start_s, clock) if start_s is not None else None
        if not span_id:
            return self._tracer.start_span(name, context=parent, kind=kind, attributes=attributes,
                                           start_time=start, links=links)
        self._ids.choose(span_id)
        try:
            return self._tracer.start_span(name, context=parent, kind=kind, attributes=attributes,
                                           start_time=start, links=links)
        finally:
            self._ids.choose(0)  # (unused when the provider is shut down: never the next span's)

    def interval(self, name: str, parent: Context | None, start_s: float, end_s: float,
                 attributes: Mapping[str, Any] | None = None, span_id: int = 0, error: str | None = None,
                 clock=time.perf_counter, kind: SpanKind = SpanKind.INTERNAL, links: Any = None) -> Span:
        """A closed span from two `clock` readings (work measured before the span existed)."""
        span = self.span(name, parent, kind, attributes, start_s, span_id, links, clock)
        end_span(span, error, epoch_ns(max(start_s, end_s), clock))
        return span

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


def end_span(span: Span, error: str | None = None, end_ns: int | None = None) -> None:
    """Ends `span` (at `end_ns`, epoch; default now), as an error when `error` names one
    (OpenTelemetry's `error.type`)."""
    if error is not None:
        span.set_attribute("error.type", error)
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=end_ns)


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
    # one file per exporter (several workers may share a process): lines of two writers never interleave
    name = f"spans-{service_name}-{os.getpid()}-{next(_FILE_NUMBERS)}.jsonl"
    out = open(directory / name, "a", buffering=1)  # noqa: SIM115 - closed by the exporter's shutdown

    class _FileSpanExporter(ConsoleSpanExporter):
        def shutdown(self) -> None:
            super().shutdown()
            out.close()

    return _FileSpanExporter(service_name=service_name, out=out,
                             formatter=lambda span: span.to_json(indent=None) + "\n")
