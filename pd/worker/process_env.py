"""The environment a worker process starts with: what must be set before torch loads."""
from __future__ import annotations

import os


def worker_env() -> dict[str, str]:
    """Environment of a worker process, set before torch loads. `OMP_WAIT_POLICY=PASSIVE` (unless the
    caller's environment sets it): torch's OpenMP threads sleep between ops instead of spinning. The
    fused kernels run on a pool of their own (pd/engine/cpu/cpu_pool.cpp); a spinning OpenMP thread took
    its core between the projections of a prefill (a 24-token prefill on 2 threads: 151 ms spinning,
    91 ms passive, 110 ms on 1 thread; a decode step unchanged)."""
    return {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
