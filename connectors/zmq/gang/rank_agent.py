"""The thread in every rank of a gang that moves that rank's KV heads on rank 0's command.

An agent connects to its gang's control socket (`gang_control.GangControl`, bound by rank 0 in a
private directory), registers what it holds and where it serves, then runs rank 0's commands one
at a time: on a prefill gang `grant` / `revoke` tickets of its `SliceServer`; on a decode gang
`load` (pull this rank's heads with its `SlicePuller`, answer `loaded` with the blocks not to
trust and the bytes landed per P rank); on either, `digests` (checksums of pages, for audits and
tests) and `stop`. Rank 0 runs an agent too (a thread in its own process), so every rank, rank 0
included, moves only its own heads.

Guarantees: every command gets exactly one answer (`err` with the reason when it cannot run);
a malformed command is answered `err` or dropped, never fatal; `close` ends the thread.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

import zmq

from connectors.metrics import FailureCause
from connectors.pages import KVPages
from connectors.zmq.control.wire import MalformedMessage
from connectors.zmq.gang import agent_wire
from connectors.zmq.gang.head_plan import HeadGeometry, RankHeads
from connectors.zmq.gang.rank_faults import RankFaults
from connectors.zmq.gang.slice_puller import SlicePuller
from connectors.zmq.gang.slice_server import SliceServer
from connectors.zmq.paths.page_access import InPlacePages

logger = logging.getLogger(__name__)

_POLL_MS = 100


class RankAgent:
    """Rank `heads.rank`'s agent: `serve=True` on a prefill gang (a `SliceServer` on `host`); every
    agent can pull (a decode gang's; a worker that is both prefills and decodes)."""

    def __init__(self, control: str, pool: KVPages, geometry: HeadGeometry, heads: RankHeads, serve: bool,
                 host: str = "127.0.0.1", faults: Any = None):
        """`faults`: the worker's fault plan (`connectors.links.faults.FaultPlan`, or None): its
        `gang.*` points fire on this rank (`rank_faults.py`)."""
        self.pool = pool
        self.heads = heads
        self.faults = RankFaults(faults, heads.rank)
        self.server = SliceServer(pool, geometry, host, self.faults) if serve else None
        self.puller = SlicePuller(pool, geometry, heads)  # (no socket until it pulls)
        self.received_bytes = 0  # what this rank's loads landed in its pool, in all
        self.received_from: dict[int, int] = {}  # ... by the P rank it came from
        self._sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(control)
        shm = (pool.shared_path or "") if serve else ""
        self._sock.send(agent_wire.encode(
            "register", rank=heads.rank, tcp=self.server.endpoint if self.server else "", shm=shm,
            shm_bytes=pool.nbytes if shm else 0, page_bytes=pool.page_size_bytes, num_blocks=pool.num_blocks,
            first=heads.first, count=heads.count))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"kv-rank-agent-{heads.rank}", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._sock.poll(_POLL_MS, zmq.POLLIN):
                    continue
                payload = self._sock.recv()
                try:
                    msg_type, msg = agent_wire.decode(payload)
                except MalformedMessage as e:
                    logger.warning("rank agent %d: dropped a malformed command: %s", self.heads.rank, e)
                    continue
                try:
                    answer: bytes | None = self._run(msg_type, msg)
                except (ValueError, MalformedMessage, OSError) as e:
                    answer = agent_wire.encode("err", id=msg.get("id", 0), reason=str(e)[:500])
                except Exception as e:  # noqa: BLE001 -- a bug fails this command, not the rank's agent
                    logger.exception("rank agent %d: %s failed", self.heads.rank, msg_type)
                    answer = agent_wire.encode("err", id=msg.get("id", 0), reason=f"{type(e).__name__}: {e}"[:500])
                if answer is not None:  # (None: a fault plan dropped it)
                    self._sock.send(answer)
                if msg_type == "stop":
                    return
        finally:
            if self.server is not None:
                self.server.close()
            self.puller.close()
            self._sock.close(linger=1000)  # lets the last answer (stop's) out

    def _run(self, msg_type: str, msg: dict) -> bytes | None:
        cid = msg["id"]
        if msg_type == "grant" and self.server is not None:
            self.server.grant(msg["ticket"], msg["block_ids"], msg["ttl_s"])
        elif msg_type == "revoke" and self.server is not None:
            self.server.revoke(msg["ticket"])
        elif msg_type == "load":
            fault = self.faults.fire("load")
            if fault == "drop":
                return None
            start = time.perf_counter()
            res = self.puller.pull(msg["ticket"], agent_wire.sources_of(msg), msg["src"], msg["dst"], msg["path"],
                                   msg["timeout_s"])
            if fault == "corrupt" and msg["dst"]:
                res.bad = sorted(set(res.bad) | {msg["dst"][0]})
                res.cause = res.cause or FailureCause.CHECKSUM
            self.received_bytes += res.nbytes
            for p_rank, n in res.by_source.items():
                self.received_from[p_rank] = self.received_from.get(p_rank, 0) + n
            return agent_wire.encode("loaded", id=cid, ok=res.ok, bad=res.bad, cause=res.cause.value if res.cause
                                     else "", bytes=res.nbytes, by_source=[[k, v] for k, v in res.by_source.items()],
                                     seconds=time.perf_counter() - start)
        elif msg_type == "digests":
            if any(not 0 <= b < self.pool.num_blocks for b in msg["block_ids"]):
                raise ValueError(f"block ids outside a pool of {self.pool.num_blocks} blocks")
            return agent_wire.encode("sliced", id=cid, digests=InPlacePages(self.pool).page_digests(msg["block_ids"]))
        elif msg_type != "stop":
            raise ValueError(f"{msg_type} is not a command for a {'prefill' if self.server else 'decode'} rank")
        return agent_wire.encode("ok", id=cid)
