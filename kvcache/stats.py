"""Prefix-cache hit statistics.

`PrefixCacheStats` accumulates one interval (the manager hands it out and
starts a fresh one in `make_prefix_cache_stats`); requests that were preempted
before are counted apart, since their re-prefill hits are not "real" reuse.
`CachingMetrics` keeps a sliding window over the last `max_recent_requests`
requests for a hit rate.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    reset: bool = False
    requests: int = 0
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class CachingMetrics:
    """Hit rate over (roughly) the last `max_recent_requests` requests."""

    def __init__(self, max_recent_requests: int = 1000) -> None:
        self.max_recent_requests = max_recent_requests
        self.aggregated_requests = 0
        self.aggregated_query_total = 0
        self.aggregated_query_hit = 0
        self.query_queue: deque[tuple[int, int, int]] = deque()

    def observe(self, stats: PrefixCacheStats) -> None:
        if stats.reset:
            self.reset()
        if stats.requests == 0:
            return  # nothing new: keep the window as it is
        self.query_queue.append((stats.requests, stats.queries, stats.hits))
        self.aggregated_requests += stats.requests
        self.aggregated_query_total += stats.queries
        self.aggregated_query_hit += stats.hits
        # drop old intervals while the rest still covers the window
        while len(self.query_queue) > 1 and self.aggregated_requests > self.max_recent_requests:
            r, q, h = self.query_queue.popleft()
            self.aggregated_requests -= r
            self.aggregated_query_total -= q
            self.aggregated_query_hit -= h

    def reset(self) -> None:
        self.aggregated_requests = 0
        self.aggregated_query_total = 0
        self.aggregated_query_hit = 0
        self.query_queue.clear()

    @property
    def empty(self) -> bool:
        return self.aggregated_requests == 0

    @property
    def hit_rate(self) -> float:
        if self.aggregated_query_total == 0:
            return 0.0
        return self.aggregated_query_hit / self.aggregated_query_total
