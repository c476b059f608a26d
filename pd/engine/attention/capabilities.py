"""What each attention backend can do, declared once: the names a config may give and the rules both the
engine's selector (runner/selector.py) and the deploy config's validation (pd/cluster/config.py) read.

This module imports no torch (the router's process reads the deploy config): devices and dtypes are named
as the configs name them ("cpu", "cuda"; "float32", "bfloat16", "float16"). Each backend class carries its
entry as `capabilities` (`TorchPagedBackend.capabilities is CAPABILITIES["torch"]`).

What a declaration cannot say, because only the running process knows it (whether the C++ kernels build
here, whether Triton imports), the selector checks at engine start from `needs_cpp_kernels` and
`needs_triton`.
"""
from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class BackendCapabilities:
    """One backend's declaration.

    Guarantees: `why_not` is None exactly when every declared rule admits (device, dtype, head size, block
    size, tensor-parallel degree); it names the first rule that does not, in words a config error can carry.
    """

    name: str
    devices: tuple[str, ...]  # device types it runs on ("cpu", "cuda")
    dtypes: tuple[str, ...]  # serving dtypes it runs
    head_sizes: tuple[int, ...] | None = None  # None: any head size
    block_sizes: tuple[int, ...] | None = None  # None: any block size
    # plans nothing on the host per step (reads only the metadata's tensors): its decode steps may be
    # captured in CUDA graphs (runner/cuda_graphs.py)
    graph_safe: bool = False
    needs_cpp_kernels: bool = False  # the C++ kernels of pd/engine/cpu/ must build on the worker
    needs_triton: bool = False  # triton must be importable
    # devices it runs on only through Triton's interpreter (TRITON_INTERPRET=1, what the tests set)
    interpreted_devices: tuple[str, ...] = ()
    # the tensor-parallel degrees it supports; None: any the model splits by (pd/engine/parallel/tp.py check_tp)
    tensor_parallel: tuple[int, ...] | None = (1,)

    def why_not(self, device: str, dtype: str, head_size: int | None = None, block_size: int | None = None,
                tensor_parallel: int = 1) -> str | None:
        """Why this backend cannot serve these settings (device type or 'cuda:N', dtype name), or None."""
        kind = device.partition(":")[0]
        if kind not in self.devices:
            interpreted = kind in self.interpreted_devices and os.environ.get("TRITON_INTERPRET") == "1"
            if not interpreted:
                where = " or ".join(self.devices)
                extra = (f" ({' and '.join(self.interpreted_devices)} only through Triton's interpreter, "
                         "TRITON_INTERPRET=1)" if self.interpreted_devices else "")
                return f"'{self.name}' runs on {where}{extra}; here the device is {device}"
        if dtype not in self.dtypes:
            return f"'{self.name}' runs {' or '.join(self.dtypes)}; here the dtype is {dtype}"
        if self.head_sizes is not None and head_size is not None and head_size not in self.head_sizes:
            return f"'{self.name}' supports head sizes {self.head_sizes}; here it is {head_size}"
        if self.block_sizes is not None and block_size is not None and block_size not in self.block_sizes:
            return f"'{self.name}' supports block sizes {self.block_sizes}; here it is {block_size}"
        if self.tensor_parallel is not None and tensor_parallel not in self.tensor_parallel:
            return (f"'{self.name}' supports tensor-parallel degrees {self.tensor_parallel}; "
                    f"here it is {tensor_parallel}")
        return None


_ALL_DTYPES = ("float32", "bfloat16", "float16")

TORCH = BackendCapabilities("torch", devices=("cpu", "cuda"), dtypes=_ALL_DTYPES, tensor_parallel=None)
# (TP 1 only: its step executor runs the whole layer stack in one C++ call, with no place for an all-reduce)
FUSED = BackendCapabilities("fused", devices=("cpu",), dtypes=("float32",), needs_cpp_kernels=True)
# (at TP > 1 without CUDA graphs, for now: pd/engine/runner/compute.py)
TRITON = BackendCapabilities("triton", devices=("cuda",), dtypes=_ALL_DTYPES, graph_safe=True, needs_triton=True,
                             interpreted_devices=("cpu",), tensor_parallel=None)

# The backends by name: the one declaration of the names a config may give (besides AUTO).
CAPABILITIES: dict[str, BackendCapabilities] = {c.name: c for c in (TORCH, FUSED, TRITON)}
AUTO = "auto"  # on CUDA triton where it can run, on the CPU fused where it can run; else torch
ATTENTION_BACKENDS: tuple[str, ...] = (AUTO, *CAPABILITIES)
DEFAULT_ATTENTION_BACKEND = AUTO  # EngineConfig's and the deploy config's default


def check_choice(choice: str) -> None:
    """Raises ValueError unless `choice` is one of `ATTENTION_BACKENDS`."""
    if choice not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {choice!r}")
