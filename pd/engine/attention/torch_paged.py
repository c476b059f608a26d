"""Paged attention on torch: K/V live in pages, requests reach them through block tables.

One `PagedAttention` object serves one engine step. Built once from the
step's sequences, it holds per KV cache group the slot mapping (where each new
token's K/V goes) and per attention sub-batch the gathered block tables and
masks. Decode tokens (one query each) are batched: either all of them through
the fused C++ kernel (pd/engine/cpu/kernels.py), or in a few sub-batches of similar
context length so padding stays small. Each prefill chunk is its own
sub-batch, so padding never grows with the longest prompt of the step; a
chunk that starts at position 0 attends to its own fresh K/V directly.

Sliding-window groups gather only the blocks that can fall inside the window
(the evicted ones hold the null block 0 and would be masked anyway).
"""
from __future__ import annotations

import dataclasses

import torch

from pd.engine.cpu import kernels as cpu_kernels
from pd.engine.kv.layout import KVLayout
from pd.engine.model.llama import masked_attention


@dataclasses.dataclass(frozen=True)
class SeqSlice:
    """The tokens one request computes this step: positions [start, start + num_tokens)."""

    start: int
    num_tokens: int
    block_ids: tuple[list[int], ...]  # per KV cache group, the request's whole block table


@dataclasses.dataclass
class _GroupBatch:
    table: torch.Tensor  # (B * num_gathered_blocks,) block ids, null-padded, row-major
    mask: torch.Tensor  # (B, Lq, num_gathered_blocks * block_size) bool
    # (B, S) True where the gathered slot holds no token of the request (block tail, padding); None if
    # there is none. Those slots are zeroed after the gather: masked weights are 0, but 0 * NaN is NaN.
    unwritten: torch.Tensor | None = None


@dataclasses.dataclass
class _SubBatch:
    q_index: torch.Tensor  # (B, Lq) flat token index of each query (padding repeats a valid index)
    out_index: torch.Tensor  # (N,) flat index of each real query, in (B, Lq) row-major order
    valid: torch.Tensor | None  # (B, Lq) bool; None when there is no padding
    groups: list[_GroupBatch]
    # A prompt chunk starting at position 0 ([first, last) of the step's tokens): its keys are exactly
    # this step's K/V, so attention runs on them directly, without reading the pages back.
    fresh: tuple[int, int] | None = None


@dataclasses.dataclass
class _FusedDecode:
    """Decode tokens handled by the fused kernel: no gather, no padding."""

    token_index: torch.Tensor  # (B,) flat index of each decode token
    key_end: torch.Tensor  # (B,) context length including the new token
    groups: list[tuple[torch.Tensor, torch.Tensor]]  # per group: (block table (B, W), first key position (B,))


class Workspace:
    """Reusable scratch buffers for gathered K/V.

    Fresh multi-megabyte tensors cost page faults on every allocation (the
    allocator hands big blocks back to the OS); reusing one buffer per name
    makes the per-layer gather a plain copy. Buffers only grow.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = 1
        for dim in shape:
            numel *= dim
        buf = self._buffers.get((name, dtype))
        if buf is None or buf.numel() < numel or buf.device != device:
            buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
            self._buffers[(name, dtype)] = buf
        return buf[:numel].view(shape)


# Decode requests are grouped by context length so that padding stays below this factor.
DECODE_BUCKET_RATIO = 2.0


class PagedAttention:
    """AttentionBackend over a page pool for one step's batch of sequences."""

    def __init__(self, layout: KVLayout, group_views: list[torch.Tensor], seqs: list[SeqSlice],
                 token_rows: torch.Tensor, workspace: Workspace | None = None, fused_decode: bool = False):
        self.layout = layout
        self.group_views = group_views
        self.workspace = workspace or Workspace()
        # Per group, each block's K and V of one layer as rows: (num_blocks, layers * 2, bs * H * D).
        self.group_rows = [v.reshape(v.shape[0], v.shape[1] * 2, -1) for v in group_views]
        self.token_rows = token_rows  # the pool as rows of one token's K or V (see KVLayout.token_rows)
        bs = layout.block_size
        starts = [s.start for s in seqs]
        counts = [s.num_tokens for s in seqs]
        self.num_tokens = sum(counts)
        seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(counts))
        first_token = torch.tensor([0] + counts[:-1]).cumsum(0)
        self.positions = (torch.tensor(starts)[seq_of_token]
                          + (torch.arange(self.num_tokens) - first_token[seq_of_token]))
        # Per group: the request's block table as a padded matrix, and the slot of every new token.
        self.slot_blocks: list[torch.Tensor] = []
        self.slot_offsets = self.positions % bs
        tables = []
        for g in range(len(layout.groups)):
            width = max(len(s.block_ids[g]) for s in seqs)
            table = torch.tensor([s.block_ids[g] + [0] * (width - len(s.block_ids[g])) for s in seqs], dtype=torch.long)
            tables.append(table)
            self.slot_blocks.append(table[seq_of_token, self.positions // bs])
        for g, blocks in enumerate(self.slot_blocks):
            if bool((blocks == 0).any()):
                raise ValueError(f"group {g}: a new token maps to the null block (block table too short)")
        # Row of each new token's K in slot 0 of its group; layer slot s adds 2*s*bs (V: one more bs).
        self.slot_rows = [blocks * layout.rows_per_page + self.slot_offsets for blocks in self.slot_blocks]
        self.sub_batches: list[_SubBatch] = []
        decode = sorted((i for i, n in enumerate(counts) if n == 1), key=lambda i: -starts[i])
        self.fused: _FusedDecode | None = None
        if fused_decode and decode:
            self.fused = self._build_fused(decode, starts, tables, first_token)
            decode = []
        while decode:
            longest = starts[decode[0]] + 1
            bucket = [i for i in decode if (starts[i] + 1) * DECODE_BUCKET_RATIO >= longest]
            decode = decode[len(bucket):]
            self.sub_batches.append(self._build(bucket, seqs, tables, first_token))
        for i, n in enumerate(counts):
            if n > 1:
                self.sub_batches.append(self._build([i], seqs, tables, first_token))
        # One sub-batch whose queries are exactly the step's tokens in order: no scatter needed.
        self._identity = (self.fused is None and len(self.sub_batches) == 1 and self.sub_batches[0].valid is None
                          and bool((self.sub_batches[0].out_index == torch.arange(self.num_tokens)).all()))
        device = token_rows.device
        if device.type != "cpu":  # metadata is built on the CPU; the pages may live elsewhere
            self.slot_rows = [r.to(device) for r in self.slot_rows]
            for sb in self.sub_batches:
                sb.q_index, sb.out_index = sb.q_index.to(device), sb.out_index.to(device)
                sb.valid = None if sb.valid is None else sb.valid.to(device)
                for gb in sb.groups:
                    gb.table, gb.mask = gb.table.to(device), gb.mask.to(device)
                    gb.unwritten = None if gb.unwritten is None else gb.unwritten.to(device)

    def _build_fused(self, members: list[int], starts: list[int], tables: list[torch.Tensor],
                     first_token: torch.Tensor) -> _FusedDecode:
        idx = torch.tensor(members)
        key_end = torch.tensor([starts[i] + 1 for i in members])
        per_group = []
        for g, grp in enumerate(self.layout.groups):
            key_start = torch.zeros_like(key_end) if grp.window is None else torch.clamp(key_end - grp.window, min=0)
            per_group.append((tables[g][idx].contiguous(), key_start))
        return _FusedDecode(token_index=first_token[idx], key_end=key_end, groups=per_group)

    def _build(self, members: list[int], seqs: list[SeqSlice], tables: list[torch.Tensor],
               first_token: torch.Tensor) -> _SubBatch:
        bs = self.layout.block_size
        idx = torch.tensor(members)
        lq = max(seqs[i].num_tokens for i in members)
        counts = torch.tensor([seqs[i].num_tokens for i in members])
        starts = torch.tensor([seqs[i].start for i in members])
        ar = torch.arange(lq)
        valid = ar[None, :] < counts[:, None]
        q_pos = starts[:, None] + torch.minimum(ar[None, :], counts[:, None] - 1)
        q_index = first_token[idx][:, None] + torch.minimum(ar[None, :], counts[:, None] - 1)
        ends = starts + counts  # context length after this step
        groups = []
        for g, grp in enumerate(self.layout.groups):
            if grp.window is None:
                first_block = torch.zeros_like(starts)
            else:
                first_block = torch.clamp(starts - grp.window + 1, min=0) // bs
            last_block = (ends + bs - 1) // bs  # exclusive
            width = int((last_block - first_block).max())
            cols = first_block[:, None] + torch.arange(width)[None, :]
            in_range = cols < last_block[:, None]
            table = tables[g][idx[:, None], torch.clamp(cols, max=tables[g].shape[1] - 1)]
            table = torch.where(in_range, table, torch.zeros_like(table))
            k_pos = (first_block[:, None] * bs + torch.arange(width * bs)[None, :])  # (B, S)
            delta = q_pos[:, :, None] - k_pos[:, None, :]
            mask = delta >= 0
            if grp.window is not None:
                mask &= delta < grp.window
            unwritten = k_pos >= ends[:, None]
            groups.append(_GroupBatch(table=table.flatten(), mask=mask,
                                      unwritten=unwritten[:, :, None] if bool(unwritten.any()) else None))
        padded = not bool(valid.all())
        fresh = None
        if len(members) == 1 and int(starts[0]) == 0:
            first = int(first_token[members[0]])
            fresh = (first, first + int(counts[0]))
        return _SubBatch(q_index=q_index, out_index=q_index[valid], valid=valid if padded else None, groups=groups,
                         fresh=fresh)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        g, slot = self.layout.layer_to_group[layer_idx]
        layer_cache = self.group_views[g][:, slot]  # (num_blocks, 2, bs, H, D)
        # Write first, then read: the new tokens attend to themselves through the pages.
        bs = self.layout.block_size
        rows = self.slot_rows[g] + 2 * slot * bs
        width = self.token_rows.shape[1]
        self.token_rows.index_copy_(0, rows, k.reshape(-1, width).to(self.token_rows.dtype))
        self.token_rows.index_copy_(0, rows + bs, v.reshape(-1, width).to(self.token_rows.dtype))
        k_rows = self.group_rows[g][:, 2 * slot]
        v_rows = self.group_rows[g][:, 2 * slot + 1]
        h, d = k.shape[1], k.shape[2]
        out = q if self._identity else torch.empty_like(q)
        if self.fused is not None:
            table, key_start = self.fused.groups[g]
            out[self.fused.token_index] = cpu_kernels.paged_decode_attention(
                q[self.fused.token_index], layer_cache, table, key_start, self.fused.key_end, d ** -0.5)
        for sb in self.sub_batches:
            gb = sb.groups[g]
            if sb.fresh is not None:
                lo, hi = sb.fresh
                window = self.layout.groups[g].window
                mask = None if window is None else gb.mask[:, :, : hi - lo]
                res = masked_attention(q[None, lo:hi], k[None, lo:hi], v[None, lo:hi], mask, causal=True)
                if self._identity:
                    return res.reshape(q.shape)
                out[lo:hi] = res[0]
                continue
            b = sb.q_index.shape[0]
            n = gb.table.shape[0]
            keys = self.workspace.take("k", (n, k_rows.shape[1]), k_rows.dtype, k_rows.device)
            values = self.workspace.take("v", (n, v_rows.shape[1]), v_rows.dtype, v_rows.device)
            torch.index_select(k_rows, 0, gb.table, out=keys)
            torch.index_select(v_rows, 0, gb.table, out=values)
            s_len = n // b * bs
            if gb.unwritten is not None:  # defence in depth: stale bytes there must not reach the sums
                keys.view(b, s_len, -1).masked_fill_(gb.unwritten, 0.0)
                values.view(b, s_len, -1).masked_fill_(gb.unwritten, 0.0)
            res = masked_attention(q[sb.q_index], keys.view(b, s_len, h, d), values.view(b, s_len, h, d), gb.mask)
            if self._identity:
                return res.reshape(q.shape)
            out[sb.out_index] = res[sb.valid] if sb.valid is not None else res.reshape(-1, *q.shape[1:])
        return out
