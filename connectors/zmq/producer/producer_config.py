"""What a producer (prefill side) is configured with: identity, addresses, leases, limits, data paths.

Guarantees: a `ProducerConfig` that exists is valid (checked once, in `__post_init__`).
"""
from __future__ import annotations

import dataclasses

from connectors.zmq.paths.staging_ring import DEFAULT_STAGING, StagingShape


@dataclasses.dataclass(frozen=True)
class ProducerConfig:
    engine_id: str
    secret: bytes
    compat_hash: str
    host: str = "127.0.0.1"
    port: int = 0
    data_port: int = 0
    lease_s: float = 30.0
    io_timeout_s: float = 5.0  # longest wait for a peer in the middle of a frame or a credit
    handshake_timeout_s: float = 5.0
    max_streams: int = 64  # attached data streams
    max_preauth: int = 32  # data connections waiting for their ATTACH (oldest evicted)
    max_side_connections: int = 256  # ZMQ connections to the side channel (newest refused)
    max_sessions: int = 1024  # least recently used evicted
    max_watchers: int = 4096  # streamed requests WATCHed at once (a WATCH past it is refused)
    session_idle_s: float = 300.0  # consumers keep theirs alive with heartbeats
    shm_chunk_bytes: int = 8 * 1024 * 1024
    offer_shm: bool = True
    offer_device: bool = True  # export a CUDA pool to same-node consumers (the cuda_ipc data path)
    staging: StagingShape = DEFAULT_STAGING  # how a CUDA pool's pages are staged for tcp

    def __post_init__(self) -> None:
        if not self.engine_id:
            raise ValueError("engine_id must be non-empty")
        if len(self.secret) < 16:
            raise ValueError("secret must be at least 16 bytes (the side channel is always authenticated)")
        if min(self.lease_s, self.io_timeout_s, self.handshake_timeout_s, self.session_idle_s) <= 0:
            raise ValueError("timeouts must be positive")
        if min(self.max_streams, self.max_preauth, self.max_side_connections, self.max_sessions,
               self.max_watchers) < 1:
            raise ValueError("max_streams, max_preauth, max_side_connections, max_sessions and max_watchers "
                             "must be >= 1")
        if not (0 <= self.port < 65536 and 0 <= self.data_port < 65536):
            raise ValueError("ports must be in [0, 65535]")
