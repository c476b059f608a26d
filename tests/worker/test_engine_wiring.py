"""From deploy config to engine: the attention backend knob, the serving dtype of a checkpoint,
and the prompt tokens a request did not compute itself (`num_cached_tokens`)."""
from __future__ import annotations

import os

import pytest
import torch
from kvcache.audit import assert_all_free
from tests.helpers.engine_cases import FULL_MODEL, engine_config

from pd.cluster.config import ConfigError, DeployConfig
from pd.cluster.roles import Role
from pd.engine.cpu import kernels as cpu_kernels
from pd.engine.model.checkpoint import save_checkpoint
from pd.engine.engine import Engine
from pd.engine.model.llama import build_model
from pd.engine.sample.params import SamplingParams
from pd.worker.wiring import build_engine, engine_config_for
from pd.worker.worker import WorkerSpec

ARCH = {"vocab_size": 260, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4,
        "num_kv_heads": 2}
SECRET = "wiring-test-secret-0123456789"
HAS_KERNEL = cpu_kernels.load() is not None


def _colocated(**model) -> WorkerSpec:
    config = DeployConfig.from_dict({"model": {"architecture": ARCH, **model},
                                     "cache": {"block_size": 4, "kv_memory_mb": 1},
                                     "topology": {"mode": "colocated"}})
    return WorkerSpec("w", Role.BOTH, config, SECRET)


@pytest.mark.skipif(not HAS_KERNEL, reason="C++ toolchain unavailable")
def test_attention_backend_auto_is_fused_where_valid_and_matches_torch():
    assert DeployConfig().model.attention_backend == "auto"
    prompt = list(range(3, 30))
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    tokens = {}
    for backend in ("auto", "torch", "fused"):
        spec = _colocated(attention_backend=backend)
        assert engine_config_for(spec).attention_backend == backend
        engine, connector = build_engine(spec)
        assert connector is None
        assert engine.runner.backend.capabilities.name == ("torch" if backend == "torch" else "fused")
        tokens[backend] = engine.generate_sync({"r": prompt}, greedy)["r"]
        assert_all_free(engine.kv_cache_manager)
    assert tokens["auto"] == tokens["fused"] == tokens["torch"]


def test_attention_backend_auto_falls_back_and_fused_is_refused_where_invalid():
    engine = Engine(engine_config(FULL_MODEL, attention_backend="auto", dtype="bfloat16", num_blocks=64))
    assert engine.runner.backend.capabilities.name == "torch" and engine.layout.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="attention_backend 'fused' is not usable: .*float32"):
        Engine(engine_config(FULL_MODEL, attention_backend="fused", dtype="bfloat16", num_blocks=64))
    # the deploy config refuses what it can judge without the worker's machine: dtype and device
    with pytest.raises(ConfigError, match="model.attention_backend: 'fused' runs float32; here the dtype is float16"):
        DeployConfig.from_dict({"model": {"attention_backend": "fused", "dtype": "float16"}})
    with pytest.raises(ConfigError, match="model.attention_backend: 'fused' runs on cpu; here the device is cuda"):
        DeployConfig.from_dict({"model": {"attention_backend": "fused"}, "topology": {"device": "cuda"}})
    with pytest.raises(ConfigError, match=r"model.attention_backend: must be one of 'auto', 'torch', 'fused' or "
                                          r"'triton'"):
        DeployConfig.from_dict({"model": {"attention_backend": "flash"}})


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="a CPU worker runs Triton only interpreted "
                    "(the root conftest sets TRITON_INTERPRET=1 where CUDA is absent)")
def test_triton_backend_and_cuda_graphs_pass_through_the_deploy_config(monkeypatch):
    """model.attention_backend 'triton' and model.cuda_graphs reach the engine; on the CPU 'triton' needs
    Triton's interpreter (the suite sets TRITON_INTERPRET=1 where CUDA is absent)."""
    assert DeployConfig().model.cuda_graphs is True
    spec = _colocated(attention_backend="triton", cuda_graphs=False)
    config = engine_config_for(spec)
    assert (config.attention_backend, config.cuda_graphs) == ("triton", False)
    engine, _ = build_engine(spec)
    assert engine.runner.backend.capabilities.name == "triton" and not engine.runner.graphs.enabled
    assert engine.generate_sync({"r": [3, 4, 5]}, SamplingParams(max_tokens=2, ignore_eos=True))["r"]
    assert_all_free(engine.kv_cache_manager)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="model.attention_backend: 'triton' runs on cuda .*interpreter.*; here the "
                                          "device is cpu"):
        DeployConfig.from_dict({"model": {"attention_backend": "triton"}})


def test_model_dtype_is_honoured_for_a_checkpoint(tmp_path):
    model = build_model(FULL_MODEL, seed=5)  # stored in float32
    save_checkpoint(model, tmp_path)
    from tokenizers import Tokenizer, models  # a worker serves a checkpoint with its own tokenizer

    Tokenizer(models.WordLevel({f"t{i}": i for i in range(FULL_MODEL.vocab_size)}, unk_token="t0")).save(
        str(tmp_path / "tokenizer.json"))
    for role, mode in ((Role.BOTH, "colocated"), (Role.DECODE, "disaggregated")):
        config = DeployConfig.from_dict({"model": {"path": str(tmp_path), "dtype": "bfloat16"},
                                         "cache": {"block_size": 4, "kv_memory_mb": 1},
                                         "topology": {"mode": mode}})
        engine, connector = build_engine(WorkerSpec("w", role, config, SECRET))
        try:
            assert engine.model_config.dtype == "bfloat16" and engine.layout.dtype == torch.bfloat16
            assert {p.dtype for p in engine.runner.model.parameters()} == {torch.bfloat16}
            assert engine.runner.backend.capabilities.name == "torch"  # auto: the kernel is float32 only
            if connector is not None:  # peers of another dtype are refused by the handshake
                assert connector.config.model_id.endswith("|bfloat16|{}")
            out = engine.generate_sync({"r": [1, 2, 3, 4, 5]}, SamplingParams(max_tokens=3, ignore_eos=True))
            assert len(out["r"]) == 3
            assert_all_free(engine.kv_cache_manager)
        finally:
            engine.shutdown()


def test_num_cached_tokens_counts_the_prefix_cache_hit():
    engine = Engine(engine_config(FULL_MODEL, num_blocks=64))  # block_size 4
    prompt = list(range(3, 23))  # 20 tokens: 5 full blocks
    greedy = SamplingParams(max_tokens=3, ignore_eos=True)
    first = _outputs(engine, "a", prompt, greedy)
    assert {o.num_cached_tokens for o in first} == {0}
    second = _outputs(engine, "b", prompt + [40, 41], greedy)
    # 5 cached blocks = 20 tokens (the whole first prompt)
    assert {o.num_cached_tokens for o in second} == {20}
    assert [t for o in second for t in o.new_token_ids] != []
    assert_all_free(engine.kv_cache_manager)


def _outputs(engine: Engine, rid: str, prompt: list[int], params: SamplingParams) -> list:
    engine.add_request(rid, prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(o for o in engine.step() if o.request_id == rid)
    return outs
