"""The torch attention backend: K/V live in pages, requests reach them through block tables.

Each step, `prepare` turns the step metadata (attention/metadata.py) into a plan: per KV cache
group the rows each new token's K/V goes to, and per attention sub-batch the gathered block tables
and masks. Decode tokens (one query each) are batched in a few sub-batches of similar context length
so padding stays small. Each prefill chunk is its own sub-batch, so padding never grows with the
longest prompt of the step; a chunk that starts at position 0 attends to its own fresh K/V directly.

Sliding-window groups gather only the blocks that can fall inside the window
(the evicted ones hold the null block 0 and would be masked anyway).

`plan` and `attend` take the sequences to plan and an output to fill, so that a backend which attends
some of a step's tokens with its own kernel plans the others here (the CPU's, pd/engine/cpu/).
"""
from __future__ import annotations

import dataclasses

import torch

from pd.engine.attention.capabilities import CAPABILITIES, BackendCapabilities
from pd.engine.attention.metadata import StepMetadata
from pd.engine.kv.layout import BoundKV
from pd.engine.model.layer_ops import TORCH_OPS, LayerOps
from pd.engine.model.llama import masked_attention


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
    device once."""

    capabilities: BackendCapabilities = CAPABILITIES["torch"]
    layer_ops: LayerOps = TORCH_OPS

    def __init__(self, kv: BoundKV):
        self.kv = kv
        self.layout = kv.layout
        self.workspace = Workspace()
        self.sub_batches: list[_SubBatch] = []
        self.slot_rows: list[torch.Tensor] = []
        self._identity = False

    @property
    def description(self) -> str:
        return "torch"

    def prepare(self, metadata: StepMetadata) -> None:
        self.plan(metadata, [i for i, n in enumerate(metadata.host.query_lens) if n == 1])

    def plan(self, metadata: StepMetadata, decode: list[int]) -> None:
        """Plans the step's K/V writes, the decode sequences `decode` (chunk indices) in sub-batches of
        similar context length and every prompt chunk (more than one token) in its own."""
        host = metadata.host
        starts, counts = list(host.starts), list(host.query_lens)
        # Row of each new token's K in slot 0 of its group; a layer adds its `first_row` (V: one more bs).
        self.slot_rows = [blocks * self.kv.rows_per_page + metadata.slot_offsets for blocks in metadata.slot_blocks]
        first_token = host.query_start_loc[:-1]
        tables = list(host.block_tables)
        self.sub_batches = []
        decode = sorted(decode, key=lambda i: -starts[i])
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
        self._identity = (len(self.sub_batches) == 1 and self.sub_batches[0].valid is None
                          and bool((self.sub_batches[0].out_index == torch.arange(num_tokens)).all()))
        device = self.kv.token_rows.device
        if device.type != "cpu":  # the plan is made on the host; the pages live on the device
            for sb in self.sub_batches:
                sb.q_index, sb.out_index = sb.q_index.to(device), sb.out_index.to(device)
                sb.valid = None if sb.valid is None else sb.valid.to(device)
                for gb in sb.groups:
                    gb.table, gb.mask = gb.table.to(device), gb.mask.to(device)
                    gb.unwritten = None if gb.unwritten is None else gb.unwritten.to(device)

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
        lkv = self.kv.layers[layer]
        rows = self.slot_rows[lkv.group] + lkv.first_row
        token_rows = self.kv.token_rows
        width = token_rows.shape[1]
        token_rows.index_copy_(0, rows, k.reshape(-1, width).to(token_rows.dtype))
        token_rows.index_copy_(0, rows + self.layout.block_size, v.reshape(-1, width).to(token_rows.dtype))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                metadata: StepMetadata) -> torch.Tensor:
        """Writes the step's K/V, then reads them back through the pages with the context."""
        self.write_kv(k, v, layer, metadata)
        return self.attend(q, k, v, layer, None)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
               out: torch.Tensor | None) -> torch.Tensor:
        """Attention of the planned sub-batches' queries, written into `out` (None: a new tensor, or q
        itself when the plan covers the step's tokens in order); the step's K/V are in the pages."""
        lkv = self.kv.layers[layer]
        g = lkv.group
        bs = self.layout.block_size
        k_rows, v_rows = lkv.k_rows, lkv.v_rows
        h, d = k.shape[1], k.shape[2]
        identity = out is None and self._identity
        if out is None:
            out = q if identity else torch.empty_like(q)
        for sb in self.sub_batches:
            gb = sb.groups[g]
            if sb.fresh is not None:
                lo, hi = sb.fresh
                mask = None if lkv.window is None else gb.mask[:, :, : hi - lo]
                res = masked_attention(q[None, lo:hi], k[None, lo:hi], v[None, lo:hi], mask, causal=True)
                if identity:
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
            if identity:
                return res.reshape(q.shape)
            out[sb.out_index] = res[sb.valid] if sb.valid is not None else res.reshape(-1, *q.shape[1:])
        return out
