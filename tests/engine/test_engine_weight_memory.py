"""An engine holds its weights once: a backend that lays out its own copy of them (the CPU backend's
packed panels) is the only holder of the layer weights after start, not a second copy beside the model
the engine loaded. Counted as the unique storages of weight tensors reachable from the engine."""
import gc
import types

import pytest
import torch

from pd.engine.config import EngineConfig
from pd.engine.cpu import kernels as cpu_kernels
from pd.engine.engine import Engine
from pd.engine.model.config import ModelConfig
from pd.engine.model.llama import build_model

MODEL = ModelConfig(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8,
                    num_kv_heads=2, tie_word_embeddings=False)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8)


def weight_storage_bytes(root: object, exclude: set[int]) -> int:
    """Bytes of the distinct storages of weight-typed tensors reachable from `root` (by gc referents),
    those in `exclude` (data pointers: the KV pages) left out."""
    seen: set[int] = set()
    storages: dict[int, int] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        # (modules' globals are not the engine's: a Python module, or a function's globals, is where the walk
        # stops, so what other code left in module state is never counted)
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, str, bytes, int, float)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if obj.dtype in WEIGHT_DTYPES and storage.data_ptr() not in exclude:
                storages[storage.data_ptr()] = storage.nbytes()
            continue
        if isinstance(obj, types.FunctionType):  # its closure and defaults, never its module's globals
            stack.extend([*(cell.cell_contents for cell in obj.__closure__ or () if cell.cell_contents is not None),
                          *(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values()])
            continue
        stack.extend(gc.get_referents(obj))
    return sum(storages.values())


@pytest.mark.filterwarnings("ignore::FutureWarning")  # (the walk meets torch.distributed's deprecated aliases)
@pytest.mark.parametrize("backend", ["torch", "fused"])
def test_engine_keeps_one_copy_of_the_weights(backend):
    if backend == "fused" and cpu_kernels.load() is None:
        pytest.skip("the C++ kernels do not build here")
    eng = Engine(EngineConfig(model=MODEL, num_blocks=16, attention_backend=backend))
    assert eng.runner.backend.capabilities.name == backend
    model = build_model(MODEL)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    pages = {eng.runner.kv.token_rows.untyped_storage().data_ptr()}
    held = weight_storage_bytes(eng, pages)
    assert param_bytes <= held <= 1.1 * param_bytes, (held, param_bytes)
