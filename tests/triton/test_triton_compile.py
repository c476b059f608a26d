"""Every Triton kernel of the engine compiles for sm_80 and sm_90 with 0 register spills, on a machine
with no GPU: Triton's NVIDIA backend and its bundled ptxas compile them (tests/triton/triton_compile_cases.py,
run in a subprocess without the interpreter, lists the configurations: paged decode, prompt chunks, KV
write, split-KV decode and its reduce, RMSNorm with and without the residual add, RoPE, SiLU-and-mul, over float32/bfloat16/float16, head
sizes 64 and 128, GQA groups 1, 7 and 8 (every group 1-8 for the prompt kernel, whose tile packs the group),
with the constants and launch options the backend launches).

Results are cached in pytest's cache (keyed by Triton's version, each kernel's source and configuration):
a cold run compiles 234 configurations (a few minutes on two cores), a warm one only what changed."""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent


def _nvidia_backend_missing() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    try:
        from triton.backends import backends
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError as exc:
        return f"Triton's NVIDIA backend is missing ({exc})"
    if "nvidia" not in backends:
        return "Triton's NVIDIA backend is missing"
    try:
        get_ptxas(90).path
    except Exception as exc:  # noqa: BLE001 - any way of not finding ptxas is a reason to skip
        return f"Triton's bundled ptxas is missing ({exc})"
    return None


@pytest.mark.skipif(_nvidia_backend_missing() is not None, reason=str(_nvidia_backend_missing()))
def test_every_kernel_compiles_for_sm80_and_sm90_without_register_spills(request, tmp_path):
    # results keyed by Triton's version and each kernel's source, kept in pytest's cache between runs
    # (`-p no:cacheprovider`: compiled afresh into this test's own directory)
    cache_provider = getattr(request.config, "cache", None)
    folder = cache_provider.mkdir("triton_compile") if cache_provider is not None else tmp_path
    cache = pathlib.Path(folder) / "results.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(HERE / "triton_compile_cases.py"), "--cache", str(cache)],
                          capture_output=True, text=True, env=env, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    kernels = {row["kernel"].split()[0] for row in rows}
    assert kernels == {"decode", "decode_reduce", "prefill", "kv_write", "rope", "rms_norm", "silu_and_mul"}
    assert {row["arch"] for row in rows} == {80, 90}
    assert {row["target"] for row in rows} == {"sm_80", "sm_90a"}
    spilling = [row for row in rows if row["spill_bytes"]]
    assert not spilling, "\n".join(json.dumps(row) for row in spilling)
    assert all(0 < row["registers"] <= 255 for row in rows)
