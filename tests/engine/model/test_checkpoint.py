"""HF-layout checkpoints written by the tests load back to the same logits; bad ones fail clearly."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pd.engine.model.checkpoint import CheckpointError, load_checkpoint, load_config, save_checkpoint
from pd.engine.model.config import ModelConfig
from pd.engine.model.llama import build_model

PROMPT = [5, 77, 200, 13, 9, 41, 41, 3]


@pytest.mark.parametrize("cfg", [
    ModelConfig(num_layers=2),
    ModelConfig(num_layers=3, layer_types=("full_attention", "sliding_attention", "sliding_attention"), sliding_window=4),
    ModelConfig(num_layers=2, attention_bias=True, architecture="Qwen2ForCausalLM", tie_word_embeddings=True),
    ModelConfig(num_layers=2, layer_types=("sliding_attention",) * 2, sliding_window=5, architecture="MistralForCausalLM"),
], ids=["llama", "hybrid", "qwen2-tied", "mistral"])
def test_roundtrip_same_logits(tmp_path, cfg):
    model = build_model(cfg, seed=4)
    save_checkpoint(model, tmp_path)
    loaded = load_checkpoint(tmp_path)
    assert loaded.config.to_hf_dict() == model.config.to_hf_dict()
    assert torch.equal(loaded.reference_logits(PROMPT), model.reference_logits(PROMPT))


def test_sharded_checkpoint_loads(tmp_path):
    model = build_model(ModelConfig(num_layers=2), seed=4)
    files = save_checkpoint(model, tmp_path, max_shard_bytes=30_000)
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    assert torch.equal(load_checkpoint(tmp_path).reference_logits(PROMPT), model.reference_logits(PROMPT))


def test_dtype_override(tmp_path):
    save_checkpoint(build_model(ModelConfig(num_layers=1), seed=1), tmp_path)
    assert load_checkpoint(tmp_path, dtype="bfloat16").lm_head.weight.dtype == torch.bfloat16


def _edit(tmp_path, fn):
    save_checkpoint(build_model(ModelConfig(num_layers=2), seed=1), tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))


def test_unknown_tensor_is_named(tmp_path):
    _edit(tmp_path, lambda t: t.update({"model.layers.0.self_attn.mystery.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match="unknown tensors.*mystery"):
        load_checkpoint(tmp_path)


def test_missing_tensor_is_named(tmp_path):
    _edit(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors.*layers\.1\.mlp\.up_proj"):
        load_checkpoint(tmp_path)


def test_misshaped_tensor_is_named(tmp_path):
    _edit(tmp_path, lambda t: t.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(CheckpointError, match=r"mis-shaped.*model\.norm\.weight.*\(3,\)"):
        load_checkpoint(tmp_path)


def test_missing_files(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(ModelConfig().to_hf_dict()))
    with pytest.raises(CheckpointError, match="safetensors"):
        load_checkpoint(tmp_path)


def test_unsupported_rope_scaling(tmp_path):
    hf = ModelConfig().to_hf_dict()
    hf["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match="rope_scaling"):
        load_config(tmp_path)


def test_engine_serves_a_checkpoint_directory(tmp_path):
    from kvcache.audit import assert_all_free
    from tests.helpers.engine_cases import HYBRID_MODEL, engine_config

    from pd.engine.config import EngineConfig
    from pd.engine.engine import Engine
    from pd.engine.sample.params import SamplingParams

    cfg = engine_config(HYBRID_MODEL)
    in_memory = Engine(cfg)
    save_checkpoint(in_memory.runner.model, tmp_path)
    loaded = Engine(EngineConfig(model_path=str(tmp_path), block_size=cfg.block_size, num_blocks=cfg.num_blocks))
    assert loaded.model_config.to_hf_dict() == HYBRID_MODEL.to_hf_dict()
    prompts = {"a": list(range(40)), "b": [9, 8, 7]}
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    assert loaded.generate_sync(prompts, params) == in_memory.generate_sync(prompts, params)
    assert_all_free(loaded.kv_cache_manager)
    assert_all_free(in_memory.kv_cache_manager)
