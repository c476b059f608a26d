"""The P/D request flow: prefill on a P worker, then decode on a D worker.

`Dispatcher.stream_tokens` runs one request through the deployment and yields
the serving worker's `TokenEvent`s (`pd.cluster.messages`):
- disaggregated: (1) the least-loaded P worker runs the prompt with
  `max_tokens=1` and `do_remote_decode`; it answers with `kv_transfer_params`
  naming the blocks it keeps; (2) the least-loaded D worker gets the prompt and
  those params, pulls the blocks and decodes the rest. With
  `router.first_token_from_prefill` (the default) P's token goes to the client at
  once and D continues from it (pd.router.first_token; a seeded request keeps
  D's first token); else P's token is dropped and D's first step gives it;
- local prefill (the planner's choice, pd.router.planner, or `always_local`, and in every
  mode when no prefill worker can run the prompt): the D worker gets the prompt without
  transfer params and computes it itself;
- colocated: one worker does both.

Which of the first two a request takes is `router.planner.mode`'s call; the
default, `always_disaggregate`, is the first flow with the policy's workers. The
planner's figures are fed by the workers' `timing` on every path, and the caller's
`RouteNote` says where the request went, what TTFT was predicted and measured.

Guarantees:
- `kv_transfer_params` only ever come from a P worker's answer (the router
  never forwards a client's);
- a worker that fails to answer is probed; if the probe fails too it leaves
  the rotation; a call waiting on a worker the health loop takes out stops at
  once; a failure before any token was produced is retried once on another
  worker;
- degrade, don't refuse: a prompt that no prefill worker can run (none healthy, or the
  ones tried were unreachable before answering) is prefilled on a decode worker, while the
  request's deadline (`request_timeout_s` from its arrival) is ahead; a P that answered
  with an error (possibly caused by the request itself) is not worked around. The request
  fails with 503 only when no decode worker is healthy either;
- a failure after tokens were produced, where the worker is gone, continues
  the request on another worker of the role (migration, see
  pd.router.recovery): the caller sees one uninterrupted stream; after
  `migration_limit` migrations, or with no worker left, it raises `APIError`
  (no silent truncation);
- P's lease never outlives the request: if the request ends in any way but a
  finished decode before D produced its first token (client gone, error,
  cancellation between P's answer and the call to D), an authenticated abort
  goes to every P worker the request touched, in a task of its own so the
  cancellation that ended the request cannot cancel it;
- in-flight counts are released on every path;
- `num_cached_tokens` (prompt tokens served from a prefix cache, as the
  worker reports it; 0 when it does not) comes from P in P/D, else from the
  one worker, and rides on the events from the moment it is known.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator

from pd.cluster.messages import GenerateRequest, KVTransferParams, Sampling, TokenEvent
from pd.router.metrics import RouterMetrics
from pd.router.planner.decision import Kind, Option, Plan, Reason
from pd.router.planner.explain import RouteNote
from pd.router.planner.route import RoutePlanner
from pd.router.openai_api import APIError, server_error
from pd.router.choice import NoWorkerAvailable, Role, WorkerLoad, WorkerPool
from pd.router.first_token import decode_request, finish_at_first, first_event, forwards
from pd.router.recovery import RecoverySettings, api_error, continuation, watched_events
from pd.router.streamed import StreamedFlow, stream_params
from pd.router.timeline import Timeline
from pd.router.worker_client import CallCause, TraceHop, WorkerCallError, WorkerClient

logger = logging.getLogger(__name__)

_REMOTE_DECODE = KVTransferParams(do_remote_decode=True)


class _PrefillLost(Exception):
    """No prefill worker could run the request before it answered (none healthy, or each one
    tried was unreachable): the decode worker may prefill it itself."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


class _WorkerLostMidStream(Exception):
    """The worker died after the caller saw output: the request may continue elsewhere."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


ABORT_TIMEOUT_S = 5.0


@dataclasses.dataclass
class _Leg:
    """One hop of a request, as the planner sees it: the worker it prefers (None: the policy
    picks), the prompt tokens that worker computes before its first token (counted as its
    pending work until then), the P worker its KV comes from, and the workers it was sent to; the
    request's timeline (pd.router.timeline) and the trace headers of its calls (None: tracing off)."""

    preferred: str | None = None
    num_pending_tokens: int = 0
    source_id: str | None = None
    acquired: list[WorkerLoad] | None = None
    timeline: Timeline | None = None
    hop: TraceHop | None = None
    after_first_token: bool = False  # D after P's token went to the client: its timing is not TTFT's


class Dispatcher(StreamedFlow):
    def __init__(self, pool: WorkerPool, client: WorkerClient, metrics: RouterMetrics, colocated: bool,
                 recovery: RecoverySettings | None = None, planner: RoutePlanner | None = None,
                 first_token_from_prefill: bool = True) -> None:
        self._pool = pool
        self._first_token_from_prefill = first_token_from_prefill
        self._planner = planner or RoutePlanner(metrics=metrics)
        self._client = client
        self._metrics = metrics
        self._colocated = colocated
        self._recovery = recovery or RecoverySettings()
        self._aborts: set[asyncio.Task] = set()  # lease aborts in flight (kept: a bare task may be collected)

    async def stream_tokens(self, request_id: str, prompt_token_ids: list[int], sampling: Sampling,
                            note: RouteNote | None = None, cache_salt: str | None = None,
                            timeline: Timeline | None = None) -> AsyncGenerator[TokenEvent, None]:
        """The serving worker's events; `finish_reason` is set on the last one only. `note`, when
        given, is filled with where the request went and why (pd.router.planner.explain);
        `cache_salt` goes with the request to every worker and into the routing's hit predictions;
        `timeline` gets the routing's marks, the workers' timings and the trace events."""
        request = GenerateRequest(request_id=request_id, prompt_token_ids=prompt_token_ids, sampling=sampling,
                                  cache_salt=cache_salt)
        note = note if note is not None else RouteNote()
        started = time.perf_counter()
        if timeline is not None:
            timeline.mark("dispatched", started)
        if self._colocated:
            note.decision = "colocated"
            if timeline is not None:
                timeline.routed(note)
            leg = _Leg(timeline=timeline, hop=timeline.hop() if timeline is not None else None)
            async with contextlib.aclosing(self._migrating(Role.BOTH, request, leg)) as events:
                async for event in events:
                    self._first_event(note, None, started, event)
                    yield event
            return
        plan = self._planner.decide(self._pool, prompt_token_ids, cache_salt)
        if plan is None:  # no healthy decode worker: nothing can serve (a P alone cannot decode for us)
            raise server_error("no healthy decode worker is available", status=503, code="no_worker_available")
        self._planner.note(plan, note)
        if timeline is not None:
            timeline.routed(note)
        chosen = plan.chosen
        if chosen.kind is Kind.LOCAL:  # D prefills itself: no P, no transfer
            async with contextlib.aclosing(self._local(request, plan, note, started, timeline=timeline)) as events:
                async for event in events:
                    yield event
            return
        steer = plan.reason is not Reason.FIXED  # the planner picked the workers too
        d_id = chosen.decode.worker_id if steer else None
        prefill = request.model_copy(update={"sampling": sampling.model_copy(update={"max_tokens": 1}),
                                             "kv_transfer_params": _REMOTE_DECODE})
        prefilled: list[WorkerLoad] = []  # every P this request was sent to
        p_id = chosen.prefill.worker_id if steer and chosen.prefill else None
        num_p_tokens = chosen.num_prefill_tokens
        lease_resolved = False  # D finished, or produced a token (it has loaded or released P's blocks)
        p_hop = timeline.hop() if timeline is not None else None
        p_load = self._streaming_prefill(prefill, p_id)  # None: no P streams (transfer.streaming off)
        if p_load is not None:  # KV streaming: P and D at once (pd.router.streamed)
            def leg_of(decoded: list[WorkerLoad]) -> _Leg:
                return _Leg(d_id, 0, None, decoded, timeline,  # (its pull overlaps P: no link figure)
                            timeline.hop(after=p_hop) if timeline is not None else None)
            params = _checked_params(stream_params(p_load, request_id), p_load)  # the check P's answer gets
            async with contextlib.aclosing(self._streamed(request, prefill, p_load, params, leg_of, note, chosen,
                                                          started, timeline, p_hop, num_p_tokens)) as events:
                async for event in events:
                    yield event
            return
        try:
            params, answer = None, TokenEvent()
            try:
                async with contextlib.aclosing(self._run(Role.PREFILL, prefill, _Leg(
                        p_id, num_p_tokens, None, prefilled, timeline, p_hop), keep_params=True)) as answers:
                    async for params, answer in answers:  # noqa: B007 -- the prefill's one answer, read below
                        pass
            except _PrefillLost as lost:  # degrade, don't refuse: D prefills the prompt itself
                lease_resolved = True  # `_run` already aborted the prefill on every P it tried
                fallback = self._fallback(request, lost.error, started)
                self._planner.note(fallback, note)
                if timeline is not None:
                    timeline.event("recompute", cause="prefill_lost", reason=lost.error.message)
                async with contextlib.aclosing(self._local(request, fallback, note, started, learn=False,
                                                           timeline=timeline)) as events:
                    async for event in events:
                        yield event
                return
            self._metrics.record_prefill_hop(time.perf_counter() - started)
            note.prefill_worker = prefilled[-1].endpoint.worker_id
            num_cached = answer.num_cached_tokens
            forwarded = forwards(self._first_token_from_prefill, sampling) and bool(answer.token_ids)
            if forwarded:  # P's token to the client now; D goes on from it (pd.router.first_token)
                finish = finish_at_first(request, answer)
                first = first_event(answer, num_cached, finish)
                self._first_event(note, None, started, first)  # (the planner learns from D's first token)
                yield first
                if finish is not None:  # P's token ended it: no D (P's lease is aborted below)
                    return
                decode = decode_request(request, answer, params)
            else:
                decode = request.model_copy(update={"kv_transfer_params": params})
            decoded: list[WorkerLoad] = []
            leg = _Leg(d_id, 0, note.prefill_worker if params is not None else None, decoded, timeline,
                       timeline.hop(after=p_hop) if timeline is not None else None, after_first_token=forwarded)
            if timeline is not None and params is None:
                timeline.event("recompute", cause="no_transfer_params")
            async with contextlib.aclosing(self._migrating(Role.DECODE, decode, leg)) as events:
                async for event in events:
                    lease_resolved = lease_resolved or bool(event.token_ids) or event.finish_reason is not None
                    if forwarded and event.token_ids and note.decode_worker is None and decoded:
                        # D's stream flows: the time the planner weighs a remote option by, as without
                        # forwarding (a slow pull stalls the stream after P's token as it delayed the first)
                        note.decode_worker = decoded[-1].endpoint.worker_id
                        note.decode_start_s = time.perf_counter() - started
                        self._planner.observe_ttft(chosen, note.decode_start_s)
                    self._first_event(note, chosen, started, event, decoded)
                    yield event.model_copy(update={"num_cached_tokens": num_cached})  # P's cache hits, not D's pull
        finally:
            if not lease_resolved:
                for url in dict.fromkeys(load.endpoint.url for load in prefilled):
                    self._abort_later(url, request_id)

    async def _local(self, request: GenerateRequest, plan: Plan, note: RouteNote, started: float,
                     learn: bool = True, timeline: Timeline | None = None) -> AsyncGenerator[TokenEvent, None]:
        """The request prefilled and decoded on one D: the planner's, or the policy's when the
        plan's kind is the mode's or the only one left (no prefill worker). Its TTFT feeds the
        planner only when `learn` (a fallback's TTFT holds the time lost on the prefill worker)."""
        chosen = plan.chosen
        d_id = chosen.decode.worker_id if plan.reason not in (Reason.FIXED, Reason.NO_PREFILL) else None
        decoded: list[WorkerLoad] = []
        async with contextlib.aclosing(self._migrating(Role.DECODE, request, _Leg(
                d_id, chosen.num_prefill_tokens, None, decoded, timeline,
                timeline.hop() if timeline is not None else None))) as events:
            async for event in events:
                self._first_event(note, chosen if learn else None, started, event, decoded)
                yield event

    def _fallback(self, request: GenerateRequest, error: APIError, started: float) -> Plan:
        """The local plan for a request whose prefill was lost, or `error` when none fits: no
        healthy D, or the request's deadline (`request_timeout_s` from its arrival) has passed."""
        elapsed = time.perf_counter() - started
        if elapsed >= self._recovery.request_timeout_s:
            raise error
        plan = self._planner.fallback(self._pool, list(request.prompt_token_ids), request.cache_salt)
        if plan is None:
            raise error
        logger.warning("request %s: %s; prefilling on a decode worker instead (%.2fs in)", request.request_id,
                       error.message, elapsed)
        return plan

    def _first_event(self, note: RouteNote, chosen: Option | None, started: float, event: TokenEvent,
                     decoded: list[WorkerLoad] | None = None) -> None:
        """At the first token: the measured TTFT goes into the note and the planner."""
        if note.ttft_s is not None or not (event.token_ids or event.finished):
            return
        note.ttft_s = time.perf_counter() - started
        if decoded:
            note.decode_worker = decoded[-1].endpoint.worker_id
        if chosen is not None and event.token_ids:
            self._planner.observe_ttft(chosen, note.ttft_s)
            logger.debug("planned %s (%d tokens, %s): predicted %s s (parts %s s), measured %.4f s", note.decision,
                         chosen.num_tokens, note.reason, chosen.predicted_ttft_s, chosen.parts_s, note.ttft_s)

    async def drain(self, timeout_s: float = ABORT_TIMEOUT_S) -> None:
        """Waits (bounded) for the lease aborts in flight; for shutdown."""
        if self._aborts:
            await asyncio.wait(set(self._aborts), timeout=timeout_s)

    def _abort_later(self, url: str, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._abort(url, request_id))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort(self, url: str, request_id: str) -> None:
        try:
            await self._client.post_json(url, "/internal/abort", {"request_id": request_id}, timeout_s=ABORT_TIMEOUT_S)
        except WorkerCallError as exc:  # the worker is gone or frozen: its lease expires on its own
            logger.info("request %s: abort on %s failed: %s", request_id, url, exc)

    async def _migrating(self, role: Role, request: GenerateRequest,
                         leg: _Leg | None = None) -> AsyncGenerator[TokenEvent, None]:
        """`_run`, continued on another worker of `role` (up to `migration_limit` times) when
        the worker dies after tokens were sent."""
        sent: list[int] = []
        num_cached: int | None = None  # the first worker's figure: a continuation's prompt holds our output
        num_migrations = 0
        current = request
        while True:
            try:
                async with contextlib.aclosing(self._run(role, current, leg, migratable=True)) as events:
                    async for event in events:
                        sent.extend(event.token_ids)
                        num_cached = event.num_cached_tokens if num_cached is None else num_cached
                        # (a copy only where a continuation's own figure differs: a copy costs ~20 µs a token)
                        yield (event if event.num_cached_tokens == num_cached
                               else event.model_copy(update={"num_cached_tokens": num_cached}))
                return
            except _WorkerLostMidStream as lost:
                if num_migrations >= self._recovery.migration_limit:
                    raise APIError(lost.error.status, f"{lost.error.message} (after {num_migrations} "
                                   f"migrations, the limit)", code="migration_limit_reached") from None
                remaining = request.sampling.max_tokens - len(sent)
                if remaining <= 0:  # every token was sent, only the finish was lost
                    yield TokenEvent(finished=True, finish_reason="length", num_cached_tokens=num_cached or 0)
                    return
                num_migrations += 1
                if leg is not None and leg.timeline is not None:
                    leg.timeline.event("migration", cause=lost.error.code or "worker_lost", reason=lost.error.message,
                                       role=role.value, num_tokens_sent=len(sent), num_migrations=num_migrations)
                logger.warning("request %s: %s; continuing on another %s worker after %d tokens (migration %d)",
                               request.request_id, lost.error.message, role.value, len(sent), num_migrations)
                current = continuation(request, sent, num_migrations)
                leg = _Leg(None, len(current.prompt_token_ids), None, leg.acquired if leg else None,
                           leg.timeline if leg else None, leg.hop if leg else None,
                           leg.after_first_token if leg else False)

    async def _run(self, role: Role, request: GenerateRequest, leg: _Leg | None = None, keep_params: bool = False,
                   migratable: bool = False) -> AsyncGenerator:
        """Runs `request` on a `role` worker; retries once if the first worker is unreachable
        before producing anything; raises `_WorkerLostMidStream` (when `migratable`) if it
        is lost after that."""
        leg = leg or _Leg()
        figures = self._planner.figures
        for attempt in (1, 2):
            try:
                load = self._acquire(role, request, leg.preferred if attempt == 1 else None)
            except APIError as exc:
                if keep_params:  # no prefill worker left to try
                    raise _PrefillLost(exc) from None
                raise
            worker_id = load.endpoint.worker_id
            if leg.acquired is not None:
                leg.acquired.append(load)
            pending = figures.add_pending(worker_id, leg.num_pending_tokens)
            produced, actual_hit, computed = False, None, False
            try:
                events = watched_events(self._client, load, request, self._recovery.first_byte_timeout_s, leg.hop)
                async with contextlib.aclosing(events) as stream:
                    async for event in stream:
                        if not computed and (event.timing is not None or event.token_ids):
                            computed = True  # the prompt is computed: no longer queued prefill work here
                            self._pool.prefilled(load, request.request_id)
                        if event.timing is not None:  # the first token's event: the work ahead is done
                            figures.remove_pending(worker_id, pending)
                            pending = None
                            self._planner.observe_timing(worker_id, event.timing, leg.source_id)
                            if leg.timeline is not None and not leg.after_first_token:
                                # P, colocated or local D computed the prompt; else D's (its first token)
                                leg.timeline.on_timing(role is not Role.DECODE or request.kv_transfer_params is None,
                                                       event.timing)
                        if keep_params:
                            if event.finished:
                                produced, actual_hit = True, event.num_cached_tokens
                                yield _checked_params(event.kv_transfer_params, load), event
                            continue
                        produced = True  # from here on the caller has seen output: no retry
                        if event.finished:
                            actual_hit = event.num_cached_tokens
                        if event.finish_reason is not None and not event.finished:
                            event = event.model_copy(update={"finish_reason": None})  # the reason ends a request
                        yield event
                return
            except WorkerCallError as exc:
                if keep_params:  # an abandoned prefill may still finish there: its lease must not wait to expire
                    self._abort_later(load.endpoint.url, request.request_id)
                await self._on_failure(load, exc)
                lost = exc.worker_unreachable and exc.cause is not CallCause.TIMEOUT
                if produced and lost and migratable:
                    raise _WorkerLostMidStream(api_error(load, exc)) from None
                if keep_params and lost and attempt == 2:
                    raise _PrefillLost(api_error(load, exc)) from None
                if produced or attempt == 2 or not lost:
                    raise api_error(load, exc) from None
                logger.warning("request %s: retrying on another %s worker", request.request_id, role.value)
            finally:
                figures.remove_pending(worker_id, pending)
                self._pool.release(load, request.request_id, actual_hit)

    def _acquire(self, role: Role, request: GenerateRequest, preferred: str | None = None) -> WorkerLoad:
        try:
            return self._pool.acquire(role, list(request.prompt_token_ids), request.request_id, preferred,
                                      request.cache_salt)
        except NoWorkerAvailable as exc:
            raise server_error(str(exc), status=503, code="no_worker_available") from None

    async def _on_failure(self, load: WorkerLoad, exc: WorkerCallError) -> None:
        worker_id = load.endpoint.worker_id
        self._metrics.record_worker_failure(worker_id, exc.cause.value)
        # a device fault: the worker said so and restarts; the probe finds it unhealthy at once
        if not (exc.worker_unreachable or exc.cause is CallCause.DEVICE_FAULT) or not load.healthy:
            return
        try:
            await self._client.get_json(load.endpoint.url, "/internal/health")
        except WorkerCallError as probe:
            self._pool.mark_dead(worker_id, f"{exc} (health probe: {probe})")


def _checked_params(params: KVTransferParams | None, load: WorkerLoad) -> KVTransferParams | None:
    """P's answer must say it kept blocks for us; anything else is decoded locally on D."""
    if params is None or not params.do_remote_prefill:
        logger.info("prefill worker %s returned no transfer params; decode recomputes the prompt",
                    load.endpoint.worker_id)
        return None
    return params
