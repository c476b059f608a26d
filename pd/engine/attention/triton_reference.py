"""The Triton kernels' semantics in plain torch, with the same arguments: the reference they are
tested against, and a path that `torch.compile(fullgraph=True)` can trace (no host synchronisation,
no data-dependent shapes), for checking a decode forward on the CPU.

Window semantics are those of `pd.engine.model.llama.DenseAttention`: a query at position p sees
keys at positions k with 0 <= p - k < window (the query itself included). Keys at positions the
sequence has not written are never used, whatever the page holds there: gathered K/V of masked
positions are zeroed before the product (a masked weight is 0, but 0 * NaN is NaN). These
functions gather whole block tables, so they cost memory in proportion to the table width; they
are references, not a fast path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """As `triton_kv_write.write_kv`: rows of k, v (T, Hkv, D) to slots (block * block_size + row; < 0 = skip)."""
    t = k.shape[0]
    slots = slot_mapping[:t].long()
    keep = slots >= 0
    safe = torch.clamp(slots, min=0)
    block, row = safe // k_cache.shape[1], safe % k_cache.shape[1]
    # a skipped row writes back what its (clamped) slot holds: no host sync to drop it
    k_cache[block, row] = torch.where(keep[:, None, None], k.to(k_cache.dtype), k_cache[block, row])
    v_cache[block, row] = torch.where(keep[:, None, None], v.to(v_cache.dtype), v_cache[block, row])


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: torch.Tensor,
            scale: float) -> torch.Tensor:
    """q (R, Hq, D) over keys/values (R, S, Hkv, D) where seen (R, S); rows that see nothing give 0."""
    keys = torch.where(seen[:, :, None, None], keys, torch.zeros((), dtype=keys.dtype, device=keys.device))
    values = torch.where(seen[:, :, None, None], values, torch.zeros((), dtype=values.dtype, device=values.device))
    anything = seen.any(dim=1)
    mask = seen | ~anything[:, None]  # a row that sees no key attends to zeros, then is zeroed below
    out = F.scaled_dot_product_attention(q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=mask[:, None, None, :], scale=scale,
                                         enable_gqa=q.shape[1] != keys.shape[2])
    return torch.where(anything[:, None, None], out[:, :, 0, :], torch.zeros((), dtype=out.dtype, device=out.device))


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """(R, W) block ids -> (R, W * block_size, Hkv, D) keys or values in position order."""
    rows, width = tables.shape
    return cache[tables.long()].reshape(rows, width * cache.shape[1], cache.shape[2], cache.shape[3])


def paged_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """As `triton_decode.paged_decode`: q (B, Hq, D), one query per sequence at position seq_lens - 1."""
    b = q.shape[0]
    tables = block_table[:b]
    lens = seq_lens[:b].long()
    k_pos = torch.arange(tables.shape[1] * k_cache.shape[1], device=q.device)
    seen = k_pos[None, :] < lens[:, None]
    if window:
        seen &= k_pos[None, :] >= lens[:, None] - window
    return _attend(q, _gather(k_cache, tables), _gather(v_cache, tables), seen, scale).to(q.dtype)


def paged_prefill_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                            seq_lens: torch.Tensor, query_start: torch.Tensor, scale: float,
                            window: int | None = None) -> torch.Tensor:
    """As `triton_prefill.paged_prefill`: chunks back to back in q (T, Hq, D), `query_start` (B + 1,)."""
    t = q.shape[0]
    starts = query_start.long()
    token = torch.arange(t, device=q.device)
    seq = torch.searchsorted(starts[1:], token, right=True)  # the chunk each token belongs to
    q_pos = seq_lens.long()[seq] - (starts[1:][seq] - token)
    tables = block_table[seq]
    k_pos = torch.arange(tables.shape[1] * k_cache.shape[1], device=q.device)
    delta = q_pos[:, None] - k_pos[None, :]
    seen = delta >= 0
    if window:
        seen &= delta < window
    return _attend(q, _gather(k_cache, tables), _gather(v_cache, tables), seen, scale).to(q.dtype)
