"""FaultLink: a man-in-the-middle between KV consumers and one producer that
injects the faults of a `FaultPlan` into real frames on real sockets.

The link listens on its own side-channel port and data port; a consumer is
pointed at it (the producer's advertised port is replaced by the link's).
Side-channel messages (ZMQ) are relayed per consumer identity; the producer's
WELCOME is rewritten to name the link's data port; data streams (TCP) are
relayed frame by frame, page bytes included, so each frame can be dropped,
delayed, duplicated or corrupted on the wire, the link can stall, or it (or
the process hosting it) can be killed at a named point.

Points: `connectors.links.fault_points.LINK_POINTS` (`side.<type>`, `data.<type>`,
`data.page_bytes`).

Guarantees: with no rule firing the link forwards every byte unchanged and in
order; every socket wait is bounded (the threads notice `close()` within
`_POLL_S`); a malformed frame is forwarded as is (the endpoints judge it).
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

import zmq

from connectors.zmq.control import framing, wire
from connectors.links.fault_points import LINK_POINTS  # noqa: F401 - re-exported: the points this link fires
from connectors.links.faults import FaultAction, FaultPlan
from connectors.zmq.control.wire import MalformedMessage, MsgType

logger = logging.getLogger(__name__)

_POLL_S = 0.1


class FaultLink:
    """Relays one producer's side channel and data streams through `plan`.

    `on_kill` runs when a `kill` rule fires (a worker passes a function that
    ends its process); without it the link severs every connection and stops
    relaying, which consumers see as the producer vanishing. Rules for points
    the link does not know (a worker's own points) never fire here.
    """

    def __init__(self, target_host: str, target_port: int, plan: FaultPlan, host: str = "127.0.0.1",
                 on_kill: Callable[[], None] | None = None):
        self.plan = plan
        self._target = (target_host, target_port)
        self._host = host
        self._on_kill = on_kill
        self._ctx: zmq.Context = zmq.Context.instance()
        self._stop = threading.Event()
        self._stall_until = 0.0
        self._data_target: tuple[str, int] | None = None
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.port = 0
        self.data_port = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> FaultLink:
        self._front = self._ctx.socket(zmq.ROUTER)
        self._front.setsockopt(zmq.LINGER, 0)
        self.port = self._front.bind_to_random_port(f"tcp://{self._host}")
        self._listener = socket.create_server((self._host, 0))
        self._listener.settimeout(_POLL_S)
        self.data_port = self._listener.getsockname()[1]
        for target, name in ((self._side_loop, "side"), (self._accept_loop, "accept")):
            t = threading.Thread(target=target, name=f"fault-link-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def close(self) -> None:
        self._stop.set()
        self._sever()
        for t in self._threads:
            t.join(timeout=2.0)

    def _sever(self) -> None:
        with self._conns_lock:
            conns, self._conns = list(self._conns), set()
        for s in conns:
            framing.close_quietly(s)

    # ------------------------------------------------------------------ fault application
    def _apply(self, point: str, frames: list[bytes]) -> list[bytes]:
        """The frames to forward for one frame (or frame + page bytes) at `point`."""
        self._wait_stall()
        rule = self.plan.fire(point)
        if rule is None:
            return frames
        logger.warning("fault injected: %s at %s", rule.action.value, point)
        if rule.action is FaultAction.DROP:
            return []
        if rule.action is FaultAction.DELAY:
            self._sleep(rule.seconds)
            return frames
        if rule.action is FaultAction.DUP:
            return frames + frames
        if rule.action is FaultAction.CORRUPT:
            return [_flip(frames[-1])] if len(frames) == 1 else frames[:-1] + [_flip(frames[-1])]
        if rule.action is FaultAction.STALL:
            self._stall_until = time.monotonic() + rule.seconds
            self._wait_stall()
            return frames
        # KILL
        if self._on_kill is not None:
            self._on_kill()
        self._stop.set()
        self._sever()
        return []

    def _wait_stall(self) -> None:
        left = self._stall_until - time.monotonic()
        if left > 0:
            self._sleep(left)

    def _sleep(self, seconds: float) -> None:
        self._stop.wait(seconds)

    # ------------------------------------------------------------------ side channel (ZMQ)
    def _side_loop(self) -> None:
        backs: dict[bytes, zmq.Socket] = {}
        idents: dict[zmq.Socket, bytes] = {}
        poller = zmq.Poller()
        poller.register(self._front, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(int(_POLL_S * 1000)):
                    if sock is self._front:
                        frames = self._front.recv_multipart()
                        if len(frames) != 2:
                            continue
                        ident, payload = frames
                        back = backs.get(ident)
                        if back is None:
                            back = self._ctx.socket(zmq.DEALER)
                            back.setsockopt(zmq.LINGER, 0)
                            back.connect(f"tcp://{self._target[0]}:{self._target[1]}")
                            backs[ident], idents[back] = back, ident
                            poller.register(back, zmq.POLLIN)
                        for out in self._apply(_side_point(payload), [payload]):
                            back.send(out, zmq.NOBLOCK)
                    else:
                        payload = self._rewrite_welcome(sock.recv())
                        for out in self._apply(_side_point(payload), [payload]):
                            self._front.send_multipart([idents[sock], out], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if not self._stop.is_set():
                logger.warning("fault link side channel stopped: %s", e)
        finally:
            for back in backs.values():
                back.close(linger=0)
            self._front.close(linger=0)

    def _rewrite_welcome(self, payload: bytes) -> bytes:
        try:
            msg_type, msg = wire.decode(payload)
        except MalformedMessage:
            return payload
        if msg_type is not MsgType.WELCOME:
            return payload
        self._data_target = (self._target[0], msg["data_port"])
        fields = {k: v for k, v in msg.items() if k not in ("v", "t")}
        fields["data_port"] = self.data_port
        return wire.encode(MsgType.WELCOME, **fields)

    # ------------------------------------------------------------------ data streams (TCP)
    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                down, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            if self._data_target is None:
                framing.close_quietly(down)
                continue
            try:
                up = socket.create_connection(self._data_target, timeout=5.0)
            except OSError:
                framing.close_quietly(down)
                continue
            with self._conns_lock:
                self._conns.update((down, up))
            state = {"mode": "tcp", "page_bytes": 0}
            for src, dst, name in ((down, up, "c2p"), (up, down, "p2c")):
                threading.Thread(target=self._pump, args=(src, dst, name, state), daemon=True,
                                 name=f"fault-link-{name}").start()
        framing.close_quietly(self._listener)

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str, state: dict) -> None:
        try:
            src.settimeout(_POLL_S)
            while not self._stop.is_set():
                head = self._read(src, 4)
                body = self._read(src, int.from_bytes(head, "big"))
                frames, point = [head + body], "data.unknown"
                try:
                    msg_type, msg = wire.decode(body)
                    point = f"data.{msg_type.value}"
                    if msg_type is MsgType.ATTACH:
                        state["mode"] = msg["mode"]
                    elif msg_type is MsgType.PAGES and state["mode"] == "tcp":
                        frames = self._apply("data.pages", frames)
                        pages = self._read(src, len(msg["digests"]) * msg["page_bytes"])
                        frames += self._apply("data.page_bytes", [pages]) if pages else []
                        point = ""
                except MalformedMessage:
                    pass
                if point:
                    frames = self._apply(point, frames)
                for f in frames:
                    dst.sendall(f)
        except (ConnectionError, OSError) as e:
            logger.debug("fault link %s pump ended: %s", direction, e)
        finally:
            framing.close_quietly(src)
            framing.close_quietly(dst)

    def _read(self, sock: socket.socket, n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            if self._stop.is_set():
                raise ConnectionError("fault link closed")
            try:
                r = sock.recv_into(view[got:], n - got)
            except TimeoutError:
                continue
            if r == 0:
                raise ConnectionError("peer closed")
            got += r
        return bytes(buf)


def _side_point(payload: bytes) -> str:
    try:
        msg_type, _ = wire.decode(payload)
    except MalformedMessage:
        return "side.unknown"
    return f"side.{msg_type.value}"


def _flip(frame: bytes) -> bytes:
    """The frame with its middle byte inverted (inside the page for page bytes,
    inside the msgpack body for control frames)."""
    b = bytearray(frame)
    i = len(b) // 2 if len(b) > 4 else len(b) - 1
    b[i] ^= 0xFF
    return bytes(b)

