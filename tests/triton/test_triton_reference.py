"""Anchors for the kernels' torch reference: the model's own attention and the pool's documented rows.

`masked_attention` (pd/engine/model/llama.py) over a sequence's contiguous K/V,
with the causal and window masks `DenseAttention` builds, is what a paged
layer must compute; `BoundKV.token_rows` (`KVLayout.bind`) documents where a token's K/V live in
the pool. The reference (and through test_triton_kernels.py the Triton kernels)
must agree with both.
"""
from __future__ import annotations

import pytest
import torch

from pd.engine.attention.triton_kv_write import write_kv
from pd.engine.attention.triton_reference import paged_decode_reference, paged_prefill_reference
from pd.engine.model.llama import masked_attention
from triton_cases import DEVICE, make_case, step_tensors


@pytest.mark.parametrize("window", [None, 5, 23])
@pytest.mark.parametrize("group", [1, 3])
def test_triton_reference_matches_dense_masked_attention(window, group):
    """A 40-token sequence written into shuffled pages, its last 9 tokens as a chunk and its last as decode."""
    length, chunk = 40, 9
    case = make_case(2, group, 64, "float32", 4, window, steps=[(0, length)], seed=11, drop_evicted=False)
    layer = 1 if window else 0
    bound = case.layout.bind(case.pool).layers[layer]
    g, k_cache, v_cache = bound.group, bound.k, bound.v
    meta = step_tensors(case, g)
    write_kv(case.k, case.v, k_cache, v_cache, meta.slot_mapping)
    pos = torch.arange(length, device=DEVICE)
    delta = pos[:, None] - pos[None, :]
    mask = (delta >= 0) & (delta < window if window else True)
    dense = masked_attention(case.q[None], case.k[None], case.v[None], mask[None])[0]
    scale = 64 ** -0.5
    starts = torch.tensor([0, chunk], device=DEVICE)
    got = paged_prefill_reference(case.q[-chunk:], k_cache, v_cache, meta.block_table, meta.seq_lens, starts, scale,
                                  window)
    torch.testing.assert_close(got, dense[-chunk:], atol=2e-5, rtol=2e-5)
    got = paged_decode_reference(case.q[-1:], k_cache, v_cache, meta.block_table, meta.seq_lens, scale, window)
    torch.testing.assert_close(got, dense[-1:], atol=2e-5, rtol=2e-5)


def test_triton_kv_write_lands_in_the_documented_token_rows():
    """Token at (block b, offset o) of layer slot s: K at row b * rows_per_page + 2 * s * bs + o, V one bs later."""
    case = make_case(2, 2, 64, "bfloat16", 5, 7, steps=[(3, 4), (11, 1)], seed=2)
    layout = case.layout
    rows = layout.bind(case.pool).token_rows
    for layer in range(2):
        bound = layout.bind(case.pool).layers[layer]
        g, slot, k_cache, v_cache = bound.group, bound.slot, bound.k, bound.v
        meta = step_tensors(case, g)
        write_kv(case.k, case.v, k_cache, v_cache, meta.slot_mapping)
        bs = layout.block_size
        block, offset = meta.slot_mapping // bs, meta.slot_mapping % bs
        k_rows = block * layout.rows_per_page + 2 * slot * bs + offset
        assert torch.equal(rows[k_rows], case.k.reshape(case.k.shape[0], -1))
        assert torch.equal(rows[k_rows + bs], case.v.reshape(case.v.shape[0], -1))
