"""A P rank's data plane: serves runs of its own KV heads to D ranks, for granted tickets only.

Rank 0 of the prefill gang holds the leases (`producer/leases.py`); while a pull of a lease is
pinned it `grant`s a ticket (random, unguessable) for the pull's blocks to every P rank, and
`revoke`s it when the pull ended. A D rank names the ticket in each `slice` request; this server
answers only for blocks of a live ticket and heads this rank holds, so it never serves another
rank's heads and nothing after the lease was unpinned. Each answer carries an xxh3 checksum per
block of the packed heads; on the `tcp` path the packed bytes follow as one frame, on the `shm`
path the D rank copies them out of this rank's pool (mapped read-only) and checks them.

Guarantees: one thread owns the ROUTER; grants and revokes (another thread) touch only the ticket
table, under its lock; an expired ticket is refused even before its revoke arrives; a malformed
request is answered `err` or dropped, never fatal.
"""
from __future__ import annotations

import logging
import threading
import time

import zmq

from connectors.pages import KVPages
from connectors.zmq.control.wire import MalformedMessage
from connectors.zmq.gang import agent_wire
from connectors.zmq.gang.head_plan import HeadGeometry, Scratch, block_bytes, gather, pool_heads
from connectors.zmq.gang.rank_faults import RankFaults
from connectors.zmq.paths.page_access import digest

logger = logging.getLogger(__name__)

_POLL_MS = 100  # the serving thread notices `close` this often


class SliceServer:
    """Serves this rank's heads of granted blocks on `endpoint` (tcp://host:port)."""

    def __init__(self, pool: KVPages, geometry: HeadGeometry, host: str = "127.0.0.1",
                 faults: RankFaults | None = None):
        self.pool = pool
        self.faults = faults  # a fault plan's `gang.slice` points (rank_faults.py)
        self.geometry = geometry
        self._pages = pool_heads(pool, geometry)
        self._tickets: dict[bytes, tuple[frozenset[int], float]] = {}
        self._lock = threading.Lock()
        self.served_bytes = 0  # page bytes sent on the tcp path
        self.served_slices = 0  # slice requests answered (either path)
        self._scratch = Scratch()  # packed heads, reused once zmq sent the last ones (`_sent`)
        self._sent: zmq.MessageTracker | None = None
        self._sock: zmq.Socket = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Any peer can reach this port before it shows a ticket: zmq drops one sending more than a
        # request can be, instead of buffering it whole.
        self._sock.setsockopt(zmq.MAXMSGSIZE, agent_wire.MAX_MESSAGE_BYTES)
        port: int = self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kv-slice-server", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ tickets (rank 0's commands)
    def grant(self, ticket: bytes, block_ids: list[int], ttl_s: float) -> None:
        if len(ticket) < 16:
            raise ValueError("a ticket has at least 16 random bytes")
        if any(not 0 <= b < self.pool.num_blocks for b in block_ids):
            raise ValueError(f"granted blocks outside a pool of {self.pool.num_blocks}")
        with self._lock:
            self._tickets[ticket] = (frozenset(block_ids), time.monotonic() + ttl_s)

    def revoke(self, ticket: bytes) -> None:
        with self._lock:
            self._tickets.pop(ticket, None)

    def live_tickets(self) -> int:
        now = time.monotonic()
        with self._lock:
            return sum(1 for _, until in self._tickets.values() if until > now)

    def _allowed(self, ticket: bytes, block_ids: list[int]) -> str | None:
        with self._lock:
            entry = self._tickets.get(ticket)
        if entry is None or entry[1] < time.monotonic():
            return "no such ticket (never granted, revoked or expired)"
        if not set(block_ids) <= entry[0]:
            return "blocks not granted to this ticket"
        return None

    # ------------------------------------------------------------------ serving thread
    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._sock.poll(_POLL_MS, zmq.POLLIN):
                    continue
                frames = self._sock.recv_multipart(copy=True)
                if len(frames) != 2:
                    continue  # not ours: a ROUTER frame is [identity, message]
                try:
                    self._answer(frames[0], frames[1])
                except MalformedMessage as e:
                    logger.debug("slice server: dropped a malformed request: %s", e)
                except zmq.ZMQError as e:
                    logger.debug("slice server: answer not sent: %s", e)
                except Exception:  # a bug must not end the rank's serving: that request goes unanswered
                    logger.exception("slice server: a request failed")
        finally:
            self._sock.close(linger=0)

    def _answer(self, who: bytes, payload: bytes) -> None:
        msg_type, msg = agent_wire.decode(payload)
        if msg_type != "slice":
            raise MalformedMessage(f"expected slice, got {msg_type}")
        block_ids, first, count = msg["block_ids"], msg["first"], msg["count"]
        reason = self._allowed(msg["ticket"], block_ids)
        if reason is None and (first + count > self.geometry.num_heads or count < 1):
            reason = f"heads {first}+{count} are not this rank's ({self.geometry.num_heads} local heads)"
        if reason is not None:
            self._sock.send_multipart([who, agent_wire.encode("err", id=msg["id"], reason=reason)])
            return
        fault = self.faults.fire("slice") if self.faults is not None else None
        if fault == "drop":
            return
        scratch = self._scratch if self._reusable() else None
        packed = gather(self._pages, block_ids, first, count, scratch)
        if packed.device.type != "cpu":  # a CUDA pool: the heads leave through host memory (tcp)
            packed = packed.cpu()
        digests = [digest(b) for b in block_bytes(packed)]
        if fault == "corrupt" and digests:
            digests[0] ^= 1
        head = agent_wire.encode("sliced", id=msg["id"], digests=digests)
        self.served_slices += 1
        frames: list = [who, head]
        if msg["send"]:
            frames.append(memoryview(packed.reshape(-1).numpy()).cast("B"))
            self.served_bytes += packed.numel() * packed.element_size()
        for _ in range(2 if fault == "dup" else 1):
            tracker = self._sock.send_multipart(frames, copy=False, track=True)
        self._sent = tracker if scratch is not None and msg["send"] else self._sent

    def _reusable(self) -> bool:
        """Whether zmq is done with the scratch's last bytes (else this answer takes fresh memory)."""
        sent = self._sent
        if sent is None or sent.done:
            return True
        try:
            sent.wait(0.05)
        except zmq.NotDone:
            return False
        return True
