"""gpu_check: how much of a step's wall time the GPU spends running kernels (torch.profiler).

The share is the union of the device kernels' intervals inside the profiled
window, over the window's length: overlapping kernels (several streams) count
once, idle gaps between launches (Python, launch overhead, host syncs) count
as idle. 1.0 means the GPU never waited for the host.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable


def busy_share(intervals: Iterable[tuple[float, float]], window: tuple[float, float]) -> float:
    """Fraction of `window` (start, end) covered by the union of `intervals`, clipped to the window."""
    lo, hi = window
    if hi <= lo:
        raise ValueError(f"empty window {window}")
    covered = 0.0
    end = lo
    for start, stop in sorted(intervals):
        start, stop = max(start, end), min(stop, hi)
        if stop > start:
            covered += stop - start
            end = stop
    return covered / (hi - lo)


def profile_busy(step: Callable[[], object], steps: int) -> dict:
    """Runs `step` `steps` times under torch.profiler (CPU and CUDA) and reports the GPU-busy share,
    the kernel count and the wall time per step, all from the profiler's own timeline."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels, spans = [], []
    for event in prof.events():
        rng = (event.time_range.start, event.time_range.end)
        spans.append(rng)
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append(rng)
    if not kernels:
        return {"error": "the profiler recorded no GPU kernel"}
    window = (min(s for s, _ in spans), max(e for _, e in spans))
    return {"busy_share": round(busy_share(kernels, window), 3), "kernels_per_step": round(len(kernels) / steps, 1),
            "step_ms": round((window[1] - window[0]) / 1000 / steps, 3), "profiled_steps": steps}
