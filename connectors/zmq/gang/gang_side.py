"""Rank 0's handle on its gang's KV data plane, as the connector holds it (`GangSide`).

A worker of TP degree t > 1 is given one by its wiring: the `GangControl` its ranks' agents
registered on, the heads rank 0 holds and how its pages split into them; the connector starts
rank 0's own agent on rank 0's pool (`start`) and waits for every rank to register. A TP 1 worker
has none until a gang meets it: then the connector makes a gang of one (`for_single_rank`: rank 0
holds every head), lazily, so a TP 1 worker that only ever meets TP 1 peers runs nothing more and
sends nothing different.

Rules of the gang path (`gang_path.py`): the compatibility hash and the pull protocol describe
canonical pages (every KV head); a gang of TP > 1 serves and loads only through its ranks (a
plain path would move rank 0's heads alone); `layer` streaming is refused with TP > 1 (a layer
slice is a byte range of a canonical page, but a rank holds a strided run of heads in every
layer's rows: the unit of one rank's transfer is not a slice of rank 0's page).
"""
from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from connectors.pages import KVPages
from connectors.zmq.gang.gang_control import GangControl, GangLoadResult
from connectors.zmq.gang.head_plan import HeadGeometry, RankHeads
from connectors.zmq.gang.rank_agent import RankAgent

logger = logging.getLogger(__name__)


def geometry_from_groups(kv_cache_groups: Any) -> tuple[int, int, torch.dtype]:
    """(KV heads, head dim, dtype) of canonical pages, from kvcache `KVCacheGroupSpec`s (duck-typed);
    ValueError for groups a head split cannot describe (state that is not attention, mixed shapes)."""
    shapes = set()
    for g in kv_cache_groups:
        spec = g.spec
        heads, size, dtype = (getattr(spec, k, None) for k in ("num_kv_heads", "head_size", "dtype"))
        if heads is None or size is None or dtype is None or getattr(spec, "head_size_v", None) not in (None, size):
            raise ValueError(f"KV between TP gangs needs attention groups of one head shape; "
                             f"{type(spec).__name__} is not one")
        shapes.add((int(heads), int(size), str(dtype)))
    if len(shapes) != 1:
        raise ValueError(f"KV between TP gangs needs one head shape in every group, got {sorted(shapes)}")
    heads, size, name = shapes.pop()
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown KV dtype {name!r}")
    return heads, size, dtype


class GangSide:
    """What the connector of rank 0 knows of its gang. `tp` = 1: a gang of one (rank 0 holds every
    head), its control made on first use."""

    def __init__(self, tp: int, heads: RankHeads, geometry: HeadGeometry, control: GangControl | None = None,
                 host: str = "127.0.0.1", load_timeout_s: float = 30.0, register_timeout_s: float = 60.0,
                 faults: Any = None):
        """`faults`: the worker's fault plan for rank 0's agent (its `gang.*` points; None: none)."""
        if (control is None) != (tp == 1):
            raise ValueError("a gang of TP > 1 comes with the control its ranks registered on (and only it)")
        if heads.rank != 0 or heads.count != geometry.num_heads:
            raise ValueError("rank 0's heads and page geometry disagree")
        self.tp = tp
        self.heads = heads
        self.geometry = geometry
        self.host = host
        self.load_timeout_s = load_timeout_s
        self.register_timeout_s = register_timeout_s
        self.canonical_page_bytes = 0  # a TP 1 page's bytes (set with the pool)
        self.shm_ok = True  # consumer: same-host gangs may map each other's pools (`data_path` not tcp)
        self.faults = faults
        self._control = control
        self._agent: RankAgent | None = None
        self._pool: KVPages | None = None
        self._serve = False
        self._lock = threading.Lock()

    @classmethod
    def for_single_rank(cls, kv_cache_groups: Any, host: str, load_timeout_s: float) -> GangSide:
        heads, size, dtype = geometry_from_groups(kv_cache_groups)
        return cls(1, RankHeads(0, 0, heads), HeadGeometry(heads, size, dtype), host=host,
                   load_timeout_s=load_timeout_s)

    def attach_pool(self, pool: KVPages, serve: bool, canonical_page_bytes: int | None = None) -> None:
        """The connector's pool (rank 0's); a gang of TP > 1 starts rank 0's agent now and waits for
        every rank, a gang of one only when first used. `canonical_page_bytes`: a TP 1 page (what a
        load's byte counts mean; default: this pool's page)."""
        with self._lock:
            self._pool, self._serve = pool, serve
            self.canonical_page_bytes = canonical_page_bytes or pool.page_size_bytes
        if self.tp > 1:
            self.control()

    def control(self) -> GangControl:
        """The gang's control, every rank registered (rank 0's agent started on first call)."""
        with self._lock:
            if self._pool is None:
                raise RuntimeError("the gang has no pool yet (the engine registers it)")
            if self._control is None:
                self._control = GangControl(1)
            if self._agent is None:
                self._agent = RankAgent(self._control.address, self._pool, self.geometry, self.heads, self._serve,
                                        host=self.host, faults=self.faults)
            control = self._control
        control.wait_ranks(self.register_timeout_s)
        return control

    def grant(self, ticket: bytes, block_ids: list[int]) -> None:
        self.control().grant(ticket, block_ids, ttl_s=self.load_timeout_s * 2)

    def revoke(self, ticket: bytes) -> None:
        self.control().revoke(ticket)

    def sources(self) -> list[dict]:
        return self.control().sources()

    def load(self, ticket: bytes, sources: list[dict], src: list[int], dst: list[int], path: str) -> GangLoadResult:
        return self.control().load(ticket, sources, src, dst, path, self.load_timeout_s)

    def close(self) -> None:
        with self._lock:
            control, self._control, self._agent = self._control, None, None
        if control is not None:
            control.close()
