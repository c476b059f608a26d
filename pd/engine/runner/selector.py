"""The one place an attention backend, and the step executor that goes with it, are chosen: from
(`EngineConfig.attention_backend`, device, dtype), reading the backends' declared capabilities
(attention/capabilities.py, the same declarations the deploy config validates against).

- `torch`: the reference backend (attention/torch_paged.py), valid everywhere;
- `fused`: the CPU attention backend (cpu/paged_attention.py) with the CPU step executor
  (cpu/step_executor.py): float32 on the CPU, with the C++ kernels built; asked for where it is not
  valid, the engine refuses to start and says why;
- `triton`: the Triton kernels (attention/triton_backend.py): on CUDA; on the CPU only through Triton's
  interpreter (`TRITON_INTERPRET=1`, what the tests run); refused elsewhere, saying why;
- `auto`: on CUDA `triton` where it can run, on the CPU `fused` where it can run; else `torch` (logged,
  never an error).

It lives with the runner, above attention and the CPU kernels, because it builds from both.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

import torch

from pd.engine.attention.backend import AttentionBackend
from pd.engine.attention.capabilities import AUTO, CAPABILITIES, BackendCapabilities, check_choice
from pd.engine.attention.metadata import StepMetadata
from pd.engine.attention.torch_paged import TorchPagedBackend
from pd.engine.attention.triton_backend import TritonBackend, why_not_triton
from pd.engine.cpu import kernels as cpu_kernels
from pd.engine.cpu.paged_attention import CpuPagedAttention
from pd.engine.cpu.step_executor import CpuStepExecutor
from pd.engine.kv.layout import BoundKV
from pd.engine.model.config import DTYPES
from pd.engine.model.llama import CausalLM

logger = logging.getLogger(__name__)

# The implementations, found by their declared names (tests/engine/test_backend_capabilities.py checks
# that each declared name has one), and the step executor a backend comes with.
_CLASSES: tuple[type[TorchPagedBackend] | type[TritonBackend], ...] = (TorchPagedBackend, CpuPagedAttention,
                                                                       TritonBackend)
BACKENDS = {cls.capabilities.name: cls for cls in _CLASSES}
_EXECUTORS: dict[type, type[CpuStepExecutor]] = {CpuPagedAttention: CpuStepExecutor}


def _dtype_name(dtype: torch.dtype) -> str:
    return next((name for name, value in DTYPES.items() if value == dtype), str(dtype))


def why_not(caps: BackendCapabilities, device: torch.device, dtype: torch.dtype, head_size: int | None = None,
            block_size: int | None = None) -> str | None:
    """Why the backend `caps` declares cannot run here: its declared rules, then what only this process
    knows (the C++ kernels build, Triton imports); None when it can."""
    why = caps.why_not(str(device), _dtype_name(dtype), head_size, block_size)
    if why is None and caps.needs_triton:
        why = why_not_triton(device)
    if why is None and caps.needs_cpp_kernels and cpu_kernels.load() is None:
        why = "the C++ kernel could not be built here (is a C++ compiler installed? see the log)"
    return why


def select_backend(choice: str, device: torch.device | str, dtype: torch.dtype, head_size: int | None = None,
                   block_size: int | None = None) -> str:
    """The backend's name (a key of `CAPABILITIES`) for `choice` (one of `ATTENTION_BACKENDS`) on this
    device and dtype. Raises ValueError for an explicit choice that cannot run here, saying why."""
    check_choice(choice)
    device = torch.device(device)
    if choice != AUTO:
        why = why_not(CAPABILITIES[choice], device, dtype, head_size, block_size)
        if why is not None:
            raise ValueError(f"attention_backend '{choice}' is not usable: {why}; use 'auto' or 'torch'")
        return choice
    preferred = "triton" if device.type == "cuda" else "fused"
    why = why_not(CAPABILITIES[preferred], device, dtype, head_size, block_size)
    if why is None:
        return preferred
    logger.info("attention_backend auto: using torch (%s)", why)
    return "torch"


class StepExecutor(Protocol):
    """Runs whole steps where it `applies`, over weights of its own (implemented by cpu/step_executor.py).

    Guarantees: `run_step` returns the final-norm hidden states (R, hidden) of the rows that need logits,
    in chunk order, writing K/V only into the step's slots; `greedy_tokens` gives each row's argmax among
    ids [0, num_ids) (lowest id on a tie), or None where it cannot tell without the full logits; `model`
    is what the per-layer path runs for the steps it leaves."""

    model: CausalLM

    def applies(self, metadata: StepMetadata) -> bool: ...

    def run_step(self, metadata: StepMetadata) -> torch.Tensor: ...

    def greedy_tokens(self, hidden: torch.Tensor, num_ids: int) -> list[int | None]: ...

    @property
    def description(self) -> str: ...


@dataclasses.dataclass
class StepRunners:
    """What runs a step: the attention backend of the per-layer path, the model it runs (the executor's
    copy where there is an executor) and the step executor, where the backend comes with one."""

    backend: AttentionBackend
    model: CausalLM
    executor: StepExecutor | None


def build(choice: str, model: CausalLM, kv: BoundKV) -> StepRunners:
    """The backend `select_backend` picks for the pool's device and the layout's dtype, over the K/V views
    `kv` (and for `fused` the CPU step executor, which lays out its own copy of the weights here)."""
    layout = kv.layout
    name = select_backend(choice, kv.pool.device, layout.dtype, layout.head_dim, layout.block_size)
    cls = BACKENDS[name]
    backend: AttentionBackend = cls(kv)
    executor_cls = _EXECUTORS.get(cls)
    if executor_cls is None:
        return StepRunners(backend, model, None)
    executor: StepExecutor = executor_cls(model, kv)
    return StepRunners(backend, executor.model, executor)
