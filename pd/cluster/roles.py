"""Who a worker is to the rest of the deployment: its role and where it listens.

`Role` is the serving role of a worker process (the connector's own
`connectors.zmq.connector.KVRole` says which side of a KV transfer it takes:
prefill -> producer, decode -> consumer, both -> no connector).
"""
from __future__ import annotations

import dataclasses
import enum


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"  # colocated: prefill and decode on the same worker

    def serves(self, wanted: Role) -> bool:
        return self is wanted or self is Role.BOTH


@dataclasses.dataclass(frozen=True)
class WorkerEndpoint:
    """Where a worker's internal HTTP API listens; fixed for the worker's life."""

    worker_id: str
    role: Role
    url: str
    node_id: str = ""
