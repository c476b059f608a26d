"""What a load is: where it comes from, its handle while in flight, and its result."""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import TYPE_CHECKING

from connectors.metrics import FailureCause

if TYPE_CHECKING:
    from connectors.pull_stream import PullStream


@dataclasses.dataclass(frozen=True)
class RemoteAddr:
    """A producer's side channel, named by its engine id."""

    engine_id: str
    host: str
    port: int


@dataclasses.dataclass
class LoadResult:
    """How a load ended: `ok` (every page landed and verified) or the blocks not to trust."""

    request_id: str
    ok: bool
    invalid_block_ids: list[int]
    cause: FailureCause | None
    num_bytes: int
    seconds: float


class LoadHandle:
    """One load in flight; `done` is set once `result` is final (exactly once)."""

    def __init__(self, request_id, remote, remote_request_id, src, dst, deadline):
        self.request_id = request_id
        self.remote = remote
        self.remote_request_id = remote_request_id
        self.src, self.dst = src, dst
        self.deadline = deadline
        self.start = time.perf_counter()
        self.parts_left = 0
        self.streams: list[PullStream] = []
        self.bad: list[int] = []
        self.cause: FailureCause | None = None
        self.done = threading.Event()
        self.result: LoadResult | None = None
