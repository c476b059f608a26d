"""Plain data passed between the scheduler, the runner and the engine's callers."""
from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any

import torch

from connectors.base import ConnectorMetadata
from connectors.metrics import FailureCause
from pd.engine.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
    """Tokens [start, start + len(token_ids)) of one request, computed this step."""

    request_id: str
    token_ids: list[int]
    start: int
    block_ids: tuple[list[int], ...]
    needs_logits: bool  # True when the chunk reaches the end of the sequence


class FinishReason(str, enum.Enum):
    """Why a request ended (the value is what callers see in JSON)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request (new tokens and/or its end)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None
    error_cause: FailureCause | None = None  # set when a KV load failure ended the request
    num_cached_tokens: int = 0  # prompt tokens found in this engine's prefix cache (set on the final output)
    timing: RequestTiming | None = None  # on the request's first output with a token only


@dataclasses.dataclass(frozen=True)
class RequestTiming:
    """Where a request's time to first token went on this engine (seconds, perf_counter):
    waiting for admission, loading its prompt KV from a remote engine (0 when nothing was
    loaded), then computing until its first token. Token counts say what was computed and
    what was loaded, and how many tokens of other requests shared its steps (the batch), so a
    router can fit per-token costs from them: `compute_s` is the time of steps that computed
    `num_computed_tokens + num_batched_tokens` tokens."""

    queue_s: float
    load_s: float
    compute_s: float
    num_computed_tokens: int  # prompt tokens this engine computed (not cached, not loaded)
    num_loaded_tokens: int  # prompt tokens whose KV arrived through the connector
    num_loaded_blocks: int
    num_batched_tokens: int = 0  # other requests' tokens in the steps that computed this one's prompt

    def as_dict(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class PoolAudit:
    """The KV pool between steps: `all_free` when no block is held by anyone, `consistent`
    when the pool's bookkeeping checks out; `detail` holds the failed checks' messages."""

    all_free: bool
    consistent: bool
    detail: str = ""


@dataclasses.dataclass(eq=False)
class RequestState:
    """Engine-side companions of a kvcache Request (which has fixed slots)."""

    request: Any  # kvcache.Request
    params: SamplingParams
    generator: torch.Generator | None
    skip_connector_load: bool = False  # set once a remote load failed: compute locally from then on
    load_failed: bool = False
    load_failure: FailureCause | None = None  # why, when the connector said
    num_external_tokens: int = 0  # tokens of the current async load
    awaiting_recv: bool = False  # finished while an async load may still be writing its blocks
    awaiting_send: bool = False  # finished, blocks kept until the connector reports them sent
    num_cached_tokens: int | None = None  # local prefix-cache hit of the first admission
    arrived_s: float = dataclasses.field(default_factory=time.perf_counter)
    admitted_s: float | None = None  # first admission (a prefix lookup)
    load_started_s: float | None = None  # an async load's start, and its end once reported
    load_ended_s: float | None = None
    num_loaded_tokens: int = 0
    num_loaded_blocks: int = 0
    timed: bool = False  # the first token's output carried the timing
    num_batched_tokens: int = 0  # other requests' tokens in the steps of this one's prompt, to its first token
    compute_restarted_s: float | None = None  # re-admitted after its computed tokens were dropped
    restart_pending: bool = False  # dropped (preempted, or a failed load recomputed), not re-admitted yet

    def restart_compute(self) -> None:
        """Its computed prompt tokens were dropped: the compute it reports starts again at its next
        admission, with a fresh batch count (the dropped work is no sample of its prompt's cost)."""
        if not self.timed:
            self.num_batched_tokens = 0
            self.restart_pending = True

    def mark_admitted(self) -> None:
        """Entered the running set (after a restart: the compute starts here)."""
        if self.restart_pending:
            self.compute_restarted_s, self.restart_pending = time.perf_counter(), False

    def take_timing(self, num_prompt_tokens: int) -> RequestTiming | None:
        """The timing, once: on the first output with a token (None after, or if never admitted)."""
        if self.timed or self.admitted_s is None:
            return None
        self.timed = True
        now = time.perf_counter()
        load_s = 0.0
        compute_from = self.admitted_s
        if self.load_started_s is not None and self.load_ended_s is not None:
            load_s = self.load_ended_s - self.load_started_s
            compute_from = self.load_ended_s
        if self.compute_restarted_s is not None:
            compute_from = max(compute_from, self.compute_restarted_s)
        num_computed = max(1, num_prompt_tokens - (self.num_cached_tokens or 0) - self.num_loaded_tokens)
        return RequestTiming(self.admitted_s - self.arrived_s, load_s, now - compute_from, num_computed,
                             self.num_loaded_tokens, self.num_loaded_blocks, self.num_batched_tokens)


@dataclasses.dataclass
class SchedulerOutput:
    """One step's work: chunks to compute, in batch order, plus the connector's metadata."""

    chunks: list[ScheduledChunk]
    connector_metadata: ConnectorMetadata | None = None
    num_preempted: int = 0

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)
