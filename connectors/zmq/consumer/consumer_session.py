"""The consumer's side of one producer session: its ZMQ socket, handshake state and data path.

`Consumer` (`consumer.py`) keeps one `RemoteSession` per remote engine, on its control
thread only. What a session guarantees: a side socket whose identity stays fixed
across reconnects (the producer binds the session to it), frames capped at
`wire.MAX_CONTROL_BYTES`, and a data path chosen once, from this side's config
and what the producer's WELCOME offers (`data_mode`).
"""
from __future__ import annotations

import enum
import logging
import secrets

import zmq

from connectors.zmq.control import handshake as hs
from connectors.zmq.control import wire
from connectors.zmq.consumer.consumer_config import ConsumerConfig, DataPath
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


def data_mode(cfg: ConsumerConfig, welcome: dict, host_id: str, pool_device: str, engine_id: str) -> tuple[str, int]:
    """The data streams' mode ("cuda_ipc", "map", "shm" or "tcp") and how many to open, given the WELCOME.

    The device path is tried when the producer is on this node and either this side asked for it
    (`cuda_ipc`) or, with `auto`, both pools are on GPUs (the WELCOME's `device` says the producer's
    is); a stream that then cannot map the producer's pool falls back to shm (`PullStream`)."""
    if welcome["host_id"] == host_id:
        offered = welcome.get("device") is True
        if cfg.data_path is DataPath.CUDA_IPC or (cfg.data_path is DataPath.AUTO and offered and pool_device == "cuda"):
            return "cuda_ipc", cfg.num_shm_streams
    elif cfg.data_path is DataPath.CUDA_IPC:
        logger.warning("KV producer %s is not on this node: no device path; using tcp", engine_id)
    same_host = welcome["host_id"] == host_id and welcome["shm"]
    wants_shm = cfg.data_path in (DataPath.SHM, DataPath.SHM_STAGED)
    use_shm = wants_shm or (cfg.data_path is DataPath.AUTO and same_host)
    if wants_shm and not same_host:
        logger.warning("KV producer %s is not on this host; using tcp", engine_id)
        use_shm = False
    map_pool = cfg.data_path is not DataPath.SHM_STAGED and pool_device == "cpu"
    mode = ("map" if map_pool else "shm") if use_shm else "tcp"
    return mode, cfg.num_shm_streams if use_shm else cfg.num_tcp_streams
