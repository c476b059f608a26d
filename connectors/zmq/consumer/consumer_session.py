"""The consumer's side of one producer session: its ZMQ socket, handshake state and data path.

`Consumer` (`consumer.py`) keeps one `RemoteSession` per remote engine, on its control
thread only. What a session guarantees: a side socket whose identity stays fixed
across reconnects (the producer binds the session to it), frames capped at
`wire.MAX_CONTROL_BYTES`, and a data path chosen once, from this side's config
and what the producer's WELCOME offers (`paths.choice.choose_path`).
"""
from __future__ import annotations

import enum
import logging
import secrets

import zmq

from connectors.zmq.control import handshake as hs
from connectors.zmq.control import wire
from connectors.zmq.consumer.loads import LoadHandle, RemoteAddr
from connectors.zmq.consumer.pull_stream import PullStream
from connectors.zmq.control.session import ClientSession

logger = logging.getLogger(__name__)


class SessionState(enum.Enum):
    HANDSHAKING = 1
    READY = 2


class RemoteSession:
    """One producer, as the consumer's control thread sees it: loads and notices wait in `pending*`
    until the handshake is READY, then go out on `sock` and the session's data `streams`."""

    def __init__(self, remote: RemoteAddr, sock: zmq.Socket, deadline: float):
        self.remote = remote
        self.sock = sock
        self.state: SessionState | None = SessionState.HANDSHAKING  # None once closed
        self.deadline = deadline
        self.handshake: hs.ConsumerHandshake | None = None
        self.client: ClientSession | None = None  # after WELCOME: signs what this session sends
        self.streams: list[PullStream] = []
        self.pending: list[LoadHandle] = []
        self.pending_done: list[str] = []
        self.pending_watch: list[str] = []  # streamed loads' remote request ids, WATCHed once READY
        self.next_stream = 0


def side_socket(ctx: zmq.Context, remote: RemoteAddr) -> zmq.Socket:
    """A DEALER connected to the producer's side channel."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_CONTROL_BYTES)
    # A fixed identity survives reconnects (the producer binds the session to it; ROUTER_HANDOVER)
    sock.setsockopt(zmq.ROUTING_ID, b"c" + secrets.token_bytes(15))  # (a leading zero byte is reserved)
    sock.connect(f"tcp://{remote.host}:{remote.port}")
    return sock
