"""The one place an attention backend is chosen: from (`EngineConfig.attention_backend`, device, dtype).

- `torch`: the reference backend (attention/torch_paged.py), valid everywhere;
- `fused`: the CPU backend (attention/cpu_fused.py): float32 on the CPU, with the C++ kernels built;
  asked for where it is not valid, the engine refuses to start and says why;
- `triton`: the Triton kernels (attention/triton_backend.py): on CUDA; on the CPU only through Triton's
  interpreter (`TRITON_INTERPRET=1`, what the tests run); refused elsewhere, saying why;
- `auto`: on CUDA `triton` where Triton is importable, on the CPU `fused` where it is valid; else
  `torch` (logged, never an error).
"""
from __future__ import annotations

import logging

import torch

from pd.engine.attention.backend import AttentionBackend
from pd.engine.attention.cpu_fused import CpuFusedBackend
from pd.engine.attention.torch_paged import TorchPagedBackend
from pd.engine.attention.triton_backend import TritonBackend, why_not_triton
from pd.engine.cpu import kernels as cpu_kernels
from pd.engine.kv.layout import KVLayout
from pd.engine.kv.page_pool import PagePool
from pd.engine.model.llama import CausalLM

logger = logging.getLogger(__name__)

BACKENDS: dict[str, type[TorchPagedBackend] | type[TritonBackend]] = {
    "torch": TorchPagedBackend, "fused": CpuFusedBackend, "triton": TritonBackend}
CHOICES = ("auto", "torch", "fused", "triton")


def _why_not_fused(device: torch.device, dtype: torch.dtype) -> str | None:
    if dtype != torch.float32:
        return f"the model runs in {dtype}, the kernel is float32 only"
    if device.type != "cpu":
        return f"the model runs on {device}, the kernel is for the CPU"
    if cpu_kernels.load() is None:
        return "the C++ kernel could not be built here (is a C++ compiler installed? see the log)"
    return None


def select_backend(choice: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """The backend's name (a key of `BACKENDS`) for `choice` (one of `CHOICES`) on this device and
    dtype. Raises ValueError for an explicit choice that cannot run here, saying why."""
    if choice == "torch":
        return "torch"
    if choice not in CHOICES:
        raise ValueError(f"attention_backend must be one of {CHOICES}, got {choice!r}")
    device = torch.device(device)
    if choice == "triton" or (choice == "auto" and device.type == "cuda"):
        why_triton = why_not_triton(device)
        if why_triton is None:
            return "triton"
        if choice == "triton":
            raise ValueError(f"attention_backend 'triton' is not usable: {why_triton}; use 'auto' or 'torch'")
        logger.info("attention_backend auto: using torch (%s)", why_triton)
        return "torch"
    why = _why_not_fused(device, dtype)
    if why is None:
        return "fused"
    if choice == "fused":
        raise ValueError(f"attention_backend 'fused' is not usable: {why}; use 'auto' or 'torch'")
    logger.info("attention_backend auto: using torch (%s)", why)
    return "torch"


def build_backend(choice: str, model: CausalLM, layout: KVLayout, page_pool: PagePool) -> AttentionBackend:
    """The backend `select_backend` picks for the model's device and dtype, built over `page_pool`
    (a backend lays out its own copy of the weights here, at load time)."""
    name = select_backend(choice, page_pool.device, layout.dtype)
    return BACKENDS[name](model, layout, page_pool)
