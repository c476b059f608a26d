"""The attention backends' declarations (attention/capabilities.py): one name each, one implementation
each, read alike by the engine's selector and the deploy config; and the K/V views bound once."""
from __future__ import annotations

import pytest
import torch

from pd.cluster.config import DeployConfig
from pd.cluster.config import ConfigError
from pd.engine.attention.capabilities import (
    ATTENTION_BACKENDS, CAPABILITIES, DEFAULT_ATTENTION_BACKEND, BackendCapabilities)
from pd.engine.attention.metadata import StepInputBuilder
from pd.engine.attention.torch_paged import TorchPagedBackend
from pd.engine.config import EngineConfig
from pd.engine.kv.layout import KVLayout
from pd.engine.kv.page_pool import PagePool
from pd.engine.model.config import ModelConfig
from pd.engine.runner.selector import BACKENDS, select_backend
from pd.engine.sched.output import ScheduledChunk

HYBRID = ModelConfig(num_layers=4, layer_types=("full_attention", "sliding_attention") * 2, sliding_window=8)


def test_every_declared_name_has_one_implementation_carrying_its_declaration():
    assert ATTENTION_BACKENDS == ("auto", *CAPABILITIES)
    assert set(BACKENDS) == set(CAPABILITIES)
    for name, cls in BACKENDS.items():
        assert cls.capabilities is CAPABILITIES[name] and cls.capabilities.name == name
    assert EngineConfig().attention_backend == DeployConfig().model.attention_backend == DEFAULT_ATTENTION_BACKEND


def test_declared_rules_say_why_not(monkeypatch):
    fused, triton, torch_caps = CAPABILITIES["fused"], CAPABILITIES["triton"], CAPABILITIES["torch"]
    assert fused.why_not("cpu", "float32") is None
    assert "float32" in fused.why_not("cpu", "bfloat16") and "cpu" in fused.why_not("cuda:1", "float32")
    assert torch_caps.why_not("cuda", "float16") is None
    # (fused: TP 1 only, its step executor has no place for an all-reduce; torch: any TP the model splits by)
    assert "tensor-parallel" in fused.why_not("cpu", "float32", tensor_parallel=2)
    assert torch_caps.why_not("cpu", "float32", tensor_parallel=4) is None
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "interpreter" in triton.why_not("cpu", "float32") and triton.why_not("cuda:0", "bfloat16") is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton.why_not("cpu", "float32") is None
    narrow = BackendCapabilities("narrow", ("cpu",), ("float32",), head_sizes=(64, 128), block_sizes=(16,))
    assert "head sizes" in narrow.why_not("cpu", "float32", head_size=32)
    assert "block sizes" in narrow.why_not("cpu", "float32", head_size=64, block_size=4)
    assert narrow.why_not("cpu", "float32", head_size=128, block_size=16) is None


def test_the_selector_and_the_deploy_config_refuse_with_the_same_declared_rule(monkeypatch):
    why = CAPABILITIES["fused"].why_not("cpu", "bfloat16")
    with pytest.raises(ValueError, match=f"attention_backend 'fused' is not usable: {why}"):
        select_backend("fused", "cpu", torch.bfloat16)
    with pytest.raises(ConfigError, match=f"model.attention_backend: {why}"):
        DeployConfig.from_dict({"model": {"attention_backend": "fused", "dtype": "bfloat16"}})
    assert select_backend("auto", "cpu", torch.bfloat16) == "torch"
    assert select_backend("torch", "cpu", torch.float16) == "torch"
    with pytest.raises(ValueError, match="must be one of"):
        select_backend("flash", "cpu", torch.float32)
    with pytest.raises(ValueError, match="must be one of"):
        EngineConfig(attention_backend="flash")


def test_layer_views_are_bound_once_over_the_pool_and_writes_land_where_documented():
    layout = KVLayout(HYBRID, 4)
    pool = PagePool(12, layout.page_size_bytes, shareable=False)
    kv = layout.bind(pool)
    assert len(kv.layers) == HYBRID.num_layers
    assert len({id(layer.k._base) for layer in kv.layers} | {id(kv.token_rows._base)}) == 1  # one base
    storage = pool.buffer.untyped_storage().data_ptr()
    assert all(layer.cache.untyped_storage().data_ptr() == storage for layer in kv.layers)
    backend = TorchPagedBackend(kv)
    builder = StepInputBuilder(layout, "cpu")
    chunk = ScheduledChunk("r", [5, 6, 7, 8, 9, 10], 0, ([3, 4], [5, 6]), True)
    metadata = builder.build([chunk])
    backend.prepare(metadata)
    h, d = layout.num_kv_heads, layout.head_dim
    for i, layer in enumerate(kv.layers):
        k, v = torch.randn(6, h, d), torch.randn(6, h, d)
        backend.write_kv(k, v, i, metadata)
        blocks = chunk.block_ids[layer.group]
        for t in range(6):
            block, offset = blocks[t // 4], t % 4
            assert torch.equal(layer.k[block, offset], k[t]) and torch.equal(layer.v[block, offset], v[t])
            assert torch.equal(layer.cache[block, 0, offset], k[t])
            row = block * kv.rows_per_page + layer.first_row + offset
            assert torch.equal(kv.token_rows[row].view(h, d), k[t])
    assert not pool.buffer[0].any()  # the null block stays untouched
