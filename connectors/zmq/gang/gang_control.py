"""Rank 0's side of a gang's KV data plane: the control socket its ranks' agents register on, and
the fan-out of grants (prefill gang) and loads (decode gang) to every rank, with their answers.

Rank 0 binds a ZMQ ROUTER on an ipc path in a fresh private directory (mode 0700: only this user
reaches it, and two gangs on one host never share a name); each rank's `RankAgent` connects and
registers (rank, heads, its data endpoint and pool). One thread owns the socket; callers on any
thread queue commands and wait on their answers, each wait bounded.

Guarantees: `load` ends only when every rank of the gang answered for its part (or the load's
deadline passed, then every destination block is reported untrusted); its bad blocks are the
union over ranks (a block is good only if every rank's heads of it landed and matched);
`grant` returns only once every P rank that will be read holds the ticket.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import shutil
import socket
import tempfile
import threading
import time

import zmq

from connectors.metrics import FailureCause
from connectors.zmq.control.wire import MalformedMessage
from connectors.zmq.gang import agent_wire

logger = logging.getLogger(__name__)

_GRACE_S = 2.0  # rank 0 waits this much past a load's deadline for a rank's (late) answer


class GangError(RuntimeError):
    """A rank did not answer in time, or refused a command (the message says which and why)."""


@dataclasses.dataclass
class _Pending:
    event: threading.Event = dataclasses.field(default_factory=threading.Event)
    msg_type: str = ""
    msg: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class GangLoadResult:
    """How a load across the gang ended; `by_rank[d][p]`: bytes D rank d landed from P rank p;
    `rank_seconds[d]`: how long D rank d's part took on that rank."""

    ok: bool
    bad: list[int]
    cause: FailureCause | None
    nbytes: int
    by_rank: dict[int, dict[int, int]]
    seconds: float
    rank_seconds: dict[int, float] = dataclasses.field(default_factory=dict)


DIR_PREFIX = "pdkv-gang-"


def sweep_stale_dirs(parent: str) -> int:
    """Removes the control directories in `parent` of gangs whose owning process is gone (a rank 0 that
    was SIGKILLed cannot remove its own); returns how many. Another user's, or a live process's, stay."""
    removed = 0
    with os.scandir(parent) as entries:
        for entry in entries:
            owner = entry.name[len(DIR_PREFIX):].split("-", 1)[0]
            if not (entry.name.startswith(DIR_PREFIX) and owner.isdigit() and entry.is_dir(follow_symlinks=False)):
                continue
            try:
                if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                    continue
                os.kill(int(owner), 0)
                continue  # its owner runs (or a process now has that pid): leave it
            except ProcessLookupError:
                pass
            except (OSError, OverflowError):
                continue  # not ours to signal, or gone from under us
            shutil.rmtree(entry.path, ignore_errors=True)
            removed += 1
    if removed:
        logger.info("removed %d control director%s of killed gangs in %s", removed, "y" if removed == 1 else "ies",
                    parent)
    return removed


class GangControl:
    """The control socket of a gang of `size` ranks (rank 0 included: its agent registers too)."""

    def __init__(self, size: int, parent_dir: str | None = None):
        """`parent_dir`: where the private directory goes (default: the system's temporary directory)."""
        if size < 1:
            raise ValueError(f"a gang has at least one rank, not {size}")
        self.size = size
        sweep_stale_dirs(parent_dir or tempfile.gettempdir())
        # 0700; named by its owner's pid, so that a later gang can remove it if that process was killed
        self._dir = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-", dir=parent_dir)
        self.address = f"ipc://{os.path.join(self._dir, 'control')}"
        self._sock: zmq.Socket = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.address)
        self.ranks: dict[int, dict] = {}  # rank -> its `register` message
        self._ids: dict[int, bytes] = {}  # rank -> ZMQ identity
        self._registered = threading.Condition()
        self._pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()
        self._next = 0
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kv-gang-control", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ ranks
    def wait_ranks(self, timeout_s: float) -> list[dict]:
        """Every rank's registration, by rank, once all `size` ranks registered."""
        deadline = time.monotonic() + timeout_s
        with self._registered:
            while len(self.ranks) < self.size:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self.size)) - set(self.ranks))
                    raise GangError(f"ranks {missing} of the gang did not register within {timeout_s}s")
                self._registered.wait(left)
            return [self.ranks[r] for r in range(self.size)]

    def sources(self) -> list[dict]:
        """The P ranks as a decode gang's `load` names them (what a handshake advertises)."""
        return [{k: info[k] for k in ("rank", "tcp", "shm", "shm_bytes", "page_bytes", "first", "count")}
                for info in self.wait_ranks(0.0)]

    def read_ranks(self) -> list[int]:
        """The ranks a decode gang reads: the lowest holder of each head (replicas are never read)."""
        ranks: list[int] = []
        seen: set[int] = set()
        for info in sorted(self.ranks.values(), key=lambda i: i["rank"]):
            heads = set(range(info["first"], info["first"] + info["count"]))
            if heads - seen:
                ranks.append(info["rank"])
            seen |= heads
        return ranks

    # ------------------------------------------------------------------ commands
    def command(self, rank: int, msg_type: str, timeout_s: float, **fields) -> tuple[str, dict]:
        return self._wait([self._send(rank, msg_type, **fields)], timeout_s)[0]

    def grant(self, ticket: bytes, block_ids: list[int], ttl_s: float, timeout_s: float = 5.0) -> None:
        pend = [self._send(r, "grant", ticket=ticket, block_ids=block_ids, ttl_s=float(ttl_s))
                for r in self.read_ranks()]
        self._check_ok(self._wait(pend, timeout_s), "grant")

    def revoke(self, ticket: bytes, timeout_s: float = 5.0) -> None:
        pend = [self._send(r, "revoke", ticket=ticket) for r in self.read_ranks()]
        self._check_ok(self._wait(pend, timeout_s), "revoke")

    def load(self, ticket: bytes, sources: list[dict], src: list[int], dst: list[int], path: str,
             timeout_s: float) -> GangLoadResult:
        """Every rank pulls its heads of `src` into its `dst`, at once; ends when all answered."""
        start = time.perf_counter()
        pend = [self._send(r, "load", ticket=ticket, path=path, sources=sources, src=src, dst=dst,
                           timeout_s=float(timeout_s)) for r in range(self.size)]
        answers = self._wait(pend, timeout_s + _GRACE_S, raise_late=False)
        bad: set[int] = set()
        cause: FailureCause | None = None
        by_rank: dict[int, dict[int, int]] = {}
        rank_seconds: dict[int, float] = {}
        nbytes = 0
        for rank, (msg_type, msg) in enumerate(answers):
            if msg_type != "loaded":
                bad.update(dst)
                cause = cause or (FailureCause.TIMEOUT if msg_type == "" else FailureCause.PULL_REFUSED)
                if msg_type == "err":
                    logger.warning("KV load: rank %d refused its part: %s", rank, msg.get("reason", "")[:200])
                continue
            by_rank[rank] = {p: n for p, n in msg["by_source"]}
            rank_seconds[rank] = float(msg["seconds"])
            nbytes += msg["bytes"]
            bad.update(msg["bad"])
            if not msg["ok"]:
                cause = cause or _cause(msg["cause"])
        ok = not bad and cause is None
        return GangLoadResult(ok, sorted(bad), None if ok else (cause or FailureCause.CHECKSUM), nbytes, by_rank,
                              time.perf_counter() - start, rank_seconds)

    def digests(self, rank: int, block_ids: list[int], timeout_s: float = 10.0) -> list[int]:
        msg_type, msg = self.command(rank, "digests", timeout_s, block_ids=block_ids)
        if msg_type != "sliced":
            raise GangError(f"rank {rank}: digests refused: {msg.get('reason')}")
        return msg["digests"]

    def close(self, timeout_s: float = 5.0) -> None:
        """Stops every registered agent, then the socket; removes the private directory."""
        if self._stop.is_set():
            return
        try:
            self._wait([self._send(r, "stop") for r in sorted(self.ranks)], timeout_s, raise_late=False)
        finally:
            self._stop.set()
            self._wake()
            self._thread.join(timeout=5.0)
            shutil.rmtree(self._dir, ignore_errors=True)

    def _check_ok(self, answers: list[tuple[str, dict]], what: str) -> None:
        for msg_type, msg in answers:
            if msg_type != "ok":
                raise GangError(f"{what} refused by a rank: {msg.get('reason', '')[:200]}")

    def _send(self, rank: int, msg_type: str, **fields) -> _Pending:
        if rank not in self._ids:
            raise GangError(f"rank {rank} is not registered")
        with self._lock:
            self._next += 1
            cid = self._next
            pend = self._pending[cid] = _Pending()
        self._out.put((self._ids[rank], agent_wire.encode(msg_type, id=cid, **fields)))
        self._wake()
        return pend

    def _wait(self, pend: list[_Pending], timeout_s: float, raise_late: bool = True) -> list[tuple[str, dict]]:
        deadline = time.monotonic() + timeout_s
        for p in pend:
            if not p.event.wait(max(0.0, deadline - time.monotonic())) and raise_late:
                raise GangError(f"a rank did not answer within {timeout_s}s")
        with self._lock:
            for cid in [c for c, p in self._pending.items() if p in pend]:
                del self._pending[cid]
        return [(p.msg_type, p.msg) for p in pend]

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # full: a wake-up is pending

    # ------------------------------------------------------------------ the socket's thread
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(100))
                if self._wake_r.fileno() in events or self._wake_r in events:
                    self._wake_r.recv(4096)
                while True:
                    try:
                        who, payload = self._out.get_nowait()
                    except queue.Empty:
                        break
                    self._sock.send_multipart([who, payload])
                while self._sock.poll(0, zmq.POLLIN):
                    frames = self._sock.recv_multipart()
                    if len(frames) == 2:
                        self._on_answer(frames[0], frames[1])
        finally:
            self._sock.close(linger=0)
            self._wake_r.close()
            self._wake_w.close()

    def _on_answer(self, who: bytes, payload: bytes) -> None:
        try:
            msg_type, msg = agent_wire.decode(payload)
        except MalformedMessage as e:
            logger.warning("gang control: dropped a malformed answer: %s", e)
            return
        if msg_type == "register":
            if not 0 <= msg["rank"] < self.size or msg["rank"] in self.ranks:
                logger.warning("gang control: refused a registration as rank %d", msg["rank"])
                return
            with self._registered:
                self.ranks[msg["rank"]] = msg
                self._ids[msg["rank"]] = who
                self._registered.notify_all()
            return
        with self._lock:
            pend = self._pending.get(msg.get("id", -1))
        if pend is not None and self._ids.get(_rank_of(self._ids, who), b"") == who:
            pend.msg_type, pend.msg = msg_type, msg
            pend.event.set()


def _rank_of(ids: dict[int, bytes], who: bytes) -> int:
    return next((r for r, i in ids.items() if i == who), -1)


def _cause(value: str) -> FailureCause:
    try:
        return FailureCause(value)
    except ValueError:
        return FailureCause.CHECKSUM
