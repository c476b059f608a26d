"""Fault injection inside a worker: named points of the request lifecycle, plus
KV pulls routed through a `FaultLink` for connector-level faults.

Points (`WORKER_POINTS`, used with `connectors.faults` rule syntax):
- `worker.request_received`: a generate request was accepted, before the engine sees it;
- `worker.prefill_done`: a prefill worker has its answer (kv_transfer_params) but has not sent it;
- `worker.decode_token`: a worker is about to stream a token event (`after=N` picks the N+1-th);
plus every `connectors.fault_link.LINK_POINTS` point: a decode worker then pulls
KV through a FaultLink of its own, and a `kill` there ends the worker mid-transfer.

Actions at worker points: `kill` ends the process at once (`os._exit`, as a
crash would: no cleanup, no goodbye), `delay`/`stall` pause the request.

Guarantees: a worker without a plan holds `None` and pays one `is None` test
per point; a plan naming an unknown point or an action a point cannot do is
refused when the worker starts, not when the point is reached.
"""
from __future__ import annotations

import asyncio
import logging
import os

from connectors.fault_link import LINK_POINTS, FaultLink
from connectors.faults import FaultAction, FaultPlan, FaultSpecError

logger = logging.getLogger(__name__)

WORKER_POINTS = frozenset({"worker.request_received", "worker.prefill_done", "worker.decode_token"})
ALL_POINTS = WORKER_POINTS | LINK_POINTS
_WORKER_ACTIONS = (FaultAction.KILL, FaultAction.DELAY, FaultAction.STALL)
KILL_EXIT_CODE = 137


def parse_worker_faults(spec: str | None) -> FaultPlan | None:
    """Parses a worker's plan (config value, else `PDKV_FAULTS`); raises FaultSpecError."""
    plan = FaultPlan.parse(spec, ALL_POINTS) if spec else FaultPlan.from_env(ALL_POINTS)
    if plan is not None:
        for rule in plan.rules:
            if rule.point in WORKER_POINTS and rule.action not in _WORKER_ACTIONS:
                raise FaultSpecError(f"fault rule {rule}: worker points take {[a.value for a in _WORKER_ACTIONS]}")
    return plan


def die() -> None:
    logger.error("fault injection: killing worker process %d", os.getpid())
    logging.shutdown()
    os._exit(KILL_EXIT_CODE)


class WorkerFaults:
    """A worker's faults: `await at(point)` at each lifecycle point; `route(params)` for KV pulls."""

    def __init__(self, plan: FaultPlan, host: str):
        self.plan = plan
        self._host = host
        self._links: dict[tuple[str, int], FaultLink] = {}
        self._link_plan = plan if plan.points() & LINK_POINTS else None

    async def at(self, point: str) -> None:
        rule = self.plan.fire(point)
        if rule is None:
            return
        if rule.action is FaultAction.KILL:
            die()
        await asyncio.sleep(rule.seconds)

    def route(self, params: dict | None) -> dict | None:
        """Points a remote-prefill request's pull at a FaultLink in front of its producer."""
        if self._link_plan is None or not params or not params.get("do_remote_prefill"):
            return params
        key = (params["remote_host"], params["remote_port"])
        link = self._links.get(key)
        if link is None:
            link = FaultLink(key[0], key[1], self._link_plan, host=self._host, on_kill=die).start()
            self._links[key] = link
        return dict(params, remote_host=self._host, remote_port=link.port)

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()
