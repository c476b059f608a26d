"""q|k|v and gate|up as one fused linear each: the per-projection names stay (views, no copies), the state
dict keeps Hugging Face's names both ways, and a layer runs one GEMM for each fused pair."""
import dataclasses

import torch

from pd.engine.model.config import ModelConfig
from pd.engine.model.llama import build_model

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, attention_bias=True, bos_token_id=None, eos_token_id=None)


def test_projection_views_read_the_fused_weights_without_copies():
    model = build_model(CFG, seed=1)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    fused = attn.qkv_proj.weight
    parts = [attn.q_proj, attn.k_proj, attn.v_proj]
    assert [p.weight.shape[0] for p in parts] == [32, 16, 16]
    assert all(p.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr() for p in parts)
    assert torch.equal(torch.cat([p.weight for p in parts]), fused)
    assert torch.equal(torch.cat([p.bias for p in parts]), attn.qkv_proj.bias)
    x = torch.randn(3, 32)
    torch.testing.assert_close(torch.cat([p(x) for p in parts], dim=1), attn.qkv_proj(x))
    assert torch.equal(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.gate_up_proj.weight)
    names = {name for name, _ in model.named_parameters()}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names


def test_state_dict_keeps_hf_names_and_loads_back_into_the_fused_weights():
    model = build_model(CFG, seed=1)
    state = model.state_dict()
    assert "model.layers.1.self_attn.k_proj.bias" in state and "model.layers.1.mlp.up_proj.weight" in state
    assert not any("qkv_proj" in k or "gate_up_proj" in k for k in state)
    other = build_model(dataclasses.replace(CFG), seed=2)
    assert not torch.equal(other.model.layers[1].self_attn.qkv_proj.weight,
                           model.model.layers[1].self_attn.qkv_proj.weight)
    missing, unexpected = other.load_state_dict(state, strict=True)
    assert not missing and not unexpected
    for name, value in other.state_dict().items():
        assert torch.equal(value, state[name]), name
    ids = list(range(10))
    torch.testing.assert_close(other.reference_logits(ids), model.reference_logits(ids), atol=0, rtol=0)
