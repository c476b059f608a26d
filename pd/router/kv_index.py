"""The router's index of every worker's prefix cache, fed by their KV event streams.

`KVIndex` answers "which workers hold this block hash, in which KV cache
groups" and "how many of this prompt's tokens would each worker find in its
cache". It is fed batch by batch (`apply`, from `pd.router.kv_feed`) and
resynchronised by a worker's replay or snapshot answer (`resync`).

Per worker the index is in one of two states:
- EXACT: every batch since the last resync arrived, in order, from the same
  engine: the entries are the worker's cache (as of its last published step);
- DEGRADED: a gap (missed seq, or a heartbeat whose seq is ahead of ours), a
  restart (new engine id), a capacity overflow or no resync yet. Its entries
  are not trusted: `prefix_hits` reports None for it (routed by load alone)
  until a replay or snapshot brings it back to EXACT.
A worker that leaves (`drop_worker`, a dead worker) loses all its entries.

Copies: the block pool reports, as vLLM does, one "stored" per cached copy of a
hash and one "removed" per copy that leaves (two requests that computed the same
prefix at once hold two blocks with one hash). The index counts copies per
(hash, group): a hash is held until its last copy is removed. A "removed" for a
hash the index does not hold changes nothing. A snapshot lists a hash once per copy.

Memory is bounded: at most `max_entries` (hash, worker, group) entries in all,
`max_entries // num_workers` per worker. A worker over its share is DEGRADED, its
entries are dropped, and it stays DEGRADED: only a snapshot that fits in the
share (`resync`) brings it back, never a replay onto the emptied entries. An
entry is one 32-byte digest and its copy count in one dict, about 100 bytes in
CPython, so the default 1,000,000 entries is about 100 MB.

Hashes are computed with the workers' own `BlockHasher` (same algorithm, seed,
block size, extra keys); `check_identity` refuses a worker whose hashing
identity differs from the router's (`HashingMismatch`).
"""
from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Container, Iterable, Mapping, Sequence

from kvcache.hashing import BlockHasher
from pd.cluster.kv_wire import EventBatch

logger = logging.getLogger(__name__)

DEFAULT_MAX_ENTRIES = 1_000_000
MAX_PENDING_BATCHES = 10_000  # live batches kept while a worker resynchronises


class IndexState(str, enum.Enum):
    EXACT = "exact"
    DEGRADED = "degraded"


class HashingMismatch(ValueError):
    """A worker hashes prefixes differently from the router: its hits would be meaningless."""


@dataclasses.dataclass
class _WorkerCache:
    worker_id: str
    engine_id: str | None = None
    seq: int = 0
    state: IndexState = IndexState.DEGRADED
    reason: str = "not synchronised yet"
    groups: dict[int, dict[bytes, int]] = dataclasses.field(default_factory=dict)  # hash -> copies
    num_entries: int = 0
    pending: list[EventBatch] = dataclasses.field(default_factory=list)
    needs_snapshot: bool = True  # entries dropped (or never loaded): a replay cannot rebuild them
    over_share: bool = False  # its last snapshot, or its entries, did not fit in its share


class KVIndex:
    def __init__(self, hasher: BlockHasher, identity: dict | None = None,
                 max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.hasher = hasher
        self.identity = identity  # the router's expected hashing identity; None: adopt the first worker's
        self.max_entries = max_entries
        self._workers: dict[str, _WorkerCache] = {}

    # -- membership ------------------------------------------------------------
    def check_identity(self, worker_id: str, identity: dict) -> None:
        """Raises HashingMismatch unless `identity` is the router's (algorithm, block size, seed, groups)."""
        mine = {"algorithm": self.hasher.algorithm, "block_size": self.hasher.block_size,
                "seed_digest": self.hasher.none_hash.hex()}
        theirs = {k: identity.get(k) for k in mine}
        if theirs != mine:
            diff = sorted(k for k in mine if theirs[k] != mine[k])
            raise HashingMismatch(f"worker {worker_id} hashes prefixes differently from the router ({diff} differ)")
        if self.identity is None:
            self.identity = dict(mine, groups=identity.get("groups"))
        elif identity.get("groups") != self.identity.get("groups"):
            raise HashingMismatch(f"worker {worker_id} has other KV cache groups: {identity.get('groups')} "
                                  f"vs {self.identity.get('groups')}")

    def add_worker(self, worker_id: str) -> None:
        self._workers.setdefault(worker_id, _WorkerCache(worker_id))

    def drop_worker(self, worker_id: str) -> None:
        """A dead worker: its entries go (it holds nothing any more)."""
        if self._workers.pop(worker_id, None) is not None:
            logger.info("kv index: dropped worker %s", worker_id)

    def state(self, worker_id: str) -> IndexState | None:
        w = self._workers.get(worker_id)
        return None if w is None else w.state

    def describe(self, worker_id: str) -> dict | None:
        w = self._workers.get(worker_id)
        if w is None:
            return None
        return {"state": w.state.value, "num_entries": w.num_entries, "seq": w.seq, "engine_id": w.engine_id,
                "reason": w.reason if w.state is IndexState.DEGRADED else None, "over_share": w.over_share}

    def resume_seq(self, worker_id: str) -> int | None:
        """The seq a replay may start after, or None when only a snapshot can resynchronise."""
        w = self._workers.get(worker_id)
        return None if w is None or w.needs_snapshot or w.engine_id is None else w.seq

    def share(self) -> int:
        """Entries each worker may hold (`max_entries // num_workers`)."""
        return self.max_entries // max(1, len(self._workers))

    def hashes(self, worker_id: str) -> dict[int, set[bytes]]:
        """A copy of the worker's indexed hashes per group."""
        return {g: set(hs) for g, hs in self._workers[worker_id].groups.items() if hs}

    def copies(self, worker_id: str) -> dict[int, dict[bytes, int]]:
        """A copy of the worker's indexed hashes per group, with how many blocks hold each."""
        return {g: dict(hs) for g, hs in self._workers[worker_id].groups.items() if hs}

    def holders(self, block_hash: bytes) -> dict[str, set[int]]:
        """worker id -> the groups in which it holds `block_hash` (EXACT workers only)."""
        out: dict[str, set[int]] = {}
        for w in self._workers.values():
            if w.state is IndexState.EXACT:
                groups = {g for g, hs in w.groups.items() if block_hash in hs}
                if groups:
                    out[w.worker_id] = groups
        return out

    @property
    def num_entries(self) -> int:
        return sum(w.num_entries for w in self._workers.values())

    # -- feeding ---------------------------------------------------------------
    def apply(self, batch: EventBatch) -> str:
        """Applies one verified batch; returns what happened: applied, duplicate, buffered,
        gap, restart, unknown_worker (the last three leave the worker DEGRADED, wanting a resync)."""
        w = self._workers.get(batch.worker_id)
        if w is None:
            return "unknown_worker"
        if w.engine_id is not None and batch.engine_id != w.engine_id:
            self._degrade(w, f"restart: engine {w.engine_id} -> {batch.engine_id}")
            w.pending = [] if batch.heartbeat else [batch]
            return "restart"
        if batch.heartbeat:
            return self._heartbeat(w, batch)
        if w.state is IndexState.DEGRADED:
            if len(w.pending) < MAX_PENDING_BATCHES:
                w.pending.append(batch)
            return "buffered"
        if batch.seq <= w.seq:
            return "duplicate"
        if batch.seq != w.seq + 1:
            self._degrade(w, f"gap: expected seq {w.seq + 1}, got {batch.seq}")
            w.pending = [batch]
            return "gap"
        self._apply_events(w, batch.events)
        w.seq = batch.seq
        return "applied"

    def resync(self, worker_id: str, answer: dict) -> bool:
        """Applies a replay endpoint answer (`batches` after our seq, or a `snapshot`), then the
        live batches buffered meanwhile; True when the worker is EXACT again."""
        w = self._workers.get(worker_id)
        if w is None:
            return False
        engine_id = answer["engine_id"]
        if "snapshot" in answer:
            snap = answer["snapshot"]
            groups: dict[int, dict[bytes, int]] = {}
            for g, hexes in snap["groups"].items():
                held = groups.setdefault(int(g), {})
                for h in hexes:
                    key = bytes.fromhex(h)
                    held[key] = held.get(key, 0) + 1
            w.seq, w.engine_id = int(snap["seq"]), engine_id
            num_entries = sum(len(hs) for hs in groups.values())
            if num_entries > self.share():  # stays DEGRADED, holding nothing, as documented
                self._drop_entries(w, f"snapshot of {num_entries} entries is over the index's share "
                                      f"of {self.share()}")
                w.pending = [b for b in w.pending if b.engine_id == engine_id and b.seq > w.seq]
                return False
            w.groups, w.num_entries = groups, num_entries
            w.needs_snapshot = w.over_share = False
        else:
            if engine_id != w.engine_id or w.needs_snapshot:
                return False  # batches of another engine, or onto dropped entries: ask for a snapshot
            for b in answer["batches"]:
                if b["seq"] == w.seq + 1:
                    self._apply_events(w, [[k, g, [bytes.fromhex(h) for h in hs]] for k, g, hs in b["events"]])
                    w.seq = b["seq"]
        for b in sorted(w.pending, key=lambda b: b.seq):
            if b.engine_id == engine_id and b.seq == w.seq + 1:
                self._apply_events(w, b.events)
                w.seq = b.seq
        stale = [b for b in w.pending if b.engine_id != engine_id or b.seq > w.seq]
        if any(b.engine_id != engine_id for b in stale):
            w.pending = stale
            return False  # another restart happened meanwhile
        w.pending = []
        if stale or w.needs_snapshot:
            return False
        w.state, w.reason = IndexState.EXACT, ""
        return True

    def _heartbeat(self, w: _WorkerCache, batch: EventBatch) -> str:
        """A heartbeat follows every batch published before it: a seq ahead of ours means lost batches."""
        if w.state is IndexState.EXACT and batch.seq > w.seq:
            self._degrade(w, f"gap: heartbeat at seq {batch.seq}, index at seq {w.seq}")
            return "gap"
        return "heartbeat"

    def _apply_events(self, w: _WorkerCache, events: Iterable) -> None:
        for kind, group, hashes in events:
            if kind == "cleared":
                w.groups, w.num_entries = {}, 0
                continue
            held = w.groups.setdefault(group, {})
            before = len(held)
            if kind == "stored":
                for h in hashes:
                    held[h] = held.get(h, 0) + 1
            else:
                for h in hashes:
                    n = held.get(h)
                    if n is not None and n > 1:
                        held[h] = n - 1
                    elif n is not None:
                        del held[h]
            w.num_entries += len(held) - before
        if w.num_entries > self.share():
            self._drop_entries(w, f"over the index's share of {self.share()} entries")

    def _drop_entries(self, w: _WorkerCache, reason: str) -> None:
        """Over the share: DEGRADED, holding nothing, until a snapshot that fits."""
        self._degrade(w, reason)
        w.groups, w.num_entries = {}, 0
        w.needs_snapshot = w.over_share = True

    def _degrade(self, w: _WorkerCache, reason: str) -> None:
        if w.state is IndexState.EXACT:
            logger.warning("kv index: worker %s DEGRADED: %s", w.worker_id, reason)
        w.state, w.reason = IndexState.DEGRADED, reason

    def mark_degraded(self, worker_id: str, reason: str) -> None:
        w = self._workers.get(worker_id)
        if w is not None:
            self._degrade(w, reason)

    # -- lookup ----------------------------------------------------------------
    def prompt_hashes(self, token_ids: Sequence[int], lora_name: str | None = None,
                      cache_salt: str | None = None) -> list[bytes]:
        """The chained hashes of the prompt's full blocks, exactly as a worker's Request gets them."""
        bs = self.hasher.block_size
        out: list[bytes] = []
        parent = None
        for start in range(0, len(token_ids) // bs * bs, bs):
            parent = self.hasher.hash_block_tokens(parent, token_ids[start:start + bs], lora_name,
                                                   cache_salt if start == 0 else None)
            out.append(parent)
        return out

    def prefix_hits(self, num_prompt_tokens: int, hashes: Sequence[bytes],
                    worker_ids: Iterable[str]) -> dict[str, int | None]:
        """Prompt tokens each worker would serve from its cache (None: DEGRADED or unknown).
        As on the worker, the last prompt token is never a hit, and for hybrid models a hit
        counts only up to where every KV cache group agrees."""
        bs = self.hasher.block_size
        max_blocks = min(len(hashes), (num_prompt_tokens - 1) // bs)
        groups = (self.identity or {}).get("groups") or [{"kind": "full_attention"}]
        out: dict[str, int | None] = {}
        for wid in worker_ids:
            w = self._workers.get(wid)
            if w is None or w.state is not IndexState.EXACT:
                out[wid] = None
                continue
            out[wid] = _agreed_hit(w.groups, groups, hashes, max_blocks, bs) * bs
        return out


def _agreed_hit(held: Mapping[int, Container[bytes]], groups: list[dict], hashes: Sequence[bytes],
                max_blocks: int, block_size: int) -> int:
    """Blocks of the longest prefix every group holds (full attention: every block; sliding
    window: the blocks its window still needs; Mamba: the last block)."""
    limit = max_blocks
    while True:
        agreed = limit
        for g, spec in enumerate(groups):
            agreed = min(agreed, _group_hit(held.get(g, set()), spec, hashes, agreed, block_size))
        if agreed == limit:
            return agreed
        limit = agreed


def _group_hit(held: Container[bytes], spec: dict, hashes: Sequence[bytes], limit: int, block_size: int) -> int:
    kind = spec.get("kind")
    if kind == "full_attention":
        n = 0
        while n < limit and hashes[n] in held:
            n += 1
        return n
    window = spec.get("sliding_window") or 0
    need = -(-(window - 1) // block_size) if kind == "sliding_window" and window else 1
    run = 0
    for i in range(limit - 1, -1, -1):  # the latest run of `need` present blocks (or one from block 0)
        if hashes[i] not in held:
            run = 0
            continue
        run += 1
        if run >= need or i == 0:
            return i + run
    return 0
