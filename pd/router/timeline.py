"""One request's timeline in the router: where its time to first token went, stage by stage.

Marks are `time.perf_counter()` readings, each recorded once per request (the first prompt of a
batch sets the shared ones): arrived, parsed (body read and JSON decoded), tokenized (validated,
templated, tokenized), admitted (past the admission gate), dispatched / routed (the planner's
decision), the first token event from a worker and the first chunk written. The serving workers'
`StepTiming`s (pd.cluster.messages) give the rest: queue and compute on the worker that computed
the prompt, and on D after a P/D prefill (where D gives the first token) its queue and the KV transfer.

`stages()` (the `pdkv_timing` extension, the `pdkv_ttft_stage_seconds` histogram):

    parse_s, tokenize_s, admission_s    router, in that order from arrival
    route_s                             the planner's decision (from the dispatch to the first call)
    prefill_queue_s, prefill_compute_s  the worker that computed the prompt (P; colocated or local: the one)
    kv_transfer_s, decode_queue_s,      D after a P/D prefill, where D gives the first token (P's is not
    decode_compute_s                    forwarded: pd.router.first_token): its pull, its queue, its first step
    first_chunk_s                       streamed only: first token event in -> first chunk written

`ttft_s` runs from arrival to the first chunk written (streamed) or the first token event (not
streamed). Stages that do not apply are absent. What the stages leave of `ttft_s` is the hops
(HTTP to each worker, P's answer back, D's first event).

With tracing on (pd.cluster.tracing) the timeline also holds the request's root span; its stage
spans are written from the marks when the request ends (`finish`), so tracing adds no work on the
way to the first token beyond the root span and the `traceparent` of each worker call.
"""
from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pd.cluster.messages import StepTiming
from pd.cluster.tracing import GEN_AI_SYSTEM, Tracing, end_span, epoch_ns, extract, inject
from pd.router.planner.explain import RouteNote
from pd.router.worker_client import TraceHop

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from pd.router.metrics import RouterMetrics

TIMING_HEADER = "x-pdkv-timing"
EXTENSION_KEY = "pdkv_timing"
STAGES = ("parse_s", "tokenize_s", "admission_s", "route_s", "prefill_queue_s", "prefill_compute_s",
          "kv_transfer_s", "decode_queue_s", "decode_compute_s", "first_chunk_s")
_ROUTER_SPANS = (("pdkv.router.parse", "arrived", "parsed"), ("pdkv.router.tokenize", "parsed", "tokenized"),
                 ("pdkv.router.admission", "tokenized", "admitted"))


@dataclasses.dataclass
class Timeline:
    arrived: float
    want_extension: bool = False  # the client sent `x-pdkv-timing: 1`
    marks: dict[str, float] = dataclasses.field(default_factory=dict)
    prefill: StepTiming | None = None  # the worker that computed the prompt
    decode: StepTiming | None = None  # D after a P/D prefill
    note: RouteNote | None = None
    status: int | None = None  # the HTTP answer (200 for a stream, whose own error goes in `error`)
    error: str | None = None
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reasons: list[str] = dataclasses.field(default_factory=list)
    tracing: Tracing | None = None  # set when tracing is on (then `span` is the root span)
    span: Span | None = None
    prompt_ids: list[int] | None = None  # only with tracing.include_content
    report_cached: bool = True  # router.report_cached_tokens: false keeps the hit count out of the extension

    @classmethod
    def begin(cls, headers: Mapping[str, str], tracing: Tracing, operation: str, model: str,
              report_cached: bool = True) -> Timeline:
        timeline = cls(time.perf_counter(), headers.get(TIMING_HEADER, "").strip() == "1", report_cached=report_cached)
        if tracing.enabled:
            from opentelemetry.trace import SpanKind

            timeline.tracing = tracing
            timeline.span = tracing.span(f"{operation} {model}", extract(headers), SpanKind.SERVER,
                                         {"gen_ai.operation.name": operation, "gen_ai.system": GEN_AI_SYSTEM,
                                          "gen_ai.provider.name": GEN_AI_SYSTEM, "gen_ai.request.model": model},
                                         start_s=timeline.arrived)
        return timeline

    # -- marks --------------------------------------------------------------
    def mark(self, name: str, at: float | None = None) -> None:
        if name not in self.marks:
            self.marks[name] = time.perf_counter() if at is None else at

    def parsed(self, body: Any) -> Any:
        """Marks the body decoded; returns it (for `build(timeline.parsed(decode_json(...)))`)."""
        self.mark("parsed")
        return body

    def routed(self, note: RouteNote) -> None:
        if "routed" not in self.marks:
            self.mark("routed")
            self.note = note

    def on_timing(self, computed_prompt: bool, timing: StepTiming) -> None:
        """A worker's first-token timing: `computed_prompt` for P, a colocated or a local-prefill D."""
        if computed_prompt:
            self.prefill = self.prefill or timing
        else:
            self.decode = self.decode or timing

    def event(self, name: str, **attributes: Any) -> None:
        """A span event on the root span (migration, recompute), with its cause; nothing with tracing off."""
        if self.span is not None:
            self.span.add_event(name, attributes)

    def hop(self, after: TraceHop | None = None) -> TraceHop | None:
        """The trace headers of a worker call: the root span's, or (D after P) P's own span's, which P
        answered in its `traceresponse` header. None with tracing off."""
        if self.span is None:
            return None
        headers = inject(self.span)
        if after is not None and after.answered:
            headers["traceparent"] = after.answered
        return TraceHop(headers)

    # -- figures ------------------------------------------------------------
    def ttft_s(self) -> float | None:
        end = self.marks.get("first_chunk", self.marks.get("first_token"))
        return None if end is None else end - self.arrived

    def stages(self) -> dict[str, float]:
        m, out = self.marks, {}
        for stage, start, end in (("parse_s", "arrived", "parsed"), ("tokenize_s", "parsed", "tokenized"),
                                  ("admission_s", "tokenized", "admitted"), ("route_s", "dispatched", "routed"),
                                  ("first_chunk_s", "first_token", "first_chunk")):
            begin = self.arrived if start == "arrived" else m.get(start)
            if begin is not None and end in m:
                out[stage] = max(0.0, m[end] - begin)
        if self.prefill is not None:
            out["prefill_queue_s"], out["prefill_compute_s"] = self.prefill.queue_s, self.prefill.compute_s
        if self.decode is not None:
            out["kv_transfer_s"], out["decode_queue_s"] = self.decode.load_s, self.decode.queue_s
            out["decode_compute_s"] = self.decode.compute_s
        return {stage: round(out[stage], 6) for stage in STAGES if stage in out}

    def extension(self) -> dict[str, Any]:
        """The `pdkv_timing` object; `num_cached_tokens` only where the deployment reports cache hits."""
        ttft = self.ttft_s()
        out: dict[str, Any] = {"stages": self.stages(), "ttft_s": None if ttft is None else round(ttft, 6)}
        if self.report_cached:
            out["num_cached_tokens"] = self.num_cached_tokens
        return out

    def final_chunk(self, usage_chunk: bytes | None, chunk_id: str, created: int, model: str, obj: str) -> bytes | None:
        """The stream's last chunk before `[DONE]`: the usage chunk, with `pdkv_timing` when the client
        asked for it; without usage (include_usage off) a chunk of its own with empty `choices`."""
        if not self.want_extension:
            return usage_chunk
        if usage_chunk is not None:
            body = json.loads(usage_chunk[len(b"data: "):])
        else:
            body = {"id": chunk_id, "object": obj, "created": created, "model": model, "choices": []}
        body[EXTENSION_KEY] = self.extension()
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    def prompt_done(self, num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int,
                    finish_reason: str | None) -> None:
        self.num_input_tokens += num_prompt_tokens
        self.num_output_tokens += num_output_tokens
        self.num_cached_tokens += num_cached_tokens
        if finish_reason is not None:
            self.finish_reasons.append(finish_reason)

    # -- the end ------------------------------------------------------------
    def finish(self, metrics: RouterMetrics) -> None:
        """At the request's end, whatever it was: the stage histogram, then the spans, all closed."""
        if self.ttft_s() is not None:
            metrics.record_ttft_stages(self.stages())
        if self.span is not None:
            self._end_spans()

    def _end_spans(self) -> None:
        assert self.tracing is not None and self.span is not None
        from opentelemetry.trace import set_span_in_context

        root, parent = self.span, set_span_in_context(self.span)
        for name, start, end in _ROUTER_SPANS:
            begin = self.arrived if start == "arrived" else self.marks.get(start)
            if begin is not None and end in self.marks:
                self.tracing.interval(name, parent, begin, self.marks[end])
        if "routed" in self.marks and self.note is not None:
            self.tracing.interval("pdkv.router.route", parent, self.marks.get("dispatched", self.marks["routed"]),
                                  self.marks["routed"], _route_attributes(self.note))
        if "first_token" in self.marks:
            root.add_event("first_token", timestamp=epoch_ns(self.marks["first_token"]))
        attributes: dict[str, Any] = {"gen_ai.usage.input_tokens": self.num_input_tokens,
                                      "gen_ai.usage.output_tokens": self.num_output_tokens,
                                      "pdkv.num_cached_tokens": self.num_cached_tokens}
        if self.finish_reasons:
            attributes["gen_ai.response.finish_reasons"] = self.finish_reasons
        if self.status is not None:
            attributes["http.response.status_code"] = self.status
        ttft = self.ttft_s()
        if ttft is not None:
            attributes["pdkv.ttft_s"] = ttft
        if self.prompt_ids is not None:  # tracing.include_content only
            attributes["pdkv.prompt_token_ids"] = self.prompt_ids
        root.set_attributes(attributes)
        error = self.error
        if error is None and (self.status is None or self.status >= 400):
            error = "cancelled" if self.status is None else str(self.status)
        end_span(root, error)

    def describe_job(self, max_tokens: int, temperature: float, top_p: float, response_id: str,
                     prompts: list[list[int]]) -> None:
        """The request's GenAI attributes on the root span, once it is parsed (tracing on only)."""
        if self.span is None:
            return
        self.span.set_attributes({"gen_ai.request.max_tokens": max_tokens, "gen_ai.request.temperature": temperature,
                                  "gen_ai.request.top_p": top_p, "gen_ai.response.id": response_id,
                                  "pdkv.num_prompts": len(prompts)})
        if self.tracing is not None and self.tracing.include_content:
            self.prompt_ids = [t for p in prompts for t in p]


def _route_attributes(note: RouteNote) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in (("pdkv.route.decision", note.decision), ("pdkv.route.reason", note.reason),
                       ("pdkv.route.predicted_ttft_s", note.predicted_ttft_s),
                       ("pdkv.route.prefill_worker", note.prefill_worker),
                       ("pdkv.route.decode_worker", note.decode_worker)):
        if value is not None:
            out[key] = value
    return out
