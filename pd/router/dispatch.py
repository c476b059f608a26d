"""The P/D request flow: prefill on a P worker, then decode on a D worker.

`Dispatcher.stream_tokens` runs one request through the deployment and yields
`TokenEvent`s:
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
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from pd.router.metrics import RouterMetrics
from pd.router.openai_api import APIError, server_error
from pd.router.choice import NoWorkerAvailable, Role, WorkerLoad, WorkerPool
from pd.router.worker_client import WorkerCallError, WorkerClient

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    token_ids: tuple[int, ...]
    finish_reason: str | None  # set on the last event
    num_cached_tokens: int = 0


class Dispatcher:
    def __init__(self, pool: WorkerPool, client: WorkerClient, metrics: RouterMetrics, colocated: bool) -> None:
        self._pool = pool
        self._client = client
        self._metrics = metrics
        self._colocated = colocated

    async def stream_tokens(self, request_id: str, prompt_token_ids: list[int], sampling: dict) -> AsyncIterator[TokenEvent]:
        payload = {"request_id": request_id, "prompt_token_ids": prompt_token_ids, "sampling": sampling,
                   "kv_transfer_params": None}
        if self._colocated:
            async with contextlib.aclosing(self._run(Role.BOTH, payload)) as events:
                async for event in events:
                    yield event
            return
        started = time.perf_counter()
        prefill = dict(payload, sampling=dict(sampling, max_tokens=1), kv_transfer_params={"do_remote_decode": True})
        params, num_cached = None, 0
        async with contextlib.aclosing(self._run(Role.PREFILL, prefill, keep_params=True)) as answers:
            async for params, num_cached in answers:  # the prefill's one answer: the kv_transfer_params for decode
                pass
        self._metrics.record_prefill_hop(time.perf_counter() - started)
        decode = dict(payload, kv_transfer_params=params)
        async with contextlib.aclosing(self._run(Role.DECODE, decode)) as events:
            async for event in events:
                yield dataclasses.replace(event, num_cached_tokens=num_cached)  # P's cache hits, not D's pull

    async def _run(self, role: Role, payload: dict, keep_params: bool = False) -> AsyncIterator:
        """Runs `payload` on a `role` worker; retries once if the first worker is unreachable
        before producing anything."""
        for attempt in (1, 2):
            load = self._acquire(role, payload)
            produced, actual_hit = False, None
            try:
                async with contextlib.aclosing(self._client.generate(load.endpoint.url, payload)) as stream:
                    async for event in stream:
                        if keep_params:
                            if event.get("finished"):
                                produced, actual_hit = True, _num_cached(event)
                                yield _checked_params(event.get("kv_transfer_params"), load), _num_cached(event)
                            continue
                        produced = True  # from here on the caller has seen output: no retry
                        if event.get("finished"):
                            actual_hit = _num_cached(event)
                        yield TokenEvent(tuple(event.get("token_ids") or ()),
                                         event.get("finish_reason") if event.get("finished") else None,
                                         _num_cached(event))
                return
            except WorkerCallError as exc:
                await self._on_failure(load, exc)
                if produced or attempt == 2 or not exc.worker_unreachable or exc.cause == "timeout":
                    raise _api_error(load, exc) from None
                logger.warning("request %s: retrying on another %s worker", payload["request_id"], role.value)
            finally:
                self._pool.release(load, payload["request_id"], actual_hit)

    def _acquire(self, role: Role, payload: dict) -> WorkerLoad:
        try:
            return self._pool.acquire(role, payload["prompt_token_ids"], payload["request_id"])
        except NoWorkerAvailable as exc:
            raise server_error(str(exc), status=503, code="no_worker_available") from None

    async def _on_failure(self, load: WorkerLoad, exc: WorkerCallError) -> None:
        worker_id = load.endpoint.worker_id
        self._metrics.record_worker_failure(worker_id, exc.cause)
        if not exc.worker_unreachable:
            return
        try:
            await self._client.get_json(load.endpoint.url, "/internal/health")
        except WorkerCallError as probe:
            self._pool.mark_dead(worker_id, f"{exc} (health probe: {probe})")


def _num_cached(event: dict) -> int:
    value = event.get("num_cached_tokens")
    return value if type(value) is int and value >= 0 else 0


def _checked_params(params: dict | None, load: WorkerLoad) -> dict | None:
    """P's answer must say it kept blocks for us; anything else is decoded locally on D."""
    if not params or not params.get("do_remote_prefill"):
        logger.info("prefill worker %s returned no transfer params; decode recomputes the prompt",
                    load.endpoint.worker_id)
        return None
    return params


def _api_error(load: WorkerLoad, exc: WorkerCallError) -> APIError:
    who = f"{load.endpoint.role.value} worker {load.endpoint.worker_id}"
    if exc.cause == "timeout":
        return server_error(f"{who} timed out: {exc}", status=504, code="worker_timeout")
    if exc.cause.startswith("http_4"):
        return APIError(400, f"{who} refused the request: {exc}")
    if exc.cause == "worker_error":
        return server_error(f"{who} failed the request: {exc}", status=500, code="worker_error")
    return server_error(f"{who} failed mid-request: {exc}", status=502, code="worker_failed")
