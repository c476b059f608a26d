"""Worker rotation and routing policies.

`WorkerPool` is the router's view of its workers: who exists, who is healthy,
and how loaded each one is. `RoutingPolicy` picks one healthy worker of a role;
`LeastLoaded` is the default and `RoundRobin` a simple alternative.

Guarantees:
- a worker marked dead is not picked until it is re-admitted: `record_probe`
  counts its good probes in a row and re-admits it after
  `num_readmit_probes` (a frozen worker that resumes, a GC pause); a bad
  probe starts the count again;
- marking a worker dead sets its `lost` event, so calls in flight on it can
  stop waiting at once (re-admission gives it a fresh event);
- `pick()` raises `NoWorkerAvailable` rather than returning a dead worker;
- in-flight counts are kept by `acquire()` / `release()` pairs, so they return
  to zero when every request has finished, whatever its outcome.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from typing import Protocol

from pd.cluster.roles import Role, WorkerEndpoint

logger = logging.getLogger(__name__)


class NoWorkerAvailable(RuntimeError):
    """No healthy worker of the wanted role is left in the rotation."""


@dataclasses.dataclass
class WorkerLoad:
    """Mutable load figures; `num_in_flight` is the router's own count, the rest
    comes from the worker's last stats report."""

    endpoint: WorkerEndpoint
    healthy: bool = True
    num_in_flight: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    stats: dict = dataclasses.field(default_factory=dict)
    lost: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # set when it leaves the rotation
    num_good_probes: int = 0  # good probes in a row while out of the rotation


class RoutingPolicy(Protocol):
    def choose(self, candidates: list[WorkerLoad]) -> WorkerLoad: ...


class LeastLoaded:
    """Fewest requests in flight (router-side), then fewest queued on the worker,
    then the lowest KV usage; ties rotate so equal workers share the load."""

    def __init__(self) -> None:
        self._turns = _Turns()

    def choose(self, candidates: list[WorkerLoad]) -> WorkerLoad:
        turn = self._turns.next(candidates)
        n = len(candidates)
        return min(
            enumerate(candidates),
            key=lambda ic: (ic[1].num_in_flight, ic[1].num_waiting, round(ic[1].kv_usage, 2), (ic[0] - turn) % n),
        )[1]


class RoundRobin:
    def __init__(self) -> None:
        self._turns = _Turns()

    def choose(self, candidates: list[WorkerLoad]) -> WorkerLoad:
        return candidates[self._turns.next(candidates) % len(candidates)]


class _Turns:
    """A turn counter per candidate set: picks for one role must not advance another's
    rotation (with one P and two D, a shared counter moved by 2 per request and sent
    every request to the same D)."""

    def __init__(self) -> None:
        self._counters: dict[tuple[str, ...], itertools.count] = {}

    def next(self, candidates: list[WorkerLoad]) -> int:
        key = tuple(c.endpoint.worker_id for c in candidates)
        return next(self._counters.setdefault(key, itertools.count()))


POLICIES = {"least_loaded": LeastLoaded, "round_robin": RoundRobin}


NUM_READMIT_PROBES = 3


class WorkerPool:
    def __init__(self, policy: RoutingPolicy | None = None, num_readmit_probes: int = NUM_READMIT_PROBES) -> None:
        if num_readmit_probes < 1:
            raise ValueError(f"num_readmit_probes must be at least 1, got {num_readmit_probes}")
        self._policy = policy or LeastLoaded()
        self._num_readmit_probes = num_readmit_probes
        self._loads: dict[str, WorkerLoad] = {}

    def add(self, endpoint: WorkerEndpoint) -> None:
        if endpoint.worker_id in self._loads:
            raise ValueError(f"worker {endpoint.worker_id} is already registered")
        self._loads[endpoint.worker_id] = WorkerLoad(endpoint)

    def get(self, worker_id: str) -> WorkerLoad:
        return self._loads[worker_id]

    def all(self) -> list[WorkerLoad]:
        return list(self._loads.values())

    def healthy(self, role: Role) -> list[WorkerLoad]:
        return [w for w in self._loads.values() if w.healthy and w.endpoint.role.serves(role)]

    def pick(self, role: Role) -> WorkerLoad:
        candidates = self.healthy(role)
        if not candidates:
            raise NoWorkerAvailable(f"no healthy {role.value} worker is available")
        return self._policy.choose(candidates)

    def acquire(self, role: Role) -> WorkerLoad:
        """Picks a worker and counts one more request in flight on it."""
        load = self.pick(role)
        load.num_in_flight += 1
        return load

    def release(self, load: WorkerLoad) -> None:
        load.num_in_flight = max(0, load.num_in_flight - 1)

    def mark_dead(self, worker_id: str, reason: str) -> None:
        load = self._loads.get(worker_id)
        if load is not None and load.healthy:
            load.healthy = False
            load.num_good_probes = 0
            load.lost.set()
            logger.warning("worker %s (%s) left the rotation: %s", worker_id, load.endpoint.url, reason)

    def dead(self) -> list[WorkerLoad]:
        return [w for w in self._loads.values() if not w.healthy]

    def record_probe(self, worker_id: str, ok: bool) -> bool:
        """Counts a probe of a worker out of the rotation; True when this probe re-admitted it."""
        load = self._loads[worker_id]
        if load.healthy:
            return False
        load.num_good_probes = load.num_good_probes + 1 if ok else 0
        if load.num_good_probes < self._num_readmit_probes:
            return False
        load.healthy, load.num_good_probes, load.lost = True, 0, asyncio.Event()
        logger.warning("worker %s (%s) is back in the rotation after %d good probes", worker_id,
                       load.endpoint.url, self._num_readmit_probes)
        return True

    def update_stats(self, worker_id: str, stats: dict) -> None:
        load = self._loads[worker_id]
        load.stats = stats
        load.num_running = int(stats.get("num_running", 0))
        load.num_waiting = int(stats.get("num_waiting", 0))
        load.kv_usage = float(stats.get("kv_usage", 0.0))
