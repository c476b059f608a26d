"""What an HTTP client may cost an aiohttp server: the router's public API and each worker's
internal API both serve through a `ConnectionGuard`.

Guarantees (settings: `pd.cluster.config.ConnectionsSection`, read through `GuardLimits`):
- a request head must arrive whole within `header_timeout_s` of its first byte, else the
  connection is cut (a client trickling its headers holds nothing for long);
- a request body must arrive whole within `body_timeout_s` of its head, else the request gets
  408 and its connection is cut (the guard's middleware reads the body; handlers then find it
  in `await request.read()` / `request.json()`, not in `request.content`);
- a connection with no request in progress and no byte of a next one closes after
  `keepalive_timeout_s`; one whose peer stopped reading our answers (its writes paused) is cut
  after `body_timeout_s`, busy or not;
- a body is read only for a request that takes one (not for GET/HEAD/OPTIONS, nor for an
  unknown route): otherwise it is answered at once (aiohttp discards the rest of it for at most
  its 10 s lingering time);
- at most `max_connections` connections are open (never more than half the process's fd soft
  limit, so the process always has fds for its own work) and at most `max_connections_per_peer`
  from one address (for IPv6, one /64). A connection past either cap first closes the least recently used
  connection that has no request in progress; when every one is busy it is refused (closed at
  once). A request in progress is never cut by the caps, and a new connection is the last one
  chosen, so a good client gets in past any number of idle or trickling ones.

Each timeout is enforced within one tick (a quarter of the shortest timeout, at most 1 s) of
its expiry, by one task per guard that scans its connections; nothing runs per byte beyond a
clock read. Figures: `figures()`.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import resource
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

from aiohttp import web

logger = logging.getLogger(__name__)

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@runtime_checkable
class StreamTransport(Protocol):
    """What the guard uses of a connection's transport. asyncio's own transports have it, and so
    do other loops' (uvloop's `TCPTransport`, which Ray's async actors run on wherever uvloop is
    installed, subclasses no asyncio class): the guard relies on these methods, never on a type."""

    def get_extra_info(self, name: str, default: Any = None) -> Any: ...

    def get_write_buffer_size(self) -> int: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class GuardLimits:
    """One server's limits; `from_section` reads them from the validated config section."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keepalive_timeout_s: float = 15.0
    max_connections: int = 8192
    max_connections_per_peer: int = 4096

    @classmethod
    def from_section(cls, section: Any, worker: bool = False) -> GuardLimits:
        """`section` is a `ConnectionsSection`; `worker`: the worker API's keep-alive."""
        return cls(header_timeout_s=section.header_timeout_s, body_timeout_s=section.body_timeout_s,
                   keepalive_timeout_s=section.worker_keepalive_timeout_s if worker else section.keepalive_timeout_s,
                   max_connections=section.max_connections, max_connections_per_peer=section.peer_cap)

    @property
    def tick_s(self) -> float:
        return min(1.0, max(0.05, min(self.header_timeout_s, self.keepalive_timeout_s) / 4))


def fd_soft_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def peer_key(peername: object) -> str:
    """Whom the per-peer cap counts: an IPv4 address, or an IPv6 address's /64 (one host commonly holds a
    whole /64, so counting single IPv6 addresses would let one client open connections without limit)."""
    host = str(peername[0]) if isinstance(peername, tuple) and peername else str(peername)
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host  # a Unix socket path or an unknown family: the name itself
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class _Conn:
    """One accepted connection's state, as the guard sees it."""

    __slots__ = ("transport", "peer", "idle_since", "head_started_at", "num_active", "doomed", "closed",
                 "paused_since")

    def __init__(self, transport: StreamTransport, peer: str, now: float) -> None:
        self.transport = transport
        self.peer = peer
        self.idle_since = now  # the accept, or the end of the last request
        self.head_started_at: float | None = None  # first byte of the next request's head
        self.num_active = 0
        self.doomed = False  # cut at the next tick (a 408 was answered)
        self.closed = False
        self.paused_since: float | None = None  # the peer stopped reading what we write


_REFUSED = asyncio.Protocol()  # the inner protocol of a refused connection: receives nothing


class _GuardedProtocol(asyncio.Protocol):
    """Sits between the transport and aiohttp's RequestHandler: admits the connection, notes
    when bytes of a request head arrive, and forwards everything."""

    def __init__(self, guard: ConnectionGuard, make_inner: Callable[[], asyncio.Protocol]) -> None:
        self._guard = guard
        self._make_inner = make_inner
        self._inner: asyncio.Protocol = _REFUSED
        self._conn: _Conn | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not isinstance(transport, StreamTransport):  # not a stream (no loop's TCP server makes one)
            logger.error("%s: refused a connection on a %s, which is not a stream transport", self._guard.name,
                         type(transport).__name__)
            transport.close()
            return
        self._conn = self._guard._admit(transport)
        if self._conn is not None:  # only once admitted: a refused connection costs no request handler
            self._inner = self._make_inner()
            self._guard._by_handler[id(self._inner)] = self._conn
            self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        conn = self._conn
        if conn is None:
            return
        if conn.num_active == 0 and conn.head_started_at is None:
            conn.head_started_at = time.monotonic()
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._conn is not None else None

    def pause_writing(self) -> None:
        if self._conn is not None:
            self._conn.paused_since = time.monotonic()
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._conn is not None:
            self._conn.paused_since = None
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._conn is not None:
            self._guard._forget(self._conn, self._inner)
            self._inner.connection_lost(exc)


class ConnectionGuard:
    """Connection accounting, timeouts and caps of one aiohttp server (see the module doc).
    Wire it with `middleware` (after any auth middleware: a refused request's body is never
    read), `runner_options()` and `GuardedSite`."""

    def __init__(self, limits: GuardLimits, name: str = "http") -> None:
        self.limits = limits
        self.name = name
        soft = fd_soft_limit()
        self.max_connections = max(1, min(limits.max_connections, soft // 2))
        self.max_per_peer = max(1, min(limits.max_connections_per_peer, self.max_connections))
        if self.max_connections < limits.max_connections:
            logger.info("%s: connection cap %d (half the fd limit %d), not %d", name, self.max_connections,
                        soft, limits.max_connections)
        # insertion order is least recently used first: a connection moves to the end when it goes idle
        self._conns: dict[_Conn, None] = {}
        self._by_peer: dict[str, dict[_Conn, None]] = {}
        self._by_handler: dict[int, _Conn] = {}  # id(aiohttp RequestHandler) -> its connection
        self._task: asyncio.Task | None = None
        self._handlers: set[asyncio.Task] = set()  # requests in progress
        self._draining = False
        self.counts = {"accepted": 0, "refused": 0, "evicted": 0, "idle_closed": 0, "header_timeouts": 0,
                       "body_timeouts": 0, "bodies_cut": 0, "write_timeouts": 0}

    # -- wiring -----------------------------------------------------------
    def runner_options(self) -> dict[str, Any]:
        """AppRunner keyword arguments: aiohttp's own idle timer as a backstop behind the guard's."""
        lim = self.limits
        return {"keepalive_timeout": max(lim.keepalive_timeout_s, lim.header_timeout_s) + 2 * lim.tick_s}

    def protocol_factory(self, server: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return lambda: _GuardedProtocol(self, server)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._reap_loop(), name=f"{self.name}-conn-guard")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def figures(self) -> dict[str, int]:
        return {"open": len(self._conns), "peers": len(self._by_peer), "max_connections": self.max_connections,
                "max_connections_per_peer": self.max_per_peer, **self.counts}

    # -- middleware -------------------------------------------------------
    async def drain(self, timeout_s: float, grace_s: float = 1.0) -> int:
        """For shutdown, once the listening socket is closed: new requests get 503; the ones in
        progress get up to `timeout_s` to finish, then are cancelled (a streaming handler ends
        its stream on cancellation) and get `grace_s` more. Returns how many were cancelled."""
        self._draining = True
        deadline = time.monotonic() + timeout_s
        while self._handlers and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = [task for task in self._handlers if not task.done()]
        for task in left:
            task.cancel()
        if left:
            await asyncio.wait(left, timeout=grace_s)
        return len(left)

    @web.middleware
    async def middleware(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        if self._draining:
            raise web.HTTPServiceUnavailable(reason="shutting down")
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        conn = self._by_handler.get(id(request.protocol))
        if conn is not None:
            conn.num_active += 1
            conn.head_started_at = None
        try:
            if request.body_exists and (request.method in ("GET", "HEAD", "OPTIONS")
                                        or request.match_info.http_exception is not None):
                # A body nobody takes is never read here (an open route must not hold a busy slot for a
                # trickled body): answered at once. aiohttp then discards what is left of it for at most
                # its lingering time (10 s) before the next request, or closes the connection.
                if request.match_info.http_exception is not None:
                    raise request.match_info.http_exception
                raise web.HTTPBadRequest(reason=f"a {request.method} request takes no body")
            if request.body_exists:
                try:
                    await asyncio.wait_for(request.read(), self.limits.body_timeout_s)
                except asyncio.TimeoutError:
                    self.counts["body_timeouts"] += 1
                    if conn is not None:
                        conn.doomed = True
                    raise web.HTTPRequestTimeout(
                        reason=f"request body not received within {self.limits.body_timeout_s:g} s") from None
                except ConnectionError:  # the client left mid-body: nobody reads the answer; no traceback
                    self.counts["bodies_cut"] += 1
                    raise web.HTTPBadRequest(reason="the client closed the connection before its body arrived") \
                        from None
            return await handler(request)
        finally:
            self._handlers.discard(task)  # type: ignore[arg-type]
            if conn is not None:
                conn.num_active -= 1
                if conn.num_active == 0 and not conn.closed:
                    self._touch(conn)

    # -- connection life --------------------------------------------------
    def _admit(self, transport: StreamTransport) -> _Conn | None:
        peer = peer_key(transport.get_extra_info("peername"))
        peer_conns = self._by_peer.get(peer)
        if peer_conns is not None and len(peer_conns) >= self.max_per_peer:
            if not self._evict_one(peer_conns):
                self._refuse(transport)
                return None
        if len(self._conns) >= self.max_connections:
            if not self._evict_one(self._conns):
                self._refuse(transport)
                return None
        conn = _Conn(transport, peer, time.monotonic())
        self._conns[conn] = None
        self._by_peer.setdefault(peer, {})[conn] = None
        self.counts["accepted"] += 1
        return conn

    def _refuse(self, transport: StreamTransport) -> None:
        self.counts["refused"] += 1
        transport.abort()

    def _evict_one(self, conns: dict[_Conn, None]) -> bool:
        """Closes the least recently used connection of `conns` with no request in progress."""
        for conn in conns:
            if conn.num_active == 0:
                self.counts["evicted"] += 1
                self._close(conn, abort=True)
                return True
        return False

    def _touch(self, conn: _Conn) -> None:
        """`conn` went idle: it becomes the most recently used."""
        conn.idle_since = time.monotonic()
        for conns in (self._conns, self._by_peer.get(conn.peer)):
            if conns is not None and conn in conns:
                del conns[conn]
                conns[conn] = None

    def _close(self, conn: _Conn, abort: bool) -> None:
        self._drop(conn)
        # (a graceful close waits for the write buffer to drain: from a peer that never reads, forever,
        # holding the fd outside the counts)
        if abort or conn.transport.get_write_buffer_size() > 0:
            conn.transport.abort()
        else:
            conn.transport.close()

    def _drop(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._conns.pop(conn, None)
        peer_conns = self._by_peer.get(conn.peer)
        if peer_conns is not None:
            peer_conns.pop(conn, None)
            if not peer_conns:
                del self._by_peer[conn.peer]

    def _forget(self, conn: _Conn, inner: asyncio.Protocol) -> None:
        self._drop(conn)
        self._by_handler.pop(id(inner), None)

    # -- timeouts ---------------------------------------------------------
    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self.limits.tick_s)
            try:
                self.reap()
            except Exception:  # noqa: BLE001 - the guard must outlive one bad pass
                logger.exception("%s: connection reaping failed", self.name)

    def reap(self) -> None:
        """Closes every connection past its header or keep-alive timeout (and those answered 408)."""
        now, lim = time.monotonic(), self.limits
        for conn in list(self._conns):
            if conn.paused_since is not None and now - conn.paused_since > lim.body_timeout_s:
                self.counts["write_timeouts"] += 1  # a peer that stopped reading, busy or not: a stream nobody reads
                self._close(conn, abort=True)
            elif conn.doomed and conn.num_active == 0:
                self._close(conn, abort=True)
            elif conn.num_active:
                continue
            elif conn.head_started_at is not None:
                if now - conn.head_started_at > lim.header_timeout_s:
                    self.counts["header_timeouts"] += 1
                    self._close(conn, abort=True)
            elif now - conn.idle_since > lim.keepalive_timeout_s:
                self.counts["idle_closed"] += 1
                self._close(conn, abort=False)


class GuardedSite(web.TCPSite):
    """A TCPSite whose connections pass through `guard` (and whose backlog is deep enough that
    a good client's SYN is not dropped while junk connections are accepted and cut)."""

    def __init__(self, runner: web.BaseRunner, guard: ConnectionGuard, host: str | None, port: int,
                 backlog: int = 1024) -> None:
        super().__init__(runner, host, port, backlog=backlog)
        self._guard = guard

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        server = self._runner.server
        assert server is not None, "runner.setup() must run first"
        self._guard.start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._guard.protocol_factory(server), self._host, self._port,
                                                backlog=self._backlog)
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port

    async def stop(self) -> None:
        await super().stop()
        await self._guard.stop()
