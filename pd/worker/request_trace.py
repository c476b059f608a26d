"""One request's spans on a worker (tracing on only; pd.cluster.tracing).

The worker's span is a child of the context the router sent (`traceparent` of the
`/internal/generate` call; for D after a P/D prefill that is P's own span, so the links run
router -> P -> D). Its id goes back in the `traceresponse` header. Below it, written from the
engine's own measurements (`StepTiming`: queue, load and compute before the first token, so they
need no extra clock reads in the engine), with start and end times placed back from the first
token's arrival here:

    P          pdkv.prefill.queue, pdkv.prefill.compute; event kv_lease_granted (blocks, lease_s);
               pdkv.prefill.lease and pdkv.kv_serve once the lease ends (pd.worker.lease_trace)
    D (P/D)    pdkv.decode.queue, pdkv.kv_pull (bytes, blocks, tokens, data path; its span id is
               chosen at the start and sent to P in the PULL frames: `pull_context`),
               pdkv.decode.first_token, pdkv.decode.steps (gen_ai.usage.output_tokens)
               event recompute (cause kv_load_failed) when the pull failed and D computed the prompt
    colocated  pdkv.prefill.queue, pdkv.prefill.compute, pdkv.decode.steps
    (a local-prefill D is traced as colocated)

No attribute carries prompt text or token ids. `end` is idempotent; the HTTP API calls it on
every way out (finished, aborted, broken stream).
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Protocol

from opentelemetry.trace import SpanKind, format_span_id, format_trace_id, set_span_in_context

from connectors.params import TransferParams
from pd.cluster.messages import StepTiming, TokenEvent
from pd.cluster.roles import Role
from pd.cluster.tracing import GEN_AI_SYSTEM, Tracing, end_span, epoch_ns, extract
from pd.worker.lease_trace import LeaseSpans


class TracedJob(Protocol):
    """What a trace reads of a request (the engine's `CheckedRequest` has it)."""

    @property
    def request_id(self) -> str: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def sampling(self) -> Any: ...  # the engine's SamplingParams (its max_tokens)
    @property
    def kv_transfer_params(self) -> TransferParams | None: ...


class WorkerTrace:
    def __init__(self, tracing: Tracing, role: Role, worker_id: str, job: TracedJob,
                 headers: Mapping[str, str], data_path: str, leases: LeaseSpans | None = None) -> None:
        self._tracing = tracing
        self._request_id = job.request_id
        self._role = role
        self._data_path = data_path
        params = job.kv_transfer_params
        self._pulls = params is not None and params.do_remote_prefill
        self._num_remote_blocks = sum(len(ids) for ids in (params and params.remote_block_ids) or ())
        self.started = time.perf_counter()
        kind = "prefill" if role is Role.PREFILL else "decode" if self._pulls else "generate"
        self.root = tracing.span(f"pdkv.{kind}", extract(headers), SpanKind.SERVER, {
            "gen_ai.operation.name": "text_completion", "gen_ai.system": GEN_AI_SYSTEM,
            "gen_ai.request.max_tokens": job.sampling.max_tokens,
            "gen_ai.usage.input_tokens": len(job.prompt_token_ids), "pdkv.worker_id": worker_id,
            "pdkv.role": role.value, "pdkv.request_id": job.request_id}, start_s=self.started)
        self._parent = set_span_in_context(self.root)
        self._leases = leases if role is Role.PREFILL else None
        if self._leases is not None:
            self._leases.expect(job.request_id, self._parent)
        self._pull_span_id = tracing.new_span_id() if self._pulls else 0  # written once measured (or at end)
        self._first_at: float | None = None
        self._steps: Any = None  # pdkv.decode.steps, from the first token on
        self._num_tokens = 0
        self._ended = False

    def response_headers(self) -> dict[str, str]:
        """`traceresponse`: this worker's span, as a traceparent value (the router parents D's call on P's)."""
        ctx = self.root.get_span_context()
        flags = "01" if ctx.trace_flags.sampled else "00"
        return {"traceresponse": f"00-{format_trace_id(ctx.trace_id)}-{format_span_id(ctx.span_id)}-{flags}"}

    @property
    def pull_context(self) -> str | None:
        """D after a P/D prefill: the traceparent naming its `pdkv.kv_pull` span (for P's `pdkv.kv_serve`)."""
        if not self._pull_span_id:
            return None
        ctx = self.root.get_span_context()
        flags = "01" if ctx.trace_flags.sampled else "00"
        return f"00-{format_trace_id(ctx.trace_id)}-{format_span_id(self._pull_span_id)}-{flags}"

    def on_event(self, event: TokenEvent) -> None:
        self._num_tokens += len(event.token_ids)
        if event.timing is not None and self._first_at is None:
            self._first_at = time.perf_counter()
            self._first_token(event.timing, self._first_at)
            if self._role is not Role.PREFILL:
                self._steps = self._tracing.span("pdkv.decode.steps", self._parent, start_s=self._first_at)
        if event.finished and self._role is Role.PREFILL and event.kv_transfer_params is not None:
            blocks = event.kv_transfer_params.remote_block_ids or []
            num_blocks = sum(len(ids) for ids in blocks)
            self.root.add_event("kv_lease_granted", {"pdkv.kv.num_blocks": num_blocks,
                                                     "pdkv.kv.num_tokens": event.kv_transfer_params.remote_num_tokens
                                                     or 0})
            if self._leases is not None:
                self._leases.granted(self._request_id, num_blocks)
        elif event.finished and self._leases is not None:  # no lease kept: none will be reported
            self._leases.forget(self._request_id)
        if event.finished:
            failed = event.finish_reason if event.finish_reason in ("error", "abort") else None
            self.end(event.finish_reason, event.error_cause or failed, event.num_cached_tokens)

    def _first_token(self, timing: StepTiming, now: float) -> None:
        compute_at = max(self.started, now - timing.compute_s)
        load_at = max(self.started, compute_at - timing.load_s)
        queue_at = max(self.started, load_at - timing.queue_s)
        t = self._tracing
        if self._pulls:  # D after a P/D prefill: wait, pull P's blocks, then one step for the first token
            t.interval("pdkv.decode.queue", self._parent, queue_at, load_at)
            t.interval("pdkv.kv_pull", self._parent, load_at, compute_at, {
                "pdkv.kv.num_bytes": timing.num_loaded_bytes, "pdkv.kv.num_blocks": timing.num_loaded_blocks,
                "pdkv.kv.num_tokens": timing.num_loaded_tokens, "pdkv.kv.data_path": self._data_path},
                span_id=self._pull_span_id)
            self._pull_span_id = 0
            t.interval("pdkv.decode.first_token", self._parent, compute_at, now,
                       {"pdkv.num_computed_tokens": timing.num_computed_tokens})
            if self._num_remote_blocks and timing.num_loaded_blocks == 0:
                self.root.add_event("recompute", {"cause": "kv_load_failed",
                                                  "pdkv.num_computed_tokens": timing.num_computed_tokens},
                                    timestamp=epoch_ns(compute_at))
            return
        t.interval("pdkv.prefill.queue", self._parent, queue_at, compute_at)
        t.interval("pdkv.prefill.compute", self._parent, compute_at, now,
                   {"pdkv.num_computed_tokens": timing.num_computed_tokens,
                    "pdkv.num_batched_tokens": timing.num_batched_tokens})

    def end(self, finish_reason: str | None = None, error: str | None = None, num_cached_tokens: int = 0) -> None:
        """Closes this request's open spans (an abort or a broken stream ends them with `error`)."""
        if self._ended:
            return
        self._ended = True
        if self._leases is not None:
            self._leases.forget_ungranted(self._request_id)
        if self._pull_span_id:  # no first token: the pull span P may have named as its parent, as an error
            self._tracing.interval("pdkv.kv_pull", self._parent, self.started, time.perf_counter(),
                                   {"pdkv.kv.data_path": self._data_path}, span_id=self._pull_span_id,
                                   error=error or "unfinished")
            self._pull_span_id = 0
        if self._steps is not None:
            self._steps.set_attribute("gen_ai.usage.output_tokens", self._num_tokens)
            end_span(self._steps, error)
        self.root.set_attributes({"gen_ai.usage.output_tokens": self._num_tokens,
                                  "pdkv.num_cached_tokens": num_cached_tokens})
        if finish_reason is not None:
            self.root.set_attribute("gen_ai.response.finish_reasons", [finish_reason])
        end_span(self.root, error)


def start_trace(tracing: Tracing, role: Role, worker_id: str, job: TracedJob, headers: Mapping[str, str],
                data_path: str, leases: LeaseSpans | None = None) -> WorkerTrace | None:
    """The request's worker trace, or None with tracing off (nothing built)."""
    if not tracing.enabled:
        return None
    return WorkerTrace(tracing, role, worker_id, job, headers, data_path, leases)
