"""Fault injection inside a worker: the runtime half of the fault kit.

Which points and actions exist, and how a plan is parsed, lives in
`pd.cluster.fault_rules` (pure, so the deploy config checks plans without
loading zmq). Here: a decode worker with link points in its plan pulls KV
through a `FaultLink` of its own, and a `kill` there ends the worker
mid-transfer.

Actions at worker points: `kill` ends the process at once (`os._exit`, as a
crash would: no cleanup, no goodbye), `delay`/`stall` pause the request.

Guarantees: a worker without a plan holds `None` and pays one `is None` test
per point; a plan naming an unknown point or an action a point cannot do is
refused when the worker starts, not when the point is reached.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os

from connectors.links.fault_link import LINK_POINTS, FaultLink
from connectors.links.faults import FaultAction, FaultPlan
from connectors.params import TransferParams
from pd.cluster.fault_rules import ALL_POINTS, ENGINE_POINTS, WORKER_POINTS, parse_worker_faults

__all__ = ["ALL_POINTS", "WORKER_POINTS", "WorkerFaults", "die", "parse_worker_faults"]

logger = logging.getLogger(__name__)

KILL_EXIT_CODE = 137


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

    def engine_marks(self) -> list[str]:
        """The engine points (`step`, `loop`, `device_oom`, `device_error`) due for the request a worker
        just took; one hit each (the engine honours one mark per request: the last)."""
        return [point.split(".", 1)[1] for point in sorted(ENGINE_POINTS) if self.plan.fire(point)]

    def route(self, params: TransferParams | None) -> TransferParams | None:
        """Points a remote-prefill request's pull at a FaultLink in front of its producer."""
        if (self._link_plan is None or params is None or not params.do_remote_prefill
                or params.remote_host is None or params.remote_port is None):
            return params
        key = (params.remote_host, params.remote_port)
        link = self._links.get(key)
        if link is None:
            link = FaultLink(key[0], key[1], self._link_plan, host=self._host, on_kill=die).start()
            self._links[key] = link
        return dataclasses.replace(params, remote_host=self._host, remote_port=link.port)

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()
