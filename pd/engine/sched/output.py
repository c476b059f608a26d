"""One step's plan, from the scheduler to the runner: the chunks to compute, in batch order, the
requests the runner meets for the first time (with their sampling params) or sees no more, and what the
connector seam (runner/kv_connector.py) hands the connector for the step."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

from connectors.base import ConnectorMetadata
from pd.engine.sample.params import SamplingParams
from pd.engine.sched.request_state import RequestState

if TYPE_CHECKING:
    from kvcache import Request

# One streamed prefill's part in a step, as the connector's `layer_hook` takes it: (request, its block ids
# per KV cache group, tokens computed once the step ran, whether the step ends its prompt).
StreamStep = tuple["Request", tuple[list[int], ...], int, bool]
_new_object = object.__new__


@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
    """Tokens [start, start + len(token_ids)) of one request, computed this step."""

    request_id: str
    token_ids: list[int]
    start: int
    block_ids: tuple[list[int], ...]
    needs_logits: bool  # True when the chunk reaches the end of the sequence

    @classmethod
    def of(cls, request_id: str, token_ids: list[int], start: int, block_ids: tuple[list[int], ...],
           needs_logits: bool) -> ScheduledChunk:
        """`ScheduledChunk(...)`, the same frozen value, filled in one pass (half the frozen constructor's
        cost: the scheduler makes one per scheduled request per step)."""
        chunk = _new_object(cls)
        d = chunk.__dict__
        d["request_id"] = request_id
        d["token_ids"] = token_ids
        d["start"] = start
        d["block_ids"] = block_ids
        d["needs_logits"] = needs_logits
        return chunk

    def written_block_ids(self, block_size: int) -> set[int]:
        """The blocks this chunk writes into (from its first position's block on; never the null block 0).
        Blocks before it hold KV computed earlier, and may be shared prefix hits."""
        first = self.start // block_size
        return {b for ids in self.block_ids for b in ids[first:] if b}


@dataclasses.dataclass
class SchedulerOutput:
    """One step's work: chunks to compute, in batch order, plus what the connector gets for it.

    `connector_metadata`: the connector's scheduler half's plan for the step (always one, empty where
    nothing moves); `stream_steps`: the step's chunks of streamed prefills (layer streaming publishes
    their K/V layer by layer during the forward); `new_requests`: the sampling params of each request
    scheduled for the first time since it was added (the runner keeps them, and the request's random
    generator, until it finishes);
    `finished_request_ids`: requests finished since the previous step (the runner forgets them
    before it meets this step's new ones: an id may be reused once its request finished)."""

    chunks: list[ScheduledChunk]
    connector_metadata: ConnectorMetadata = dataclasses.field(default_factory=ConnectorMetadata)
    stream_steps: list[StreamStep] = dataclasses.field(default_factory=list)
    num_preempted: int = 0
    new_requests: dict[str, SamplingParams] = dataclasses.field(default_factory=dict)
    finished_request_ids: frozenset[str] = frozenset()


class RunnerRequests:
    """The scheduler's record of which requests the runner has met, to fill a SchedulerOutput's
    `new_requests` and `finished_request_ids`."""

    def __init__(self) -> None:
        self._met: set[str] = set()
        self._finished: set[str] = set()

    def new(self, chunks: list[ScheduledChunk], requests: Mapping[str, RequestState]) -> dict[str, SamplingParams]:
        """The params of the chunks' requests the runner has not met (it meets them now)."""
        fresh = {c.request_id: requests[c.request_id].params for c in chunks if c.request_id not in self._met}
        self._met.update(fresh)
        return fresh

    def finished(self, request_id: str) -> None:
        self._met.discard(request_id)
        self._finished.add(request_id)

    def take_finished(self) -> frozenset[str]:
        done, self._finished = frozenset(self._finished), set()
        return done
