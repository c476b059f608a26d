"""When the router may say it serves: once at least one worker of each role the topology needs
(prefill and decode, or colocated) has answered a health probe.

`Readiness` guarantees:
- `ready` turns true the first time every needed role has a worker whose health probe answered,
  and then stays true (a worker lost later is the health report's business: degraded or
  unavailable, `pd.router.recovery.health_report`);
- until then `report()` says which needed roles have no answering worker and, for each of
  their workers, why its last probe failed (or that none was made yet): `/health` answers it
  with 503, and `wait()` raises it as `NotReady` when its timeout passes.

`capacity` counts, per role, the workers in the rotation against those the deployment has: the
health report calls the deployment degraded while any role is short, even when it still serves.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import TypedDict

from pd.cluster.roles import Role, WorkerEndpoint

logger = logging.getLogger(__name__)

NOT_PROBED = "not probed yet"


class NotReady(RuntimeError):
    """No worker of some needed role answered a health probe in time; the message says which."""


class Readiness:
    def __init__(self, needed: Iterable[Role], endpoints: Callable[[], list[WorkerEndpoint]]) -> None:
        """`needed`: the roles that must each have an answering worker; `endpoints`: the
        deployment's workers now (their addresses change when one restarts)."""
        self.needed = tuple(needed)
        self._endpoints = endpoints
        self._answered: set[str] = set()  # worker ids whose health probe answered at least once
        self._last_error: dict[str, str] = {}
        self._event = asyncio.Event()

    @property
    def ready(self) -> bool:
        return self._event.is_set()

    def answered(self, endpoint: WorkerEndpoint) -> None:
        """`endpoint`'s health probe answered."""
        self._answered.add(endpoint.worker_id)
        self._last_error.pop(endpoint.worker_id, None)
        if not self.ready and not self.missing_roles():
            self._event.set()
            logger.info("router ready: a worker of each needed role answered (%s)",
                        ", ".join(sorted(self._answered)))

    def failed(self, endpoint: WorkerEndpoint, reason: str) -> None:
        """`endpoint`'s health probe did not answer, for `reason`."""
        self._last_error[endpoint.worker_id] = reason

    def missing_roles(self) -> list[Role]:
        """The needed roles with no worker that answered."""
        answered_roles = {e.role for e in self._endpoints() if e.worker_id in self._answered}
        return [role for role in self.needed if role not in answered_roles]

    def report(self) -> str:
        """Why the router is not ready ('' once it is)."""
        if self.ready:
            return ""
        parts = []
        for role in self.missing_roles():
            workers = [e for e in self._endpoints() if e.role is role]
            if not workers:
                parts.append(f"the deployment has no {role.value} worker")
                continue
            why = "; ".join(f"{e.worker_id} at {e.url}: {self._last_error.get(e.worker_id, NOT_PROBED)}"
                            for e in workers)
            parts.append(f"no {role.value} worker has answered a health probe yet ({why})")
        return "; ".join(parts)

    async def wait(self, timeout_s: float) -> None:
        """Returns once ready; raises `NotReady` (with `report()`) after `timeout_s`."""
        try:
            await asyncio.wait_for(self._event.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise NotReady(f"not ready after {timeout_s:g} s: {self.report()}") from None


class RoleCapacity(TypedDict):
    up: int  # in the rotation
    expected: int  # in the deployment


def capacity(workers: Iterable[tuple[Role, bool]], roles: Iterable[Role]) -> dict[str, RoleCapacity]:
    """Per role of `roles` (by value): the workers up and expected, from (role, in the rotation) pairs."""
    counts: dict[str, RoleCapacity] = {role.value: {"up": 0, "expected": 0} for role in roles}
    for role, up in workers:
        entry = counts.setdefault(role.value, {"up": 0, "expected": 0})
        entry["expected"] += 1
        entry["up"] += int(up)
    return counts
