"""The fused CPU kernels compute without holding the GIL, so a worker's event loop (its HTTP
streams, arriving requests) runs while a step computes instead of waiting for the whole step.

While one thread is inside the packed GEMM, this thread keeps running: its longest wait for
the GIL stays far below the call's duration (with the GIL held, it waits the whole call).
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from pd.engine import cpu_kernels
from pd.engine.packed_linear import num_panels, pack_into

module = cpu_kernels.load()
pytestmark = pytest.mark.skipif(module is None or not module.packed_gemm_available(),
                                reason="no packed GEMM on this CPU/compiler")


def test_packed_gemm_runs_without_the_gil():
    x, w = torch.randn(256, 2048), torch.randn(4096, 2048)
    packed = pack_into(w, torch.empty(num_panels(4096), 2048, 16))
    no_bias = torch.empty(0)
    took: list[float] = []

    def gemm() -> None:
        start = time.perf_counter()
        for _ in range(4):
            module.packed_linear(x, packed, 4096, no_bias)
        took.append(time.perf_counter() - start)

    for _ in range(2):  # the first round warms up
        worker = threading.Thread(target=gemm)
        longest_wait, last = 0.0, time.perf_counter()
        worker.start()
        while worker.is_alive():
            time.sleep(0.001)
            now = time.perf_counter()
            longest_wait, last = max(longest_wait, now - last), now
        worker.join()
    y = module.packed_linear(x, packed, 4096, no_bias)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-4, atol=1e-3)
    # with the GIL held, the wait would be one whole call at least (a quarter of the round)
    assert longest_wait < took[-1] / 8, (longest_wait, took)
