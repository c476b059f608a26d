"""Sharded layers (pd/engine/parallel/layers.py) against the unsharded computation: real gloo gangs of
2 ranks (2 KV heads split) and 4 ranks (2 KV heads, each replicated on 2 ranks) run an attention
block (q/k/v column-parallel with biases, causal attention over the rank's heads, o_proj row-parallel
with a bias added once) and a SwiGLU MLP on their slices of the same random float32 weights; every
rank's output must match the full model's (atol 1e-5). The slicing rule itself is checked without
processes: the ranks' slices put back together are the full weights."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.helpers.tp_gang import Gang

from pd.engine.parallel.layers import (AttentionWeights, MLPWeights, attention_slices, column_parallel_linear,
                                       mlp_forward, row_parallel_linear, shard_attention, shard_mlp)
from pd.engine.parallel.tp import TPShape

HIDDEN, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, INTERMEDIATE, TOKENS = 32, 8, 4, 2, 64, 7


def _weights(seed: int = 0) -> tuple[torch.Tensor, AttentionWeights, MLPWeights]:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    q_out, kv_out = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    attn = AttentionWeights(q=rand(q_out, HIDDEN), k=rand(kv_out, HIDDEN), v=rand(kv_out, HIDDEN),
                            o=rand(HIDDEN, q_out), q_bias=rand(q_out), k_bias=rand(kv_out), v_bias=rand(kv_out),
                            o_bias=rand(HIDDEN))
    mlp = MLPWeights(gate=rand(INTERMEDIATE, HIDDEN), up=rand(INTERMEDIATE, HIDDEN), down=rand(HIDDEN, INTERMEDIATE))
    return torch.randn(TOKENS, HIDDEN, generator=g), attn, mlp


def _attention(x: torch.Tensor, w: AttentionWeights, group=None) -> torch.Tensor:
    """Causal attention over whatever heads these weights hold (all, or one rank's)."""
    q = column_parallel_linear(x, w.q, w.q_bias).view(TOKENS, -1, HEAD_DIM).transpose(0, 1)
    k = column_parallel_linear(x, w.k, w.k_bias).view(TOKENS, -1, HEAD_DIM).transpose(0, 1)
    v = column_parallel_linear(x, w.v, w.v_bias).view(TOKENS, -1, HEAD_DIM).transpose(0, 1)
    group_size = q.shape[0] // k.shape[0]  # query heads per KV head, the same on every rank
    k, v = k.repeat_interleave(group_size, 0), v.repeat_interleave(group_size, 0)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(TOKENS, -1)
    return row_parallel_linear(out, w.o, group, w.o_bias)


def _sharded_block(group) -> dict:
    x, attn, mlp = _weights()
    shape = TPShape(group.world_size, NUM_KV_HEADS, NUM_HEADS)
    mine = shard_attention(attn, shape, HEAD_DIM, group.rank)
    h = x + _attention(x, mine, group)
    out = h + mlp_forward(h, shard_mlp(mlp, group.rank, group.world_size), group)
    return {"attention": (h - x).tolist(), "block": out.tolist(), "k_rows": mine.k.shape[0]}


@pytest.mark.timeout(150)  # spawning ranks imports torch: slow on a busy box, never stuck
@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_attention_and_mlp_match_the_full_model(tp):
    x, attn, mlp = _weights()
    want_attention = _attention(x, attn)
    h = x + want_attention
    want_block = h + mlp_forward(h, mlp)
    with Gang(tp, _sharded_block, timeout_s=10.0) as gang:
        replies = gang.results()
    assert all("result" in r for r in replies), replies
    for r in replies:
        res = r["result"]
        assert res["k_rows"] == max(1, NUM_KV_HEADS // tp) * HEAD_DIM
        torch.testing.assert_close(torch.tensor(res["attention"]), want_attention, atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(res["block"]), want_block, atol=1e-5, rtol=0)
    assert gang.all_ended()


@pytest.mark.parametrize(("tp", "num_kv_heads"), [(1, 2), (2, 2), (4, 2), (4, 4), (2, 1)])
def test_the_slices_put_back_together_are_the_full_weights(tp, num_kv_heads):
    g = torch.Generator().manual_seed(1)
    kv_out = num_kv_heads * HEAD_DIM
    full = AttentionWeights(q=torch.randn(NUM_HEADS * HEAD_DIM, HIDDEN, generator=g),
                            k=torch.randn(kv_out, HIDDEN, generator=g), v=torch.randn(kv_out, HIDDEN, generator=g),
                            o=torch.randn(HIDDEN, NUM_HEADS * HEAD_DIM, generator=g))
    shape = TPShape(tp, num_kv_heads, NUM_HEADS)
    ranks = [shard_attention(full, shape, HEAD_DIM, r) for r in range(tp)]
    assert torch.equal(torch.cat([w.q for w in ranks]), full.q)
    assert torch.equal(torch.cat([w.o for w in ranks], dim=1), full.o)
    primaries = [w.k for r, w in enumerate(ranks) if shape.is_primary(r)]
    assert torch.equal(torch.cat(primaries), full.k)
    for r, w in enumerate(ranks):  # a replica holds exactly its primary's KV rows
        assert torch.equal(w.v, ranks[shape.primary_owner(shape.heads_of(r).start)].v)
        assert w.q.untyped_storage().data_ptr() != full.q.untyped_storage().data_ptr()  # a copy, not a view
        assert attention_slices(shape, HEAD_DIM, r)["o_bias"] is None  # the row-parallel bias is never split
    mlp = MLPWeights(gate=torch.randn(INTERMEDIATE, HIDDEN, generator=g),
                     up=torch.randn(INTERMEDIATE, HIDDEN, generator=g),
                     down=torch.randn(HIDDEN, INTERMEDIATE, generator=g))
    parts = [shard_mlp(mlp, r, tp) for r in range(tp)]
    assert torch.equal(torch.cat([p.gate for p in parts]), mlp.gate)
    assert torch.equal(torch.cat([p.down for p in parts], dim=1), mlp.down)


def test_weights_that_do_not_split_are_refused():
    _, attn, mlp = _weights()
    with pytest.raises(ValueError, match="TP 3 does not divide the MLP's intermediate size"):
        shard_mlp(mlp, 0, 3)
    with pytest.raises(ValueError, match=r"k has shape \(16, 32\), the model's shape needs \(32, 32\)"):
        shard_attention(attn, TPShape(2, 4, NUM_HEADS), HEAD_DIM, 0)
    with pytest.raises(ValueError, match="decode TP 8 and 4 query heads"):
        TPShape(8, 2, NUM_HEADS, role="decode")
