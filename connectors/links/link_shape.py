"""The shape of an emulated link: bandwidth each way, one-way latency, and the sizes derived from them.

Pure (no sockets, no threads), so a config can carry a shape without loading the relay
(`connectors.links.emulated_link`).
"""
from __future__ import annotations

import dataclasses
import math

_CHUNK_S = 0.002  # a chunk is about this much link time: the pacing granularity
_MIN_CHUNK, _MAX_CHUNK = 1024, 256 * 1024
_MAX_BUFFER = 64 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class LinkShape:
    """A link's bandwidth (each way, megabits per second) and one-way latency."""

    bandwidth_mbps: float
    latency_ms: float = 0.0
    stall_timeout_s: float = 30.0  # a destination that takes no byte this long is dropped

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bandwidth_mbps) and self.bandwidth_mbps > 0):
            raise ValueError(f"bandwidth_mbps must be a positive number, got {self.bandwidth_mbps}")
        if not (math.isfinite(self.latency_ms) and 0 <= self.latency_ms <= 10_000):
            raise ValueError(f"latency_ms must be in [0, 10000], got {self.latency_ms}")
        if not (math.isfinite(self.stall_timeout_s) and self.stall_timeout_s > 0):
            raise ValueError(f"stall_timeout_s must be positive, got {self.stall_timeout_s}")

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_mbps * 1e6 / 8

    @property
    def latency_s(self) -> float:
        return self.latency_ms / 1000

    @property
    def chunk_bytes(self) -> int:
        """The most read at once (about `_CHUNK_S` of link time), also the pacer's burst."""
        return int(min(_MAX_CHUNK, max(_MIN_CHUNK, self.bytes_per_s * _CHUNK_S)))

    @property
    def buffer_bytes(self) -> int:
        """Bytes in flight per direction of a connection: twice the bandwidth-delay product
        (so the link runs full), at least a few chunks, at most `_MAX_BUFFER`."""
        bdp = self.bytes_per_s * self.latency_s
        return int(min(_MAX_BUFFER, max(8 * self.chunk_bytes, 2 * bdp + 2 * self.chunk_bytes)))
