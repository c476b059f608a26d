"""One step's plan, from the scheduler to the runner: the chunks to compute, in batch order."""
from __future__ import annotations

import dataclasses

from connectors.base import ConnectorMetadata


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
    """One step's work: chunks to compute, in batch order, plus the connector's metadata."""

    chunks: list[ScheduledChunk]
    connector_metadata: ConnectorMetadata | None = None
    num_preempted: int = 0

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)
