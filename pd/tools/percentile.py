"""The one percentile every tool reports.

Linear interpolation between the closest ranks: numpy's default, and what
`statistics.quantiles(values, n=100, method="inclusive")` gives at whole percents, so a figure
printed by one tool means the same as the same figure printed by another.
"""
from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float, empty: float = 0.0) -> float:
    """The q-th percentile (0 <= q <= 100) of `values`; `empty` when there are none.

    The default 0.0 is what vLLM's result JSON writes for a metric without samples (the load
    generator's keys follow it); the benchmark tables pass `math.nan`, so that an empty cell reads
    as missing, never as a measured zero.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    ordered = sorted(values)
    if not ordered:
        return empty
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
