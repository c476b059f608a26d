"""The torch attention backend: K/V live in pages, requests reach them through block tables.

Each step, `prepare` turns the step metadata (attention/metadata.py) into a plan: per KV cache
group the rows each new token's K/V goes to, and per attention sub-batch the gathered block tables
and masks. Decode tokens (one query each) are batched: either all of them through a kernel (the CPU
backend's C++ paged decode, `decode_in_kernel`), or in a few sub-batches of similar context length
so padding stays small. Each prefill chunk is its own
sub-batch, so padding never grows with the longest prompt of the step; a
chunk that starts at position 0 attends to its own fresh K/V directly.

Sliding-window groups gather only the blocks that can fall inside the window
(the evicted ones hold the null block 0 and would be masked anyway).
"""
from __future__ import annotations

import dataclasses

import torch

from pd.engine.attention.metadata import StepMetadata
from pd.engine.kv.layout import KVLayout
from pd.engine.kv.page_pool import PagePool
from pd.engine.model.llama import CausalLM, masked_attention


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


class TorchPagedBackend:
    """The reference attention backend, in torch: K/V written into pages with `index_copy_`, read back
    through block tables by gather, attention by `masked_attention` (see the module docstring).

    Its per-step plan (`prepare`) groups decode tokens into sub-batches of similar context length and
    gives each prompt chunk its own; it is made on the host from `metadata.host`, then moved to the
    device once. The model it runs is the engine's model, unchanged."""

    name = "torch"
    # decode tokens through the C++ paged-decode kernel instead of torch sub-batches (the CPU backend)
    decode_in_kernel = False

    def __init__(self, model: CausalLM, layout: KVLayout, page_pool: PagePool):
        self.model = model
        self.layout = layout
        self.group_views = layout.group_views(page_pool)
        self.workspace = Workspace()
        # Per group, each block's K and V of one layer as rows: (num_blocks, layers * 2, bs * H * D).
        self.group_rows = [v.reshape(v.shape[0], v.shape[1] * 2, -1) for v in self.group_views]
        self.token_rows = layout.token_rows(page_pool)  # the pool as rows of one token's K or V
        self.sub_batches: list[_SubBatch] = []
        self.fused: _FusedDecode | None = None
        self.slot_rows: list[torch.Tensor] = []
        self._identity = False

    @property
    def description(self) -> str:
        return "torch"

    def run_step(self, metadata: StepMetadata) -> torch.Tensor | None:
        return None

    def greedy_tokens(self, hidden: torch.Tensor, num_ids: int) -> list[int | None]:
        return [None] * hidden.shape[0]

    def prepare(self, metadata: StepMetadata) -> None:
        layout = self.layout
        host = metadata.host
        starts, counts = list(host.starts), list(host.query_lens)
        # Row of each new token's K in slot 0 of its group; layer slot s adds 2*s*bs (V: one more bs).
        self.slot_rows = [blocks * layout.rows_per_page + metadata.slot_offsets for blocks in metadata.slot_blocks]
        first_token = host.query_start_loc[:-1]
        tables = list(host.block_tables)
        self.sub_batches = []
        self.fused = None
        decode = sorted((i for i, n in enumerate(counts) if n == 1), key=lambda i: -starts[i])
        if self.decode_in_kernel and decode:
            self.fused = self._build_fused(decode, starts, tables, first_token)
            decode = []
        while decode:
            longest = starts[decode[0]] + 1
            bucket = [i for i in decode if (starts[i] + 1) * DECODE_BUCKET_RATIO >= longest]
            decode = decode[len(bucket):]
            self.sub_batches.append(self._build(bucket, starts, counts, tables, first_token))
        for i, n in enumerate(counts):
            if n > 1:
                self.sub_batches.append(self._build([i], starts, counts, tables, first_token))
        # One sub-batch whose queries are exactly the step's tokens in order: no scatter needed.
        num_tokens = metadata.num_tokens
        self._identity = (self.fused is None and len(self.sub_batches) == 1 and self.sub_batches[0].valid is None
                          and bool((self.sub_batches[0].out_index == torch.arange(num_tokens)).all()))
        device = self.token_rows.device
        if device.type != "cpu":  # the plan is made on the host; the pages live on the device
            for sb in self.sub_batches:
                sb.q_index, sb.out_index = sb.q_index.to(device), sb.out_index.to(device)
                sb.valid = None if sb.valid is None else sb.valid.to(device)
                for gb in sb.groups:
                    gb.table, gb.mask = gb.table.to(device), gb.mask.to(device)
                    gb.unwritten = None if gb.unwritten is None else gb.unwritten.to(device)

    def kernel_decode(self, q: torch.Tensor, layer_cache: torch.Tensor, table: torch.Tensor, key_start: torch.Tensor,
                      key_end: torch.Tensor, scale: float) -> torch.Tensor:
        """Decode queries (B, Hq, D) over keys [key_start, key_end) of their block tables, where
        `decode_in_kernel` is set (a subclass's kernel)."""
        raise NotImplementedError

    def _build_fused(self, members: list[int], starts: list[int], tables: list[torch.Tensor],
                     first_token: torch.Tensor) -> _FusedDecode:
        idx = torch.tensor(members)
        key_end = torch.tensor([starts[i] + 1 for i in members])
        per_group = []
        for g, grp in enumerate(self.layout.groups):
            key_start = torch.zeros_like(key_end) if grp.window is None else torch.clamp(key_end - grp.window, min=0)
            per_group.append((tables[g][idx].contiguous(), key_start))
        return _FusedDecode(token_index=first_token[idx], key_end=key_end, groups=per_group)

    def _build(self, members: list[int], seq_starts: list[int], seq_counts: list[int], tables: list[torch.Tensor],
               first_token: torch.Tensor) -> _SubBatch:
        bs = self.layout.block_size
        idx = torch.tensor(members)
        lq = max(seq_counts[i] for i in members)
        counts = torch.tensor([seq_counts[i] for i in members])
        starts = torch.tensor([seq_starts[i] for i in members])
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

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, layer: int, metadata: StepMetadata) -> None:
        g, slot = self.layout.layer_to_group[layer]
        bs = self.layout.block_size
        rows = self.slot_rows[g] + 2 * slot * bs
        width = self.token_rows.shape[1]
        self.token_rows.index_copy_(0, rows, k.reshape(-1, width).to(self.token_rows.dtype))
        self.token_rows.index_copy_(0, rows + bs, v.reshape(-1, width).to(self.token_rows.dtype))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                metadata: StepMetadata) -> torch.Tensor:
        """Writes the step's K/V, then reads them back through the pages with the context."""
        self.write_kv(k, v, layer, metadata)
        g, slot = self.layout.layer_to_group[layer]
        layer_cache = self.group_views[g][:, slot]  # (num_blocks, 2, bs, H, D)
        bs = self.layout.block_size
        k_rows = self.group_rows[g][:, 2 * slot]
        v_rows = self.group_rows[g][:, 2 * slot + 1]
        h, d = k.shape[1], k.shape[2]
        out = q if self._identity else torch.empty_like(q)
        if self.fused is not None:
            table, key_start = self.fused.groups[g]
            out[self.fused.token_index] = self.kernel_decode(
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
