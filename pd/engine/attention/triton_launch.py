"""Launching the Triton kernels on either device: compiled on CUDA, interpreted on the CPU.

The kernels stay plain Python functions and the launcher is chosen per device
at the first launch: a CUDA tensor gets `triton.jit(fn)`, a CPU tensor
Triton's interpreter (`InterpretedFunction`). The interpreter also needs
Triton's own library functions (`tl.sum`, `tl.max`, ...) in interpreter form,
and Triton decides that once, when `triton.language` is first imported, from
`TRITON_INTERPRET=1`: a CPU launch in a process that imported Triton without it
fails with a message saying so (the test suite sets the variable in its
conftest, before anything imports Triton).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_LAUNCHERS: dict[tuple[Callable[..., Any], bool], Any] = {}


def launcher(fn: Callable[..., Any], device: torch.device) -> Any:
    """The kernel `fn` ready for `[grid](...)` on `device` (cached per function and device kind)."""
    interpret = device.type == "cpu"
    key = (fn, interpret)
    found = _LAUNCHERS.get(key)
    if found is None:
        if interpret:
            import triton.language as tl
            from triton.runtime.interpreter import InterpretedFunction

            if not isinstance(tl.sum, InterpretedFunction):
                raise RuntimeError("a Triton kernel was launched on CPU tensors, which needs Triton's interpreter: set "
                                   "TRITON_INTERPRET=1 in the environment before triton is first imported")

            found = InterpretedFunction(fn)
        else:
            import triton

            found = triton.jit(fn)
        _LAUNCHERS[key] = found
    return found


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: float32 models keep full precision (no TF32), 16-bit ones use tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


def upcast_dot(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `tl.dot` takes float32 copies of bfloat16 operands: only in the interpreter, whose bfloat16
    `tl.dot` returns garbage in Triton 3.9 (loads, conversions and stores of bfloat16 are exact there)."""
    return device.type == "cpu" and dtype == torch.bfloat16
