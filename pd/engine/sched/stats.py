"""Counters the scheduler keeps for the engine's stats()."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SchedulerStats:
    """Monotonic counters since the engine started."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_errors: int = 0
    num_load_failures_recomputed: int = 0
    num_remote_tokens: int = 0  # tokens whose KV arrived through the connector (verified)
    prefix_queries: int = 0  # tokens looked up in the prefix cache
    prefix_hits: int = 0  # of which found cached

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
