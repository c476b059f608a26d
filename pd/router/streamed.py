"""The P/D flow with KV streaming (`transfer.streaming: chunk` or `layer`): P and D get the request at once.

A prefill worker that streams says so in its stats (`kv_stream`: its engine id and the side
channel consumers dial, from `KVConnector.stream_source`); the router learns it with the
worker's other figures. For a request whose chosen P streams, the router:
- sends P the prompt (`max_tokens=1`, `do_remote_decode`, `streaming`) and, without waiting for
  its answer, sends D the prompt with params naming P's engine, address and request id
  (`streaming`, no blocks: P publishes them as its prefill completes them, D pulls each part);
  the params pass the same check as a P's answer (`dispatch._checked_params`);
- never retries P: D watches that P's request, so a second P would serve nobody. P's answer
  failing ends nothing else: D's load then fails (P tells it, or its progress deadline passes)
  and D's `kv_load_failure_policy` recomputes or fails the request;
- aborts P when the request ends before P answered (D failed first, or the client left), and
  D (by closing its call) when the client leaves.
Until the router has P's stats (its first poll) a request takes the flow without streaming.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

from pd.cluster.messages import GenerateRequest, KVTransferParams, TokenEvent
from pd.router.choice import Role, WorkerLoad
from pd.router.openai_api import APIError
from pd.router.recovery import watched_events
from pd.router.worker_client import TraceHop, WorkerCallError

if TYPE_CHECKING:
    from pd.router.timeline import Timeline

logger = logging.getLogger(__name__)

ANSWER_GRACE_S = 2.0  # after D finished, how long P's answer may take before P's request is aborted

STREAMED_DECODE = KVTransferParams(do_remote_decode=True, streaming=True)


def stream_params(load: WorkerLoad, request_id: str) -> KVTransferParams | None:
    """D's params for a request prefilled on `load`, from the `kv_stream` its stats report;
    None when it does not stream (or reports something malformed)."""
    src: Any = load.stats.get("kv_stream")
    if not isinstance(src, dict):
        return None
    engine_id, host, port = src.get("engine_id"), src.get("host"), src.get("port")
    if not (isinstance(engine_id, str) and engine_id and isinstance(host, str) and host
            and type(port) is int and 0 < port < 65536):
        return None
    return KVTransferParams(do_remote_prefill=True, remote_engine_id=engine_id, remote_host=host, remote_port=port,
                            remote_request_id=request_id, streaming=True)


class StreamedPrefill:
    """P's leg of a streamed request: a task that reads P's answer (its timing, its cache hits)."""

    def __init__(self, dispatcher: Any, request: GenerateRequest, load: WorkerLoad, timeline: Timeline | None,
                 hop: TraceHop | None, num_pending_tokens: int):
        self._d = dispatcher
        self.load = load
        self.request = request
        self.num_cached_tokens: int | None = None
        self._pending = dispatcher._planner.figures.add_pending(load.endpoint.worker_id, num_pending_tokens)
        self.task = asyncio.get_running_loop().create_task(self._run(timeline, hop))

    async def _run(self, timeline: Timeline | None, hop: TraceHop | None) -> None:
        d, load, worker_id = self._d, self.load, self.load.endpoint.worker_id
        figures = d._planner.figures
        try:
            events = watched_events(d._client, load, self.request, d._recovery.first_byte_timeout_s, hop)
            async with contextlib.aclosing(events) as stream:
                async for event in stream:
                    if event.timing is not None:
                        figures.remove_pending(worker_id, self._pending)
                        self._pending = None
                        d._planner.observe_timing(worker_id, event.timing, None)
                        if timeline is not None:
                            timeline.on_timing(True, event.timing)
                    if event.finished:
                        self.num_cached_tokens = event.num_cached_tokens
                        if event.error is not None:
                            logger.info("request %s: streamed prefill on %s failed (%s); D recomputes or fails",
                                        self.request.request_id, worker_id, event.error)
        except WorkerCallError as exc:  # no retry: D watches this P's request; its load fails on its own
            logger.warning("request %s: streamed prefill on %s failed: %s", self.request.request_id, worker_id, exc)
            d._abort_later(load.endpoint.url, self.request.request_id)
            await d._on_failure(load, exc)
        finally:
            figures.remove_pending(worker_id, self._pending)
            d._pool.release(load, self.request.request_id, self.num_cached_tokens)

    def end(self, answered_elsewhere: bool) -> None:
        """The request is over. P's answer still due: a finished request lets it come (P is done, its
        answer in flight); otherwise P's call is cancelled and its request aborted."""
        if self.task.done():
            return
        if answered_elsewhere:
            waiter = asyncio.get_running_loop().create_task(self._await_answer())
            self._d._aborts.add(waiter)
            waiter.add_done_callback(self._d._aborts.discard)
            return
        self._cancel()

    async def _await_answer(self) -> None:
        """D finished first. Normally P's answer is in flight (D's load ends with P's last part);
        but D may have recomputed the prompt (its load failed) while P still prefills for nobody:
        past `ANSWER_GRACE_S` P's call is cancelled and its request aborted."""
        try:
            await asyncio.wait_for(asyncio.shield(self.task), ANSWER_GRACE_S)
        except TimeoutError:
            self._cancel()
        except Exception:  # noqa: BLE001 -- P's own failure is handled (and logged) in `_run`
            pass

    def _cancel(self) -> None:
        self.task.cancel()
        self._d._abort_later(self.load.endpoint.url, self.request.request_id)


class StreamedFlow:
    """The streamed flow of `pd.router.dispatch.Dispatcher` (mixed in; its pool, planner, legs)."""

    _pool: Any
    _aborts: set[asyncio.Task]
    _acquire: Callable[..., WorkerLoad]  # (the Dispatcher's methods)
    _migrating: Callable[..., AsyncGenerator]
    _first_event: Callable[..., None]
    _abort_later: Callable[[str, str], None]

    def _streaming_prefill(self, prefill: GenerateRequest, preferred: str | None) -> WorkerLoad | None:
        """A P that streams, acquired for `prefill`; None (nothing acquired) when none does."""
        if not any(isinstance(w.stats.get("kv_stream"), dict) for w in self._pool.healthy(Role.PREFILL)):
            return None
        try:
            load = self._acquire(Role.PREFILL, prefill, preferred)
        except APIError:
            return None
        if stream_params(load, prefill.request_id) is None:
            self._pool.release(load, prefill.request_id)
            return None
        return load

    async def _streamed(self, request: GenerateRequest, prefill: GenerateRequest, p_load: WorkerLoad,
                        params: KVTransferParams | None, leg_of: Any, note: Any, chosen: Any, started: float,
                        timeline: Timeline | None, p_hop: TraceHop | None,
                        num_p_tokens: int) -> AsyncGenerator[TokenEvent, None]:
        """P and D at once; yields D's events. `params`: D's (checked); `leg_of(decoded)`: D's leg."""
        prefill = prefill.model_copy(update={"kv_transfer_params": STREAMED_DECODE})
        note.prefill_worker = p_load.endpoint.worker_id
        p_leg = StreamedPrefill(self, prefill, p_load, timeline, p_hop, num_p_tokens)
        decoded: list[WorkerLoad] = []
        finished = False
        try:
            decode = request.model_copy(update={"kv_transfer_params": params})
            async with contextlib.aclosing(self._migrating(Role.DECODE, decode, leg_of(decoded))) as events:
                async for event in events:
                    finished = finished or event.finish_reason is not None
                    self._first_event(note, chosen, started, event, decoded)
                    cached = p_leg.num_cached_tokens
                    yield event if cached is None else event.model_copy(update={"num_cached_tokens": cached})
        finally:
            p_leg.end(answered_elsewhere=finished)

