"""The kernel budget of a decode step on the GPU path: at most 12 kernels a layer.

A decode step of the engine with the Triton backend runs on the CPU through Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1); a `TorchDispatchMode` sees every aten op its forward
dispatches and the kernel launchers are wrapped so that each Triton launch counts as one kernel (the
aten ops the interpreter runs inside a launch are not counted: on a GPU they are that one kernel).

Not counted, because they launch no kernel on a GPU: views and other metadata-only ops (`is_view`:
slices, `view`, `t`, `transpose`, `unsqueeze`, ...), and allocations (`empty`, `empty_like`,
`empty_strided`: the caching allocator hands out memory without a kernel). Everything else counts,
copies and dtype casts included.

Ops are attributed to the layer whose forward is running (hooks on each DecoderLayer); the step's own
ops (embedding, RoPE tables, final norm) are listed apart and held to their own small budget.
"""
from __future__ import annotations

import collections
import dataclasses
import sys

import pytest
import torch
from kvcache.audit import assert_all_free
from torch.utils._python_dispatch import TorchDispatchMode

from pd.engine.attention import triton_launch
from pd.engine.config import EngineConfig
from pd.engine.engine import Engine
from pd.engine.model.config import ModelConfig
from pd.engine.sample.params import SamplingParams

KERNELS_PER_LAYER = 12
KERNELS_PER_STEP = 12  # outside the layers: embedding, cos/sin tables, final norm
MODEL = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2,
                    head_dim=16, layer_types=("full_attention", "sliding_attention", "full_attention"),
                    sliding_window=6, bos_token_id=None, eos_token_id=None, attention_bias=True)
NO_KERNEL = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
             torch.ops.aten.empty_strided.default}


class KernelCount(TorchDispatchMode):
    """Counts kernels per layer (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.layer: int | None = None
        self.in_launch = False
        self.ops: dict[int | None, list[str]] = collections.defaultdict(list)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.in_launch and not func.is_view and func not in NO_KERNEL:
            self.ops[self.layer].append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))

    def launch(self, name: str) -> None:
        self.ops[self.layer].append(f"triton:{name}")


class CountedKernel:
    """A launcher's kernel whose `[grid](...)` counts one kernel, the interpreter's own ops unseen."""

    def __init__(self, kernel, name: str, counter: KernelCount):
        self.kernel, self.name, self.counter = kernel, name, counter

    def __getitem__(self, grid):
        run = self.kernel[grid]

        def launch(*args, **kwargs):
            self.counter.launch(self.name)
            self.counter.in_launch = True
            try:
                return run(*args, **kwargs)
            finally:
                self.counter.in_launch = False
        return launch


def _count_launches(monkeypatch, counter: KernelCount) -> None:
    real = triton_launch.launcher

    def counted(fn, device):
        return CountedKernel(real(fn, device), fn.__name__, counter)

    # every kernel module took `launcher` by name
    for name, module in list(sys.modules.items()):
        if name.startswith("pd.engine") and getattr(module, "launcher", None) is real:
            monkeypatch.setattr(module, "launcher", counted)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_decode_step_on_the_triton_path_runs_at_most_12_kernels_a_layer(monkeypatch, dtype):
    """(Before the fused weights and ops: 25 a layer in float32, 35 in bfloat16, whose torch RMSNorm is 6 ops;
    now 10: 4 GEMMs, 2 norms, RoPE, the KV write, attention, SiLU-and-mul; 11 here, where the small batch
    splits attention's keys and a second kernel combines the shares.)"""
    engine = Engine(EngineConfig(model=dataclasses.replace(MODEL, dtype=dtype), seed=3, block_size=4, num_blocks=64,
                                 max_num_seqs=8, attention_backend="triton", device="cpu"))
    runner = engine.runner
    assert runner.backend.capabilities.name == "triton"
    counts: list[KernelCount] = []
    run = runner._run

    def counted_run(metadata, on_layer):
        if not metadata.decode_only:
            return run(metadata, on_layer)
        counter = KernelCount()
        hooks = [layer.register_forward_pre_hook(lambda _m, _a, i=i: setattr(counter, "layer", i))
                 for i, layer in enumerate(runner.model.model.layers)]
        hooks += [layer.register_forward_hook(lambda *_: setattr(counter, "layer", None))
                  for layer in runner.model.model.layers]
        _count_launches(monkeypatch, counter)
        try:
            with counter:
                return run(metadata, on_layer)
        finally:
            for hook in hooks:
                hook.remove()
            monkeypatch.undo()
            counts.append(counter)

    monkeypatch.setattr(runner, "_run", counted_run)
    out = engine.generate_sync({"a": [5, 6, 7, 8, 9], "b": [1, 2, 3]}, SamplingParams(max_tokens=3, ignore_eos=True))
    monkeypatch.undo()
    assert all(len(tokens) == 3 for tokens in out.values())
    assert counts, "no decode step ran"
    for counter in counts:
        per_layer = [counter.ops[i] for i in range(MODEL.num_layers)]
        report = "\n".join(f"layer {i}: {len(ops)} {ops}" for i, ops in enumerate(per_layer))
        report += f"\nstep: {len(counter.ops[None])} {counter.ops[None]}"
        for ops in per_layer:
            assert len(ops) <= KERNELS_PER_LAYER, report
            # the path is the GPU one: attention, the KV write and the small ops are Triton launches, and
            # the four projections (q|k|v, o, gate|up, down) one GEMM each
            assert sum(op.startswith("triton:") for op in ops) >= 5, report
            assert sum(op in ("linear", "mm", "addmm") for op in ops) == 4, report
        assert len(counter.ops[None]) <= KERNELS_PER_STEP, report
    print(report)
    assert_all_free(engine.kv_cache_manager)
