"""One step's plan, from the scheduler to the runner: the chunks to compute, in batch order, and the
requests the runner meets for the first time (with their sampling params) or sees no more."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from connectors.base import ConnectorMetadata
from pd.engine.sample.params import SamplingParams
from pd.engine.sched.request_state import RequestState


@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
    """Tokens [start, start + len(token_ids)) of one request, computed this step."""

    request_id: str
    token_ids: list[int]
    start: int
    block_ids: tuple[list[int], ...]
    needs_logits: bool  # True when the chunk reaches the end of the sequence


@dataclasses.dataclass
class SchedulerOutput:
    """One step's work: chunks to compute, in batch order, plus the connector's metadata.

    `new_requests`: the sampling params of each request scheduled for the first time since it was
    added (the runner keeps them, and the request's random generator, until it finishes);
    `finished_request_ids`: requests finished since the previous step (the runner forgets them
    before it meets this step's new ones: an id may be reused once its request finished)."""

    chunks: list[ScheduledChunk]
    connector_metadata: ConnectorMetadata | None = None
    num_preempted: int = 0
    new_requests: dict[str, SamplingParams] = dataclasses.field(default_factory=dict)
    finished_request_ids: frozenset[str] = frozenset()

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


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
