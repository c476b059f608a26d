"""The engine with the Triton attention backend, on the CPU through Triton's interpreter (the root
conftest sets TRITON_INTERPRET=1 where CUDA is absent): the same greedy tokens as the torch backend on a
tiny GQA model with a sliding-window layer, through chunked prefill, mixed steps and a prefix-cache hit."""
import os

import pytest
import torch
from kvcache.audit import assert_all_free

from pd.engine.runner.selector import select_backend
from pd.engine.config import EngineConfig
from pd.engine.engine import Engine
from pd.engine.model.config import ModelConfig
from pd.engine.sample.params import SamplingParams

TINY = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, layer_types=("full_attention", "sliding_attention"), sliding_window=6,
                   bos_token_id=None, eos_token_id=None)


def tiny_config(**kw) -> EngineConfig:
    defaults = dict(model=TINY, seed=3, block_size=4, num_blocks=64, max_num_batched_tokens=16, max_num_seqs=8,
                    long_prefill_token_threshold=7)
    defaults.update(kw)
    return EngineConfig(**defaults)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (CPU: the kernels run interpreted)


def _run(backend: str) -> tuple[list[dict[str, list[int]]], Engine]:
    eng = Engine(tiny_config(attention_backend=backend, device=DEVICE))
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    shared = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5]
    first = {"a": shared + [11, 12], "b": [5, 6, 7]}
    second = {"c": shared + [13, 14, 15, 16], "d": [1]}  # c hits a's cached prefix blocks
    outs = [eng.generate_sync(first, params), eng.generate_sync(second, params)]
    return outs, eng


def test_triton_backend_engine_gives_the_torch_backends_greedy_tokens():
    assert os.environ.get("TRITON_INTERPRET") == "1" or DEVICE == "cuda"
    expected, torch_eng = _run("torch")
    got, eng = _run("triton")
    assert eng.runner.backend.capabilities.name == "triton"
    assert got == expected
    assert eng.stats()["prefix_cache_hits"] > 0  # c's prompt read a's pages
    assert_all_free(eng.kv_cache_manager)
    assert_all_free(torch_eng.kv_cache_manager)


def test_triton_refused_on_the_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend 'triton' is not usable: .*interpreter"):
        select_backend("triton", "cpu", torch.float32)
    with pytest.raises(ValueError, match="attention_backend 'triton' is not usable"):
        Engine(tiny_config(attention_backend="triton"))
    assert select_backend("auto", "cpu", torch.bfloat16) == "torch"  # auto on the CPU never picks triton
