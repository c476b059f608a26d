"""What a consumer (decode side) is configured with: its identity, data path, streams and deadlines.

Guarantees: a `ConsumerConfig` that exists is valid (checked once, in `__post_init__`).
"""
from __future__ import annotations

import dataclasses

from connectors.zmq.paths.choice import DataPath
from connectors.zmq.paths.staging_ring import DEFAULT_STAGING, StagingShape


@dataclasses.dataclass(frozen=True)
class ConsumerConfig:
    engine_id: str
    secret: bytes
    compat_hash: str
    data_path: DataPath = DataPath.AUTO
    num_tcp_streams: int = 4
    num_shm_streams: int = 1
    handshake_timeout_s: float = 5.0
    transfer_timeout_s: float = 30.0
    io_timeout_s: float = 5.0
    heartbeat_interval_s: float = 5.0
    notify_done: bool = True  # tell the producer to release after each load
    # After a PULL, a stream thread polls for the answer without sleeping for up to this long:
    # lower one-block latency for a bounded burst of CPU per pull (0: always sleep).
    spin_us: int = 200
    staging: StagingShape = DEFAULT_STAGING  # how a CUDA pool's pages are staged (tcp)
    # cuda_ipc: check every page against the producer's digest (a device-to-host pass and a hash of each
    # page on this host: many times the cost of the device copy; the bytes never cross a wire on this path)
    device_checksums: bool = False

    def __post_init__(self) -> None:
        if not self.engine_id or len(self.secret) < 16:
            raise ValueError("engine_id must be non-empty and secret at least 16 bytes")
        if min(self.handshake_timeout_s, self.transfer_timeout_s, self.io_timeout_s, self.heartbeat_interval_s) <= 0:
            raise ValueError("timeouts and intervals must be positive")
        if self.num_tcp_streams < 1 or self.num_shm_streams < 1:
            raise ValueError("need at least one stream per data path")
        if not 0 <= self.spin_us <= 100_000:
            raise ValueError("spin_us must be in [0, 100000]")
        object.__setattr__(self, "data_path", DataPath(self.data_path))
