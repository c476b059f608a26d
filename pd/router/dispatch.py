"""The P/D request flow: prefill on a P worker, then decode on a D worker.

`Dispatcher.stream_tokens` runs one request through the deployment and yields
the serving worker's `TokenEvent`s (`pd.cluster.messages`):
- disaggregated: (1) the least-loaded P worker runs the prompt with
  `max_tokens=1` and `do_remote_decode`; it answers with `kv_transfer_params`
  naming the blocks it keeps; (2) the least-loaded D worker gets the prompt and
  those params, pulls the blocks and decodes the whole output (P's single
  token is discarded, so D's sampling alone defines the output);
- colocated: one worker does both.

Guarantees:
- `kv_transfer_params` only ever come from a P worker's answer (the router
  never forwards a client's);
- a worker that fails to answer is probed; if the probe fails too it leaves
  the rotation; a failure before any token was produced is retried once on
  another worker, a failure after it raises `APIError` (no silent truncation);
- in-flight counts are released on every path;
- `num_cached_tokens` (prompt tokens served from a prefix cache, as the
  worker reports it; 0 when it does not) comes from P in P/D, else from the
  one worker, and rides on the events from the moment it is known.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator

from pd.cluster.messages import GenerateRequest, KVTransferParams, Sampling, TokenEvent
from pd.router.metrics import RouterMetrics
from pd.router.openai_api import APIError, server_error
from pd.router.choice import NoWorkerAvailable, Role, WorkerLoad, WorkerPool
from pd.router.worker_client import CallCause, WorkerCallError, WorkerClient

logger = logging.getLogger(__name__)

_REMOTE_DECODE = KVTransferParams(do_remote_decode=True)


class Dispatcher:
    def __init__(self, pool: WorkerPool, client: WorkerClient, metrics: RouterMetrics, colocated: bool) -> None:
        self._pool = pool
        self._client = client
        self._metrics = metrics
        self._colocated = colocated

    async def stream_tokens(self, request_id: str, prompt_token_ids: list[int],
                            sampling: Sampling) -> AsyncIterator[TokenEvent]:
        """The serving worker's events; `finish_reason` is set on the last one only."""
        request = GenerateRequest(request_id=request_id, prompt_token_ids=prompt_token_ids, sampling=sampling)
        if self._colocated:
            async with contextlib.aclosing(self._run(Role.BOTH, request)) as events:
                async for event in events:
                    yield event
            return
        started = time.perf_counter()
        prefill = request.model_copy(update={"sampling": sampling.model_copy(update={"max_tokens": 1}),
                                             "kv_transfer_params": _REMOTE_DECODE})
        params, num_cached = None, 0
        async with contextlib.aclosing(self._run(Role.PREFILL, prefill, keep_params=True)) as answers:
            async for params, num_cached in answers:  # the prefill's one answer: the kv_transfer_params for decode
                pass
        self._metrics.record_prefill_hop(time.perf_counter() - started)
        decode = request.model_copy(update={"kv_transfer_params": params})
        async with contextlib.aclosing(self._run(Role.DECODE, decode)) as events:
            async for event in events:
                yield event.model_copy(update={"num_cached_tokens": num_cached})  # P's cache hits, not D's pull

    async def _run(self, role: Role, request: GenerateRequest, keep_params: bool = False) -> AsyncIterator:
        """Runs `request` on a `role` worker; retries once if the first worker is unreachable
        before producing anything."""
        for attempt in (1, 2):
            load = self._acquire(role, request)
            produced, actual_hit = False, None
            try:
                async with contextlib.aclosing(self._client.generate(load.endpoint.url, request)) as stream:
                    async for event in stream:
                        if keep_params:
                            if event.finished:
                                produced, actual_hit = True, event.num_cached_tokens
                                yield _checked_params(event.kv_transfer_params, load), event.num_cached_tokens
                            continue
                        produced = True  # from here on the caller has seen output: no retry
                        if event.finished:
                            actual_hit = event.num_cached_tokens
                        if event.finish_reason is not None and not event.finished:
                            event = event.model_copy(update={"finish_reason": None})  # the reason ends a request
                        yield event
                return
            except WorkerCallError as exc:
                await self._on_failure(load, exc)
                if produced or attempt == 2 or not exc.worker_unreachable or exc.cause is CallCause.TIMEOUT:
                    raise _api_error(load, exc) from None
                logger.warning("request %s: retrying on another %s worker", request.request_id, role.value)
            finally:
                self._pool.release(load, request.request_id, actual_hit)

    def _acquire(self, role: Role, request: GenerateRequest) -> WorkerLoad:
        try:
            return self._pool.acquire(role, list(request.prompt_token_ids), request.request_id)
        except NoWorkerAvailable as exc:
            raise server_error(str(exc), status=503, code="no_worker_available") from None

    async def _on_failure(self, load: WorkerLoad, exc: WorkerCallError) -> None:
        worker_id = load.endpoint.worker_id
        self._metrics.record_worker_failure(worker_id, exc.cause.value)
        if not exc.worker_unreachable:
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


def _api_error(load: WorkerLoad, exc: WorkerCallError) -> APIError:
    who = f"{load.endpoint.role.value} worker {load.endpoint.worker_id}"
    if exc.cause is CallCause.TIMEOUT:
        return server_error(f"{who} timed out: {exc}", status=504, code="worker_timeout")
    if exc.cause is CallCause.REFUSED:
        return APIError(400, f"{who} refused the request: {exc}")
    if exc.cause is CallCause.WORKER_ERROR:
        return server_error(f"{who} failed the request: {exc}", status=500, code="worker_error")
    return server_error(f"{who} failed mid-request: {exc}", status=502, code="worker_failed")
