"""From how many rows a packed projection is faster through torch's GEMM, measured per shape.

The packed-panel kernel (pd/engine/cpu/cpu_gemm.cpp) streams its weights well at decode
shapes (a few rows), but at prefill shapes torch's sgemm (MKL / oneDNN) is up to twice
as fast on some CPUs, even after re-laying the panels as a plain (K, N) matrix for the
call, a copy the size of the weight. Where the crossover lies depends on the CPU, the
thread count and the shape, so it is measured: for each distinct (K, N) of a model's
packed projections, both paths are timed at a ladder of row counts, and a projection
takes the torch path from the smallest row count past which torch wins at every rung.

The table is cached per machine (CPU model and flags, thread count, torch version, kernel build) beside the fused
kernels, so every worker process of a machine with the same thread count uses the same
crossovers, and the measurement is paid once. Workers on other thread counts may cross
over elsewhere: both paths are float32 GEMMs, so they agree to rounding, not bit for bit.
`PDKV_GEMM_TUNING=off` keeps every projection on the packed kernel. A process that waits
over LOCK_WAIT_S for another's measurement uses the packed kernel rather than wait on.
"""
from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from torch import nn

from pd.engine.cpu import kernels as cpu_kernels
from pd.engine.cpu import packed_linear
from pd.engine.cpu.packed_linear import NEVER, PackedLinear, torch_mm_from_packed

logger = logging.getLogger(__name__)

ROW_LADDER = (32, 64, 128, 256, 512, 1024)
LOCK_WAIT_S = 120.0
_TABLE_NAME = "gemm_tuning.json"


def best_seconds(fn: Callable[[], object], reps: int = 2) -> float:
    """The fastest of `reps` calls of `fn`, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_crossover(in_features: int, out_features: int, ladder: tuple[int, ...] = ROW_LADDER) -> int:
    """The smallest rung from which torch's GEMM beats the packed kernel at every larger rung (NEVER if
    it loses at the top rung)."""
    kernels = cpu_kernels.load()
    weight = torch.randn(out_features, in_features)
    packed = torch.empty(packed_linear.num_panels(out_features), in_features, packed_linear.PANEL)
    packed_linear.pack_into(weight, packed)
    no_bias = torch.empty(0)
    crossover = NEVER
    for rows in reversed(ladder):
        x = torch.randn(rows, in_features)
        t_packed = best_seconds(functools.partial(kernels.packed_linear, x, packed, out_features, no_bias))
        t_torch = best_seconds(functools.partial(torch_mm_from_packed, x, packed, out_features, None))
        if t_torch >= t_packed:
            break
        crossover = rows
    return crossover


def _machine_key() -> str:
    cpu = "unknown-cpu"
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), cpu)
    except OSError:
        pass
    # The kernel build's name digests the CPU's flags and the kernels' version: a new kernel (or an
    # AVX-512 build where an AVX2 one ran) is measured again.
    return f"{cpu}|threads={torch.get_num_threads()}|torch={torch.__version__}|{cpu_kernels.kernel_name()}"


def _table_path() -> Path:
    return cpu_kernels.build_directory().parent / _TABLE_NAME


def _read_table(path: Path) -> dict[str, dict[str, int]]:
    """The cached table; a missing, unreadable or malformed file counts as empty (measured again)."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(table, dict):
        return {}
    return {machine: {shape: rows for shape, rows in known.items() if isinstance(rows, int)}
            for machine, known in table.items() if isinstance(known, dict)}


def crossovers(shapes: set[tuple[int, int]]) -> dict[tuple[int, int], int]:
    """The crossover row count of each (in_features, out_features), from the machine's cached table,
    measuring (under an flock, so concurrent starts measure once) the shapes it lacks."""
    if os.environ.get("PDKV_GEMM_TUNING", "").lower() in ("off", "0", "false"):
        return {shape: NEVER for shape in shapes}
    path = _table_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    machine = _machine_key()
    with open(path.with_suffix(".lock"), "w") as lock:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    logger.warning("another process measures the GEMM crossovers for over %.0f s: packed kernel only",
                                   LOCK_WAIT_S)
                    return {shape: NEVER for shape in shapes}
                time.sleep(0.1)
        try:
            table = _read_table(path)
            known = table.get(machine, {})
            missing = sorted(s for s in shapes if f"{s[0]}x{s[1]}" not in known)
            if missing:
                logger.info("measuring the packed vs torch GEMM crossover for %d shapes (once per machine)",
                            len(missing))
                for k, n in missing:
                    known[f"{k}x{n}"] = measure_crossover(k, n)
                table[machine] = known
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
                tmp.replace(path)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return {s: int(known[f"{s[0]}x{s[1]}"]) for s in shapes}


def apply_crossovers(model: nn.Module) -> dict[tuple[int, int], int]:
    """Sets every PackedLinear of `model` to take torch's GEMM from its shape's crossover on; returns them."""
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    table = crossovers({(m.in_features, m.out_features) for m in layers})
    for m in layers:
        m.torch_from_rows = table[(m.in_features, m.out_features)]
    logger.info("GEMM crossovers (rows from which torch's GEMM runs a projection): %s",
                {f"{k}x{n}": (rows if rows != NEVER else "never") for (k, n), rows in sorted(table.items())})
    return table
