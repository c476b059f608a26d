"""A D rank's data plane: pulls exactly the KV heads it holds, from the P ranks that hold them,
and lands them in its own pool.

For one load (`pull`) the rank plans its copies (`head_plan.plan_pulls`: each head once, from the
lowest P rank holding it), sends every `slice` request at once (one DEALER per P rank: the P
ranks serve in parallel) and lands the answers as they come: on `tcp` the packed heads arrive as a
frame; on `shm` (same host, CPU pools) the rank maps the P rank's pool read-only and copies its
heads out itself. Either way each block's packed heads are checked against the P rank's xxh3
before they are scattered into the pool, so a bad block is never written. Nothing is forwarded:
a D rank only receives.

Guarantees: `pull` returns within its timeout (+ one copy) with the blocks not to trust; bytes
received are counted per P rank (`PullResult.by_source`).
"""
from __future__ import annotations

import dataclasses
import logging
import time
import warnings

import numpy as np
import torch
import zmq

from connectors.metrics import FailureCause
from connectors.pages import KVPages
from connectors.zmq.control.wire import MalformedMessage
from connectors.zmq.gang import agent_wire
from connectors.zmq.gang.head_plan import (HeadGeometry, RankHeads, Scratch, SlicePull, block_bytes, gather,
                                           head_pages, plan_pulls, pool_heads, scatter)
from connectors.zmq.paths.page_access import digest
from connectors.zmq.paths.shm_segment import map_pool

logger = logging.getLogger(__name__)

PATHS = ("tcp", "shm")


@dataclasses.dataclass
class PullResult:
    bad: list[int]
    cause: FailureCause | None
    nbytes: int = 0  # bytes landed in this rank's pool
    by_source: dict[int, int] = dataclasses.field(default_factory=dict)  # P rank -> bytes landed from it

    @property
    def ok(self) -> bool:
        return self.cause is None and not self.bad


class SlicePuller:
    """Pulls this rank's heads (`mine`) into `pool`. Used by one thread (its agent's)."""

    def __init__(self, pool: KVPages, geometry: HeadGeometry, mine: RankHeads):
        if mine.count != geometry.num_heads:
            raise ValueError(f"rank {mine.rank} holds {mine.count} heads but its pages have {geometry.num_heads}")
        self.pool = pool
        self.geometry = geometry
        self.mine = mine
        self._pages = pool_heads(pool, geometry)
        self._ctx: zmq.Context = zmq.Context.instance()
        self._socks: dict[str, zmq.Socket] = {}
        self._maps: dict[str, tuple[int, torch.Tensor]] = {}
        self._next_id = 0
        self._scratch = Scratch()  # shm: the heads copied out of a P pool, checked, then scattered

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(linger=0)
        self._socks.clear()
        self._maps.clear()

    def _socket(self, endpoint: str) -> zmq.Socket:
        sock = self._socks.get(endpoint)
        if sock is None:
            if not endpoint.startswith("tcp://"):
                raise ValueError(f"not a tcp endpoint: {endpoint!r}")
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self._socks[endpoint] = sock
        return sock

    def _mapped(self, source: dict) -> torch.Tensor:
        key = source["shm"]
        hit = self._maps.get(key)
        if hit is None or hit[0] != source["shm_bytes"]:
            array = map_pool(key, source["shm_bytes"], source["page_bytes"])
            with warnings.catch_warnings():  # read-only mapping: we only ever read it
                warnings.simplefilter("ignore", UserWarning)
                buf = torch.from_numpy(array)
            geo = dataclasses.replace(self.geometry, num_heads=source["count"])
            hit = (source["shm_bytes"], head_pages(buf, geo))
            self._maps[key] = hit
        return hit[1]

    def pull(self, ticket: bytes, sources: list[dict], src: list[int], dst: list[int], path: str,
             timeout_s: float) -> PullResult:
        """Lands this rank's heads of P blocks `src` in its blocks `dst`."""
        if path == "shm" and self.pool.device.type != "cpu":
            raise ValueError("the shm gang path lands in CPU pools only")
        if path not in PATHS:
            raise ValueError(f"unknown gang data path {path!r} (want one of {PATHS})")
        if len(src) != len(dst) or not dst or any(not 0 <= b < self.pool.num_blocks for b in dst):
            raise ValueError("a load needs as many source as destination blocks, inside the pool")
        by_rank = {s["rank"]: s for s in sources}
        plan = plan_pulls([RankHeads(s["rank"], s["first"], s["count"]) for s in sources], self.mine)
        deadline = time.monotonic() + timeout_s
        waiting: dict[int, SlicePull] = {}
        socks: dict[zmq.Socket, int] = {}
        result = PullResult([], None)
        for step in plan:  # every request out first: the P ranks serve at once
            self._next_id += 1
            sock = self._socket(by_rank[step.p_rank]["tcp"])
            sock.send(agent_wire.encode("slice", id=self._next_id, ticket=ticket, block_ids=src, first=step.p_first,
                                        count=step.count, send=path == "tcp"))
            waiting[self._next_id] = step
            socks[sock] = step.p_rank
        poller = zmq.Poller()
        for sock in socks:
            poller.register(sock, zmq.POLLIN)
        while waiting:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                result.cause = FailureCause.TIMEOUT
                break
            for sock, _ in poller.poll(left_ms):
                frames = sock.recv_multipart(copy=False)
                try:
                    self._land(frames, waiting, by_rank, src, dst, path, result)
                except MalformedMessage as e:
                    logger.debug("slice puller: dropped an answer: %s", e)
        if waiting:  # their heads never landed: every destination block is incomplete
            result.bad = list(dst)
            for sock in socks:  # a late answer must not be read as the next load's
                sock.close(linger=0)
                self._socks = {k: v for k, v in self._socks.items() if v is not sock}
        result.bad = sorted(set(result.bad))
        if result.bad and result.cause is None:
            result.cause = FailureCause.CHECKSUM
        return result

    def _land(self, frames, waiting: dict[int, SlicePull], by_rank: dict[int, dict], src: list[int],
              dst: list[int], path: str, result: PullResult) -> None:
        msg_type, msg = agent_wire.decode(frames[0].buffer)
        step = waiting.pop(msg["id"], None)
        if step is None:
            raise MalformedMessage(f"an answer to no request in flight ({msg['id']})")
        if msg_type == "err":
            logger.warning("P rank %d refused a slice: %s", step.p_rank, msg["reason"][:200])
            result.bad.extend(dst)
            result.cause = result.cause or FailureCause.PULL_REFUSED
            return
        if msg_type != "sliced" or len(msg["digests"]) != len(dst):
            result.bad.extend(dst)
            raise MalformedMessage("expected one checksum per block")
        shape = (len(dst), self._pages.shape[1], step.count, self._pages.shape[3])
        if path == "tcp":
            if len(frames) != 2:
                result.bad.extend(dst)
                raise MalformedMessage("a tcp slice answer without its bytes")
            raw = np.frombuffer(frames[1].buffer, dtype=np.uint8)
            want = int(np.prod(shape)) * self._pages.element_size()
            if raw.size != want:
                result.bad.extend(dst)
                raise MalformedMessage(f"slice of {raw.size} bytes, expected {want}")
            with warnings.catch_warnings():  # the frame is read-only: it is only read (scattered) here
                warnings.simplefilter("ignore", UserWarning)
                packed = torch.from_numpy(raw).view(self._pages.dtype).view(shape)
        else:
            packed = gather(self._mapped(by_rank[step.p_rank]), src, step.p_first, step.count, self._scratch)
        good = [i for i, view in enumerate(block_bytes(packed)) if digest(view) == msg["digests"][i]]
        kept = set(good)
        result.bad.extend(dst[i] for i in range(len(dst)) if i not in kept)
        if good:
            scatter(self._pages, [dst[i] for i in good], step.d_first, packed[good] if len(good) < len(dst) else packed)
        landed = len(good) * packed[0].numel() * packed.element_size()
        result.nbytes += landed
        result.by_source[step.p_rank] = result.by_source.get(step.p_rank, 0) + landed
