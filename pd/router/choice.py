"""Worker rotation and routing policies.

`WorkerPool` is the router's view of its workers: who exists, who is healthy,
and how loaded each one is. `RoutingPolicy` picks one healthy worker of a role;
`LeastLoaded` is the default, `RoundRobin` a simple alternative and
`PrefixAware` picks by cached prefix (from `pd.router.kv_index`) against load.
With an index, the pool predicts each chosen worker's prefix hit whatever the
policy, and counts it (`record_route`) with the actual hit the worker reports.

Guarantees:
- a worker marked dead is not picked until it is re-admitted: `record_probe`
  counts its good probes in a row and re-admits it after
  `num_readmit_probes` (a frozen worker that resumes, a GC pause); a bad
  probe starts the count again;
- marking a worker dead sets its `lost` event, so calls in flight on it can
  stop waiting at once (re-admission gives it a fresh event);
- `pick()` raises `NoWorkerAvailable` rather than returning a dead worker;
- in-flight counts are kept by `acquire()` / `release()` pairs, so they return
  to zero when every request has finished, whatever its outcome; so do the queued
  prefill tokens, which `prefilled()` also takes off as soon as the worker has
  computed the prompt (its first token), each lease at most once. Two leases under one
  (request, worker) key (a retry that lands on the same worker, a caller without a
  request id) are kept apart, so neither release undoes the other's count.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
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
    num_queued_tokens: int = 0  # router-side: prompt tokens of its in-flight requests not predicted as hits
    lost: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # set when it leaves the rotation
    num_good_probes: int = 0  # good probes in a row while out of the rotation
    num_pool_tokens: int = 0  # tokens its KV pool holds (blocks x block size; 0: not known yet)
    # router-side: block hashes of the prompts sent to it and not computed yet (a copy per request)
    pending_blocks: collections.Counter = dataclasses.field(default_factory=collections.Counter)


class RoutingPolicy(Protocol):
    def choose(self, candidates: list[WorkerLoad], hits: Mapping[str, int | None] | None = None,
               fresh: Mapping[str, int] | None = None) -> WorkerLoad: ...


class LeastLoaded:
    """Fewest requests in flight (router-side), then fewest queued on the worker,
    then the lowest KV usage; ties rotate so equal workers share the load."""

    def __init__(self) -> None:
        self._turns = _Turns()

    def choose(self, candidates: list[WorkerLoad], hits: Mapping[str, int | None] | None = None,
               fresh: Mapping[str, int] | None = None) -> WorkerLoad:
        turn = self._turns.next(candidates)
        n = len(candidates)
        return min(
            enumerate(candidates),
            key=lambda ic: (ic[1].num_in_flight, ic[1].num_waiting, round(ic[1].kv_usage, 2), (ic[0] - turn) % n),
        )[1]


class RoundRobin:
    def __init__(self) -> None:
        self._turns = _Turns()

    def choose(self, candidates: list[WorkerLoad], hits: Mapping[str, int | None] | None = None,
               fresh: Mapping[str, int] | None = None) -> WorkerLoad:
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


class PrefixAware:
    """The `ttft_cost` formula: pick the candidate with the highest

        score(w) = hit_tokens(w) - queue_weight * queued_tokens(w) - running_weight * num_in_flight(w)

    where `hit_tokens` is the prompt's predicted prefix-cache hit on w (0 for a
    DEGRADED worker, which is thus routed by load alone), `queued_tokens` the
    prompt tokens of w's in-flight requests it still has to compute (router-side,
    always fresh) and `num_in_flight` its requests in flight. Ties go least-loaded.
    The same formula picks D (its hit is the part it need not pull).

    With queue_weight=1 the first two terms are, up to a constant, minus the tokens w
    computes before this prompt's first token: the best choice for this request alone.
    It is myopic under load: a hit missed is computed again, ahead of every later
    request on the worker that computes it, and the conversation's cache now lives on
    two workers (each holding less of what else it could). On tree-shaped multi-tenant
    traffic with eviction (`route_bench --workload branching`) weight 1 sent busy
    conversations away from their cache and reached 0.85-0.96 of the oracle's hit
    rate, 0.25 reached 0.93-1.03 with a lower TTFT p90, so the default is 0.25: a
    worker holding the prefix keeps it until its queue is 4 tokens per hit token
    ahead (plus `running_weight` per request in flight, which bounds a hot tenant's
    pile-up on one worker).

    What is left of the gap is the hit predicted at routing but evicted before the
    prompt ran, on a worker whose queue churns its pool (192 blocks against a
    2048-token step). So a hit counts whole only while the work queued ahead of it
    takes at most `evict_from` (half) of the worker's pool, then less, down to
    nothing once that work would fill the pool (`surviving_hit`; the pool's size
    comes from the worker's stats, `num_blocks`). The part of the hit that prompts queued on w
    compute or reuse (`fresh`) counts whole: those blocks are the newest there.

    `pending_hits` (off by default) also counts, as hit, the blocks that prompts already sent to w
    will compute before this one runs (the index learns of them only once computed), and the prompt then
    queues only its tokens past that expected hit (the engine's prefix cache shares blocks a prompt sent
    ahead computes, even in the same step). On bursts of one
    tenant (`route_bench --workload bursts`) it sent whole bursts to one P: more hits, a worse TTFT p90.
    """

    def __init__(self, queue_weight: float = 0.25, running_weight: float = 16.0, evict_aware: bool = True,
                 evict_from: float = 0.5, pending_hits: bool = False) -> None:
        if queue_weight < 0 or running_weight < 0:
            raise ValueError("queue_weight and running_weight must be >= 0")
        if not 0 <= evict_from < 1:
            raise ValueError("evict_from must be within [0, 1)")
        self.queue_weight = queue_weight
        self.running_weight = running_weight
        self.evict_aware = evict_aware
        self.evict_from = evict_from
        self.pending_hits = pending_hits  # the pool also counts blocks that prompts sent ahead will compute
        self._tiebreak = LeastLoaded()

    def surviving_hit(self, load: WorkerLoad, hit_tokens: int | None, fresh: int = 0) -> float:
        """The hit expected to be left when the prompt runs: the work queued ahead allocates blocks
        and evicts cached ones, so (with `evict_aware`, and the pool's size known) the hit counts
        whole while that work takes at most `evict_from` of the pool, then less, down to nothing
        when it takes the whole pool: hit * clamp(1 - (queued/pool - evict_from) / (1 - evict_from))."""
        hit = float(hit_tokens or 0)
        if not self.evict_aware or load.num_pool_tokens <= 0:
            return hit
        taken = load.num_queued_tokens / load.num_pool_tokens
        kept = min(float(fresh), hit)  # blocks the queued prompts compute or reuse are the newest: they stay
        return kept + (hit - kept) * min(1.0, max(0.0, 1.0 - (taken - self.evict_from) / (1.0 - self.evict_from)))

    def score(self, load: WorkerLoad, hit_tokens: int | None, fresh: int = 0) -> float:
        return (self.surviving_hit(load, hit_tokens, fresh) - self.queue_weight * load.num_queued_tokens
                - self.running_weight * load.num_in_flight)

    def choose(self, candidates: list[WorkerLoad], hits: Mapping[str, int | None] | None = None,
               fresh: Mapping[str, int] | None = None) -> WorkerLoad:
        hits, fresh = hits or {}, fresh or {}
        scores = [self.score(w, hits.get(w.endpoint.worker_id), fresh.get(w.endpoint.worker_id, 0))
                  for w in candidates]
        best = max(scores)
        return self._tiebreak.choose([w for w, s in zip(candidates, scores, strict=True) if s == best])


POLICIES: dict[str, Callable[..., RoutingPolicy]] = {"least_loaded": LeastLoaded, "round_robin": RoundRobin,
                                                    "prefix_aware": PrefixAware}


NUM_READMIT_PROBES = 3


class WorkerPool:
    def __init__(self, policy: RoutingPolicy | None = None, index=None, metrics=None,
                 num_readmit_probes: int = NUM_READMIT_PROBES) -> None:
        if num_readmit_probes < 1:
            raise ValueError(f"num_readmit_probes must be at least 1, got {num_readmit_probes}")
        self._policy = policy or LeastLoaded()
        self._num_readmit_probes = num_readmit_probes
        self._loads: dict[str, WorkerLoad] = {}
        self.index = index  # a pd.router.kv_index.KVIndex, or None
        self._metrics = metrics
        # (request, worker) -> its leases, oldest first: [queued tokens still counted, predicted hit]
        self._leases: dict[tuple[str, str], list[list]] = {}
        self.last_predicted: dict[tuple[str, str], int | None] = {}  # (request, role) -> predicted hit, for tests
        self._best_hit = 0
        self._hashes: list[bytes] = []  # the prompt's block hashes, from the last pick (empty without an index)
        self._expected: int | None = None  # the last pick's hit counting pending blocks (pending_hits only)
        self.last_best_hit: dict[tuple[str, str], int] = {}  # (request, role) -> best hit of any candidate

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

    def pick(self, role: Role, prompt_token_ids: Sequence[int] | None = None,
             cache_salt: str | None = None) -> WorkerLoad:
        return self.pick_with_hit(role, prompt_token_ids, cache_salt=cache_salt)[0]

    def candidates(self, role: Role, prompt_token_ids: Sequence[int] | None = None,
                   cache_salt: str | None = None) -> list[tuple[WorkerLoad, int | None]]:
        """Every healthy worker of `role` with the prompt's predicted prefix hit on it (None
        without an exact index entry); records nothing."""
        candidates = self.healthy(role)
        hits = self._hits(candidates, prompt_token_ids, cache_salt)
        return [(w, hits.get(w.endpoint.worker_id)) for w in candidates]

    def _hits(self, candidates: list[WorkerLoad], prompt_token_ids: Sequence[int] | None,
              cache_salt: str | None = None) -> dict[str, int | None]:
        """Predicted hits, hashed as the workers hash this prompt: with its cache salt on the first
        block, so a prompt under one salt never counts blocks cached under another."""
        if self.index is None or not prompt_token_ids or not candidates:
            return {}
        hashes = self._hashes = self.index.prompt_hashes(prompt_token_ids, cache_salt=cache_salt)
        return self.index.prefix_hits(len(prompt_token_ids), hashes, [w.endpoint.worker_id for w in candidates])

    def pick_with_hit(self, role: Role, prompt_token_ids: Sequence[int] | None = None,
                      preferred: str | None = None, cache_salt: str | None = None) -> tuple[WorkerLoad, int | None]:
        """(the chosen worker, its predicted prefix hit in tokens: None without an exact index entry);
        `preferred` (a worker id, the planner's choice) wins over the policy while it is healthy."""
        candidates = self.healthy(role)
        if not candidates:
            raise NoWorkerAvailable(f"no healthy {role.value} worker is available")
        self._hashes = []
        hits = self._hits(candidates, prompt_token_ids, cache_salt)
        load = next((w for w in candidates if w.endpoint.worker_id == preferred), None)
        self._expected = None
        if load is None and getattr(self._policy, "pending_hits", False) and self._hashes:
            expected, fresh = self._with_pending(candidates, hits, len(prompt_token_ids or ()))
            load = self._policy.choose(candidates, expected, fresh)
            self._expected = expected.get(load.endpoint.worker_id)
        elif load is None:
            load = self._policy.choose(candidates, hits)
        self._best_hit = max((h for h in hits.values() if h is not None), default=0)
        predicted = hits.get(load.endpoint.worker_id)
        if self._metrics is not None and self.index is not None:
            if not isinstance(self._policy, PrefixAware):
                mode = type(self._policy).__name__.lower()
            else:
                mode = "exact" if predicted is not None else "degraded" if hits else "fallback"
            self._metrics.record_route(role.value, mode, predicted)
        return load, predicted

    def _with_pending(self, candidates: list[WorkerLoad], hits: Mapping[str, int | None],
                      num_tokens: int) -> tuple[dict[str, int], dict[str, int]]:
        """Per worker, the hit expected when the prompt runs there: the longest prefix of its blocks that
        the index says are cached or that prompts sent there ahead will compute (the router sent them;
        the index learns of them only once computed), and how much of it those prompts touch (fresh)."""
        assert self.index is not None  # (hashes are only computed with an index)
        bs = self.index.hasher.block_size
        max_blocks = min(len(self._hashes), (num_tokens - 1) // bs)
        expected, fresh = {}, {}
        for w in candidates:
            cached = (hits.get(w.endpoint.worker_id) or 0) // bs
            n = f = 0
            while n < max_blocks and (n < cached or self._hashes[n] in w.pending_blocks):
                f += self._hashes[n] in w.pending_blocks
                n += 1
            expected[w.endpoint.worker_id], fresh[w.endpoint.worker_id] = n * bs, f * bs
        return expected, fresh

    def acquire(self, role: Role, prompt_token_ids: Sequence[int] | None = None, request_id: str = "",
                preferred: str | None = None, cache_salt: str | None = None) -> WorkerLoad:
        """Picks a worker (`preferred` if healthy, else by the policy) and counts one more request
        in flight on it (and its prompt tokens still to compute, when `prompt_token_ids` are given)."""
        load, predicted = self.pick_with_hit(role, prompt_token_ids, preferred, cache_salt)
        load.num_in_flight += 1
        # the prompt's tokens the worker computes: past its cached prefix, and (with pending hits) past
        # the blocks that prompts sent there ahead compute first
        queued = max(0, len(prompt_token_ids or ()) - max(predicted or 0, self._expected or 0))
        load.num_queued_tokens += queued
        hashes = tuple(self._hashes)
        load.pending_blocks.update(hashes)
        self._leases.setdefault((request_id, load.endpoint.worker_id), []).append([queued, predicted, hashes])
        self.last_predicted[(request_id, role.value)] = predicted
        self.last_best_hit[(request_id, role.value)] = self._best_hit
        if len(self.last_predicted) > 10_000:  # bounded: tests and benchmarks read only recent ones
            self.last_predicted.pop(next(iter(self.last_predicted)))
            self.last_best_hit.pop(next(iter(self.last_best_hit)))
        return load

    def release(self, load: WorkerLoad, request_id: str = "", num_cached_tokens: int | None = None) -> None:
        """Undoes `acquire`; `num_cached_tokens` (the worker's actual hit, when it said) is counted."""
        load.num_in_flight = max(0, load.num_in_flight - 1)
        key = (request_id, load.endpoint.worker_id)
        leases = self._leases.get(key)
        queued, predicted, hashes = leases.pop() if leases else (0, None, ())
        if leases == []:
            del self._leases[key]
        load.num_queued_tokens = max(0, load.num_queued_tokens - queued)
        load.pending_blocks.subtract(hashes)
        load.pending_blocks = +load.pending_blocks  # (drops the hashes counted down to 0)
        if self._metrics is not None and num_cached_tokens is not None and self.index is not None:
            self._metrics.record_actual_hit(load.endpoint.role.value, num_cached_tokens, predicted)

    def prefilled(self, load: WorkerLoad, request_id: str = "") -> None:
        """The worker has computed the request's prompt (its first token came): its tokens leave
        the worker's queued prefill work now, not when the request ends (a decode can run for
        minutes). Idempotent: a lease's tokens are taken off once, here or in `release`."""
        leases = self._leases.get((request_id, load.endpoint.worker_id))
        if leases:
            load.num_queued_tokens = max(0, load.num_queued_tokens - leases[-1][0])
            load.pending_blocks.subtract(leases[-1][2])
            load.pending_blocks = +load.pending_blocks
            leases[-1][0], leases[-1][2] = 0, ()

    def num_leases(self) -> int:
        """Leases not yet released (0 once every request has ended); for tests and stats."""
        return sum(len(v) for v in self._leases.values())

    def mark_dead(self, worker_id: str, reason: str) -> None:
        load = self._loads.get(worker_id)
        if load is not None and load.healthy:
            load.healthy = False
            load.num_good_probes = 0
            load.lost.set()
            logger.warning("worker %s (%s) left the rotation: %s", worker_id, load.endpoint.url, reason)

    def replace_endpoint(self, endpoint: WorkerEndpoint, reason: str) -> None:
        """The worker restarted at a new address (same id and role): it stays out of the rotation
        until that address passes `num_readmit_probes` probes."""
        load = self._loads[endpoint.worker_id]
        if load.endpoint.role is not endpoint.role:
            raise ValueError(f"worker {endpoint.worker_id} cannot change role on restart")
        self.mark_dead(endpoint.worker_id, reason)
        load.endpoint, load.num_good_probes = endpoint, 0
        logger.warning("worker %s now at %s (%s)", endpoint.worker_id, endpoint.url, reason)

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
        if self.index is not None and isinstance(stats.get("num_blocks"), int):
            load.num_pool_tokens = stats["num_blocks"] * self.index.hasher.block_size
