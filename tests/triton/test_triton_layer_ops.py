"""The Triton layer ops (pd/engine/attention/triton_ops.py) against their torch reference
(pd/engine/model/layer_ops.py): residual add + RMSNorm, RoPE of q and k in place inside the fused q|k|v
output, SiLU-and-mul. Interpreted on the CPU (tests/conftest.py sets TRITON_INTERPRET=1), compiled
where CUDA is. Sizes cover the supported models' head sizes (64, 128), GQA groups and odd widths that
need masking."""
from __future__ import annotations

import pytest
import torch
from triton_cases import DEVICE

from pd.engine.attention.triton_ops import TRITON_OPS
from pd.engine.model.layer_ops import TORCH_OPS
from pd.engine.model.llama import RotaryEmbedding

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _randn(*shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


# Triton 3.9's interpreter rounds float32 -> bfloat16 toward zero (a GPU rounds to nearest), so under it a
# bfloat16 result may be one more rounding step off; float16 conversions round to nearest in both.
BF16_EXACT = DEVICE.type == "cuda"
RTOL = {torch.float32: 1e-5, torch.float16: 2 ** -9, torch.bfloat16: 2 ** -7 if BF16_EXACT else 2 ** -6}


def _close(got, want):
    # one rounding step of the dtype apart at most (float32 sums in another order); under the interpreter,
    # bfloat16's truncations add up where a sum cancels: two steps of the largest element's
    atol = 1e-5 if want.dtype != torch.bfloat16 or BF16_EXACT else 2 ** -6 * want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=RTOL[want.dtype], atol=atol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, hidden", [(1, 64), (5, 96), (3, 576)])
def test_rms_norm_and_add_rms_norm_match_the_reference(dtype, rows, hidden):
    x = _randn(rows, hidden, dtype=dtype, seed=1) * 3
    residual = _randn(rows, hidden, dtype=dtype, seed=2)
    weight = 1 + _randn(hidden, dtype=dtype, seed=3) * 0.1
    _close(TRITON_OPS.rms_norm(x, weight, 1e-5), TORCH_OPS.rms_norm(x, weight, 1e-5))
    got, got_total = TRITON_OPS.add_rms_norm(x, residual, weight, 1e-6)
    want, want_total = TORCH_OPS.add_rms_norm(x, residual, weight, 1e-6)
    if dtype != torch.bfloat16 or BF16_EXACT:
        assert torch.equal(got_total, want_total)  # the stream: one rounding of the same sum
    _close(got_total, want_total)
    _close(got, want)
    # rows of a wider buffer (a strided view) read as the same rows
    wide = torch.cat([x, x], dim=1)[:, :hidden]
    _close(TRITON_OPS.rms_norm(wide, weight, 1e-5), TORCH_OPS.rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 1, 64), (14, 2, 64), (8, 8, 128), (6, 3, 32)])
def test_rope_rotates_q_and_k_in_place_inside_the_fused_qkv(dtype, heads, kv_heads, head_dim):
    tokens = 7
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=4)
    before = qkv.clone()
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q = qkv[:, :q_size].view(tokens, heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(tokens, kv_heads, head_dim)
    positions = torch.tensor([0, 1, 2, 17, 300, 4095, 9], device=DEVICE)
    rotary = RotaryEmbedding(head_dim, 1e4).to(DEVICE)
    cos, sin = rotary.cos_sin(positions, dtype)
    want_q, want_k = TORCH_OPS.rope(q.clone(), k.clone(), cos, sin)
    got_q, got_k = TRITON_OPS.rope(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    _close(got_q, want_q)
    _close(got_k, want_k)
    assert torch.equal(qkv[:, q_size + kv_size:], before[:, q_size + kv_size:])  # v untouched
    assert not torch.equal(qkv[1:, :q_size], before[1:, :q_size])  # (position 0 is the identity)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, inter", [(1, 64), (4, 1536), (3, 2500)])
def test_silu_and_mul_matches_the_reference(dtype, rows, inter):
    gate_up = _randn(rows, 2 * inter, dtype=dtype, seed=5) * 4
    got = TRITON_OPS.silu_and_mul(gate_up)
    assert got.shape == (rows, inter) and got.dtype == dtype
    _close(got, TORCH_OPS.silu_and_mul(gate_up))


def test_bad_shapes_are_refused_with_a_clear_error():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="residual"):
        TRITON_OPS.add_rms_norm(x, torch.zeros(3, 8, device=DEVICE), torch.ones(8, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="odd"):
        TRITON_OPS.silu_and_mul(torch.zeros(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="rope"):
        TRITON_OPS.rope(torch.zeros(2, 2, 8, device=DEVICE), torch.zeros(2, 1, 6, device=DEVICE),
                        torch.zeros(2, 1, 8, device=DEVICE), torch.zeros(2, 1, 8, device=DEVICE))
