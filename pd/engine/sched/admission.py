"""How many prompt tokens a step admits from a burst of waiting prompts (`EngineConfig.step_overhead_tokens`).

A burst of N prompts arriving together (a wave of streams) shares the CPU: a step that prefills all of them
gives every one its first token only when the whole burst is computed. Split into m steps of whole prompts,
the first group answers after about 1/m of that compute, the next after 2/m, and so on, each step paying a
fixed cost (the step's host work and its weight reads: `o` prompt tokens' worth). The mean time to a first
token, (m + 1) / 2 * (o + T / m) for T waiting tokens, is smallest at m = sqrt(T / o), that is about
sqrt(T * o) tokens a step. Decode rows of the requests already running still go first in every step (the
scheduler schedules them before it admits), so a burst starves no decode.
"""
from __future__ import annotations

import math
from collections.abc import Iterable


def admission_tokens(budget: int, step_overhead_tokens: int, waiting_tokens: Iterable[int]) -> int:
    """The prompt tokens a step may admit from the waiting requests (each item: one request's tokens still to
    compute, in queue order): `budget` when the split is off (`step_overhead_tokens` 0) or one prompt waits;
    else ceil(sqrt(T * step_overhead_tokens)) for the T tokens waiting, at most `budget`. The scheduler admits
    whole prompts while it has any of this left, so a step always takes at least the head prompt."""
    if step_overhead_tokens <= 0:
        return budget
    total, count = 0, 0
    for num in waiting_tokens:
        total += num
        count += 1
    if count < 2:
        return budget
    return max(1, min(budget, math.isqrt(total * step_overhead_tokens - 1) + 1))
