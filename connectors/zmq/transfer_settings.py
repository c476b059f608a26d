"""The user-facing KV transfer settings, and the one place the connector's timeouts derive from them.

A deployment exposes a handful of transfer knobs (`TransferSettings`); the
ZMQ connector has more (handshake, per-I/O, whole-transfer timeouts, the
heartbeat interval). `connector_config` maps the few onto the many, so every
derived timeout is declared here once, not by each caller.

This module imports neither zmq nor torch until `connector_config` is called.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    from connectors.links.link_shape import LinkShape
    from connectors.zmq.connector import KVRole, ZmqConnectorConfig

# A handshake or a single socket I/O that takes longer than this is a dead peer, however long
# a whole transfer may take: waiting longer only delays the fallback to local recompute.
MAX_STEP_TIMEOUT_S = 5.0
HEARTBEATS_PER_LEASE = 6  # a consumer renews its lease this many times per lease period
# what a deployment may choose (connectors.zmq.consumer.consumer_config.DataPath)
DataPathName = Literal["auto", "tcp", "shm", "cuda_ipc"]
DATA_PATHS = get_args(DataPathName)
StreamingName = Literal["off", "chunk", "layer"]  # KV streaming (connectors.zmq.streaming.publisher, .layer_slices)
STREAMING_MODES = get_args(StreamingName)


@dataclasses.dataclass(frozen=True)
class TransferSettings:
    """What a deployment sets: side-channel port, the whole-transfer timeout, the producer's
    lease on blocks a consumer has not pulled yet, the data path, and (tests and benchmarks
    only) an emulated link in front of each producer."""

    port: int = 0  # 0: any free port (reported in kv_transfer_params)
    timeout_s: float = 10.0
    lease_s: float = 30.0
    data_path: DataPathName = "auto"  # auto: cuda_ipc between GPU pools of one node, shm on one host, else tcp
    emulated_link: LinkShape | None = None  # a producer's consumers reach it through this link (tcp)
    streaming: StreamingName = "off"  # chunk: P publishes a prompt's blocks after each prefill step
    stream_chunk_tokens: int = 256  # a streamed prefill's largest step (tokens)
    stream_layer_parts: int = 6  # layer: most slices per page (the largest divisor of its layers not above)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be a TCP port (0 = any free), got {self.port}")
        if self.timeout_s <= 0 or self.lease_s <= 0:
            raise ValueError("timeout_s and lease_s must be positive")
        if self.data_path not in DATA_PATHS:
            raise ValueError(f"data_path must be one of {DATA_PATHS}, got {self.data_path!r}")
        if self.streaming not in STREAMING_MODES or self.stream_chunk_tokens < 1:
            raise ValueError(f"streaming must be one of {STREAMING_MODES} and stream_chunk_tokens >= 1")
        if not 1 <= self.stream_layer_parts <= 64:
            raise ValueError(f"stream_layer_parts must be in [1, 64], got {self.stream_layer_parts}")
        if self.emulated_link is not None and self.data_path in ("shm", "cuda_ipc"):
            raise ValueError(f"an emulated link carries tcp only: data_path must be 'auto' or 'tcp', "
                             f"not {self.data_path!r}")

    @property
    def step_timeout_s(self) -> float:
        """Handshake and single-I/O timeout: never longer than the whole transfer."""
        return min(MAX_STEP_TIMEOUT_S, self.timeout_s)

    def connector_config(self, *, engine_id: str, role: KVRole, secret: str | bytes, model_id: str,
                         host: str) -> ZmqConnectorConfig:
        """The ZMQ connector's full config for one engine of the deployment."""
        from connectors.zmq.consumer.consumer_config import DataPath
        from connectors.zmq.connector import ZmqConnectorConfig

        return ZmqConnectorConfig(
            engine_id=engine_id, role=role, secret=secret.encode() if isinstance(secret, str) else secret,
            model_id=model_id, host=host, port=self.port,
            lease_s=self.lease_s, heartbeat_interval_s=self.lease_s / HEARTBEATS_PER_LEASE,
            handshake_timeout_s=self.step_timeout_s, transfer_timeout_s=self.timeout_s,
            io_timeout_s=self.step_timeout_s, data_path=DataPath(self.data_path), emulated_link=self.emulated_link,
            streaming=self.streaming, stream_chunk_tokens=self.stream_chunk_tokens,
            stream_layer_parts=self.stream_layer_parts)
