"""Checkpoints written by transformers itself (Llama, Qwen2, Mistral): pdkv's engine gives
transformers' greedy tokens and logits; settings pdkv does not implement are refused, naming the field."""
import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is needed to write the reference checkpoints")

from kvcache.audit import assert_all_free
from pd.engine.model.checkpoint import CheckpointError, load_checkpoint, load_config
from pd.engine.config import EngineConfig
from pd.engine.model.config import ModelConfig
from pd.engine.engine import Engine
from pd.engine.sample.params import SamplingParams

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
PROMPTS = {"long": [(7 * i + 3) % 96 for i in range(37)], "short": [5, 11, 2], "mid": [(i * i) % 96 for i in range(19)]}
NEW_TOKENS = 16

CASES = {
    "llama-theta1e6-headdim16": lambda: transformers.LlamaConfig(
        **TINY, num_hidden_layers=3, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "llama-tied": lambda: transformers.LlamaConfig(**TINY, num_hidden_layers=2, tie_word_embeddings=True),
    "qwen2-max-window-layers": lambda: transformers.Qwen2Config(
        **TINY, num_hidden_layers=4, use_sliding_window=True, sliding_window=6, max_window_layers=2,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen2-layer-types": lambda: transformers.Qwen2Config(
        **TINY, num_hidden_layers=3, use_sliding_window=True, sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "qwen2-window-off": lambda: transformers.Qwen2Config(
        **TINY, num_hidden_layers=2, use_sliding_window=False, sliding_window=4, max_window_layers=0),
    "mistral-sliding": lambda: transformers.MistralConfig(**TINY, num_hidden_layers=3, sliding_window=7, head_dim=8),
}
EXPECTED_LAYERS = {
    "qwen2-max-window-layers": (("full_attention",) * 2 + ("sliding_attention",) * 2, 6),
    "qwen2-layer-types": (("sliding_attention", "full_attention", "sliding_attention"), 5),
    "qwen2-window-off": (("full_attention",) * 2, None),
    "mistral-sliding": (("sliding_attention",) * 3, 7),
}


def _hf_model(hf_config, dtype=torch.float32):
    """transformers' model with O(1)-spread random weights (its default init gives near-tied logits)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            elif "embed_tokens" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[1]))
    return model.to(dtype).eval()


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("case", sorted(CASES))
def test_transformers_checkpoint_same_tokens_and_logits(tmp_path, case):
    hf_model = _hf_model(CASES[case]())
    hf_model.save_pretrained(tmp_path)
    cfg = load_config(tmp_path)
    if case in EXPECTED_LAYERS:
        assert (cfg.resolved_layer_types, cfg.sliding_window) == EXPECTED_LAYERS[case]
    assert cfg.rope_theta == hf_model.config.rope_parameters["rope_theta"]
    assert cfg.tie_word_embeddings == bool(hf_model.config.tie_word_embeddings)

    engine = Engine(EngineConfig(model_path=str(tmp_path), block_size=4, num_blocks=256))
    got = engine.generate_sync(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert_all_free(engine.kv_cache_manager)
    for rid, prompt in PROMPTS.items():
        assert got[rid] == _hf_greedy(hf_model, prompt), rid
        full = prompt + got[rid]
        with torch.no_grad():
            want = hf_model(torch.tensor([full])).logits[0].float()
        # float32 rounding through the layers: BLAS kernels differ by CPU (an AVX-512 Xeon's MKL path lands
        # 1.07e-5 from transformers on qwen2-max-window-layers, the same code elsewhere under 1e-5)
        torch.testing.assert_close(engine.runner.model.reference_logits(full), want, atol=3e-5, rtol=0)


def test_legacy_rope_theta_and_rope_scaling_default(tmp_path):
    hf_model = _hf_model(transformers.LlamaConfig(**TINY, num_hidden_layers=2,
                                                  rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    hf_model.save_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    del hf["rope_parameters"]
    hf.update(rope_theta=5e5, rope_scaling={"type": "default"})  # transformers 4 style
    (tmp_path / "config.json").write_text(json.dumps(hf))
    model = load_checkpoint(tmp_path)
    assert model.config.rope_theta == 5e5
    with torch.no_grad():
        want = hf_model(torch.tensor([PROMPTS["long"]])).logits[0]
    torch.testing.assert_close(model.reference_logits(PROMPTS["long"]), want, atol=1e-5, rtol=0)


def test_the_callers_dtype_wins(tmp_path):
    _hf_model(transformers.LlamaConfig(**TINY, num_hidden_layers=1), dtype=torch.bfloat16).save_pretrained(tmp_path)
    assert load_config(tmp_path).dtype == "bfloat16"  # the file's, when the caller names none
    engine = Engine(EngineConfig(dtype="float32", model_path=str(tmp_path), num_blocks=16))  # what model.dtype sets
    assert engine.runner.model.lm_head.weight.dtype == torch.float32
    assert engine.model_config.dtype == "float32"
    engine.shutdown()


REFUSED = {
    "rope-linear": ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
                    r"rope_parameters\.rope_type: 'linear'"),
    "rope-yarn": ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                       "original_max_position_embeddings": 512}}, r"rope_parameters\.rope_type: 'yarn'"),
    "rope-llama3": ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192}},
                    r"rope_parameters\.rope_type: 'llama3'"),
    "rope-scaling-legacy": ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
                            r"rope_scaling\.rope_type: 'dynamic'"),
    "partial-rotary": ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
                       r"rope_parameters\.partial_rotary_factor"),
    "theta-disagrees": ({"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
                        r"rope_parameters\.rope_theta"),
    "architecture": ({"architectures": ["GemmaForCausalLM"]}, r"architectures: \['GemmaForCausalLM'\]"),
    "two-architectures": ({"architectures": ["LlamaForCausalLM", "MistralForCausalLM"]}, r"architectures"),
    "model-type": ({"model_type": "gemma"}, r"model_type: 'gemma'"),
    "activation": ({"hidden_act": "gelu"}, r"hidden_act: 'gelu'"),
    "mlp-bias": ({"mlp_bias": True}, r"mlp_bias"),
    "llama-attention-bias": ({"attention_bias": True}, r"attention_bias"),
    "quantized": ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, r"quantization_config"),
    "missing-field": ({"hidden_size": None}, r"hidden_size: missing"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unimplemented_settings_are_refused_at_startup(tmp_path, case):
    edit, message = REFUSED[case]
    _hf_model(transformers.LlamaConfig(**TINY, num_hidden_layers=1)).save_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    hf.update(edit)
    hf = {k: v for k, v in hf.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=message):
        Engine(EngineConfig(model_path=str(tmp_path), num_blocks=16))


def test_qwen2_sliding_layer_types_without_the_switch_are_refused(tmp_path):
    _hf_model(transformers.Qwen2Config(**TINY, num_hidden_layers=2)).save_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    hf.update(use_sliding_window=False, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match="layer_types.*use_sliding_window"):
        load_config(tmp_path)
