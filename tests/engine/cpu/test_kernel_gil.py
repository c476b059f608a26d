"""The fused CPU kernels compute without holding the GIL, so a worker's event loop (its HTTP
streams, arriving requests) runs while a step computes instead of waiting for the whole step.

While one thread is inside the packed GEMM, this thread runs Python: it records a time
inside the middle of a call (with the GIL held it cannot run at all until the call returns,
whatever the machine's speed or load).
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from pd.engine.cpu import kernels as cpu_kernels
from pd.engine.cpu.packed_linear import num_panels, pack_into

module = cpu_kernels.load()
pytestmark = pytest.mark.skipif(module is None or not module.packed_gemm_available(),
                                reason="no packed GEMM on this CPU/compiler")


def test_packed_gemm_runs_without_the_gil():
    x, w = torch.randn(256, 2048), torch.randn(4096, 2048)
    packed = pack_into(w, torch.empty(num_panels(4096), 2048, 16))
    no_bias = torch.empty(0)
    module.packed_linear(x, packed, 4096, no_bias)  # warm up
    calls: list[tuple[float, float]] = []

    def gemm() -> None:
        for _ in range(4):
            start = time.perf_counter()
            module.packed_linear(x, packed, 4096, no_bias)
            calls.append((start, time.perf_counter()))

    seen: list[float] = []
    worker = threading.Thread(target=gemm)
    worker.start()
    while worker.is_alive():
        seen.append(time.perf_counter())
        time.sleep(0.001)
    worker.join()
    y = module.packed_linear(x, packed, 4096, no_bias)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-4, atol=1e-3)
    # inside the middle 80% of some call, this thread ran (held, the GIL would keep it out of every call)
    inside = [t for start, end in calls for t in seen
              if start + 0.1 * (end - start) < t < end - 0.1 * (end - start)]
    assert inside, (calls, len(seen))
