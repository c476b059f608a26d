"""The engine's mutable per-request state beside a kvcache Request: sampling, load and timing."""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from connectors.metrics import FailureCause
from pd.engine.outputs import RequestTiming
from pd.engine.sample.params import SamplingParams


@dataclasses.dataclass(eq=False)
class RequestState:
    """Engine-side companions of a kvcache Request (which has fixed slots)."""

    request: Any  # kvcache.Request
    params: SamplingParams  # the scheduler reads its stop rules; the runner gets it once (SchedulerOutput)
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
    # the block ids (per KV cache group) its latest chunk carried: the scheduler reuses them while the request
    # runs and gains no block (set at each admission, cleared when its blocks are dropped)
    block_ids: tuple[list[int], ...] | None = None
    # its stop rule, set by the scheduler as it accepts the request: a sampled token in `stop_token_ids` (its
    # params' stop ids, and the EOS id unless ignore_eos) stops it; reaching `max_num_tokens` tokens (prompt
    # plus max_tokens, at most the model's length) ends it for length
    stop_token_ids: frozenset[int] = frozenset()
    max_num_tokens: int = 0

    def restart_compute(self) -> None:
        """Its computed prompt tokens were dropped: the compute it reports starts again at its next
        admission, with a fresh batch count (the dropped work is no sample of its prompt's cost)."""
        self.block_ids = None
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
