"""How the router recovers from worker trouble: its settings, a worker call that stops
waiting once its worker leaves the rotation, and the continuation of a stream whose
worker died after tokens were sent (migration).

Guarantees:
- `watched_events` ends (as a `stream` `WorkerCallError`) as soon as the pool marks
  its worker dead, rather than waiting out `request_timeout_s` on a frozen worker,
  and closes the worker call on every exit;
- `continuation` asks for exactly the tokens not yet sent: the prompt plus the sent
  tokens as the new prompt, `max_tokens` reduced by what was sent, and no
  `kv_transfer_params` (the new worker computes that prompt itself), so a greedy
  stream continues with the tokens an undisturbed run would have produced;
- `health_report` answers `ok` (200) while every worker of the deployment is in the
  rotation, `degraded` (200, naming the roles short and how many workers of each are
  up of how many) while it still serves every request with fewer (a role short of
  workers, or no prefill worker at all: decode workers prefill locally), and
  `unavailable` (503) only when no worker can serve;
- `api_error` answers a failed worker call with the status that says whose fault it was: 504 a
  timeout, 400 a refusal of the request, 500 the worker's error, 503 with `Retry-After` a device
  fault (other workers serve the retry), 502 a worker lost mid-request.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator
from typing import Any

from pd.cluster.messages import GenerateRequest, TokenEvent
from pd.router.choice import NUM_READMIT_PROBES, Role, WorkerLoad, WorkerPool
from pd.router.openai_api import APIError, server_error
from pd.router.readiness import capacity
from pd.router.worker_client import CallCause, TraceHop, WorkerCallError, WorkerClient

MIGRATION_LIMIT = 2
FIRST_BYTE_TIMEOUT_S = 10.0
MAX_FAILED_POLLS = 2
STATS_TIMEOUT_S = 10.0
READMIT_INTERVAL_S = 0.25
REQUEST_TIMEOUT_S = 120.0
DEVICE_FAULT_RETRY_AFTER_S = 1  # the other workers serve a retry at once; the faulted one restarts meanwhile


@dataclasses.dataclass(frozen=True)
class RecoverySettings:
    """`migration_limit`: how often one request may move to another worker after tokens were
    sent; `first_byte_timeout_s`: how long a worker may take to answer a call's headers (a
    live one does at once); a worker leaves the rotation after `max_failed_polls` failed
    health polls in a row and comes back after `num_readmit_probes` good ones, probed every
    `readmit_interval_s` while it is out (faster than the poll of healthy workers: a stalled
    worker that answers again is back within `num_readmit_probes` x that, plus one probe);
    `request_timeout_s` is a request's deadline: a request whose prefill worker is lost falls
    back to prefilling on its decode worker only while the deadline is ahead."""

    migration_limit: int = MIGRATION_LIMIT
    first_byte_timeout_s: float = FIRST_BYTE_TIMEOUT_S
    max_failed_polls: int = MAX_FAILED_POLLS
    num_readmit_probes: int = NUM_READMIT_PROBES
    stats_timeout_s: float = STATS_TIMEOUT_S
    readmit_interval_s: float = READMIT_INTERVAL_S
    request_timeout_s: float = REQUEST_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0, got {self.migration_limit}")
        for name in ("max_failed_polls", "num_readmit_probes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("first_byte_timeout_s", "stats_timeout_s", "readmit_interval_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def from_router_config(cls, router_config: Any) -> RecoverySettings:
        """The defaults, overridden by any field of the same name the router config has."""
        given = {f.name: getattr(router_config, f.name, None) for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in given.items() if v is not None})


async def watched_events(client: WorkerClient, load: WorkerLoad, request: GenerateRequest,
                         first_byte_s: float | None, hop: TraceHop | None = None) -> AsyncGenerator[TokenEvent, None]:
    """The worker's events for `request`, cut short when `load` leaves the rotation."""
    stream = client.generate(load.endpoint.url, request, first_byte_s=first_byte_s, hop=hop)
    lost = asyncio.ensure_future(load.lost.wait())
    pending: asyncio.Future | None = None
    try:
        while True:
            pending = asyncio.ensure_future(stream.__anext__())
            await asyncio.wait({pending, lost}, return_when=asyncio.FIRST_COMPLETED)
            if not pending.done():
                raise WorkerCallError(CallCause.STREAM, f"worker {load.endpoint.worker_id} left the rotation "
                                                "(failed health checks) while this call waited on it")
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield event
    finally:
        lost.cancel()
        if pending is not None and not pending.done():
            pending.cancel()
            await asyncio.wait({pending})  # let the call close its connection before the generator is closed
        if pending is not None and pending.done() and not pending.cancelled():
            pending.exception()  # retrieved: it was raised above or is superseded by ours
        with contextlib.suppress(RuntimeError):
            await stream.aclose()


def continuation(request: GenerateRequest, sent_token_ids: list[int], num_migrations: int) -> GenerateRequest:
    """The request that continues `request` on another worker after `sent_token_ids` were sent."""
    sampling = request.sampling.model_copy(update={"max_tokens": request.sampling.max_tokens - len(sent_token_ids)})
    return GenerateRequest(request_id=f"{request.request_id}-m{num_migrations}",
                           prompt_token_ids=list(request.prompt_token_ids) + list(sent_token_ids),
                           sampling=sampling, kv_transfer_params=None, cache_salt=request.cache_salt)


def health_report(pool: WorkerPool, colocated: bool) -> tuple[dict, int]:
    """The router's `/health` body and status: `ok`, `degraded` (serving, with `missing_roles`
    and what the router does instead in `reason`) or `unavailable` (503, why in `reason`)."""
    roles = (Role.BOTH,) if colocated else (Role.PREFILL, Role.DECODE)
    missing = [r.value for r in roles if not pool.healthy(r)]
    serving = Role.BOTH if colocated else Role.DECODE
    counts = capacity(((w.endpoint.role, w.healthy) for w in pool.all()), roles)
    short = [role for role, c in counts.items() if c["up"] < c["expected"]]
    up, expected = sum(c["up"] for c in counts.values()), sum(c["expected"] for c in counts.values())
    shortfall = f"{up} of {expected} workers in the rotation (" + ", ".join(
        f"{role} {counts[role]['up']} of {counts[role]['expected']}" for role in short) + ")"
    reason = None
    if not pool.healthy(serving):
        status = "unavailable"
        reason = f"no healthy {serving.value} worker: nothing can serve"
    elif missing:
        status = "degraded"
        reason = f"no healthy prefill worker: decode workers prefill locally; {shortfall}"
    elif short:
        status = "degraded"
        reason = f"serving with reduced capacity: {shortfall}"
    else:
        status = "ok"
    body = {"status": status, "missing_roles": missing, "short_roles": short, "reason": reason,
            "workers_up": up, "workers_expected": expected, "capacity": counts,
            "workers": {w.endpoint.worker_id: w.healthy for w in pool.all()}}
    return body, 503 if status == "unavailable" else 200


def api_error(load: WorkerLoad, exc: WorkerCallError) -> APIError:
    """The client's error for a worker call that failed: its status and code say whose fault it was."""
    who = f"{load.endpoint.role.value} worker {load.endpoint.worker_id}"
    if exc.cause is CallCause.TIMEOUT:
        return server_error(f"{who} timed out: {exc}", status=504, code="worker_timeout")
    if exc.cause is CallCause.REFUSED:
        return APIError(400, f"{who} refused the request: {exc}")
    if exc.cause is CallCause.WORKER_ERROR:
        return server_error(f"{who} failed the request: {exc}", status=500, code="worker_error")
    if exc.cause is CallCause.DEVICE_FAULT:  # not this request's fault alone, and other workers serve: retry
        return APIError(503, f"{who}: {exc}", err_type="server_error", code="worker_device_fault",
                        headers={"Retry-After": str(DEVICE_FAULT_RETRY_AFTER_S)})
    return server_error(f"{who} failed mid-request: {exc}", status=502, code="worker_failed")
