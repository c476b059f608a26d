"""Online audit of transferred KV: D recomputes the last pulled full block of a sampled request's prompt
and compares it with what P sent.

Why the last block is enough: its K/V at every layer depend only on its own tokens and on the prefix's
K/V, which D received. Recomputed over the received prefix, the block reproduces P's bytes iff P
computed it the way D would, so a P with another kernel, dtype or a layout bug (well-formed bytes that
pass the connector's checksums, which prove only that the bytes arrived as sent) shows up here.

How (`KVAuditor`), on the engine's step thread:
- `on_load_landed(state)` (from the scheduler, as a finished load is promoted, before any forward of
  the request): a sampled request (`EngineConfig.kv_audit_rate`, decided by a hash of its id, so a
  rate of 1 audits every one) gets a ticket holding a copy of the received pages of its last pulled
  full block and the ids of the prefix blocks before it. The copy matters: a prompt that ends on a
  block boundary recomputes its last token locally, into that block;
- `run_pending(alive)` (the engine calls it at the end of the step, after the step's outputs went out:
  the request is never held back for it): for each ticket whose request still holds the same prefix
  blocks, one internal chunk of the block's tokens runs through the model runner with a block table of
  the received prefix blocks (by reference, read only) and a scratch block taken from the pool for the
  block itself. The scratch block is never hashed, so it never enters the prefix cache, and it goes back
  to the pool in a `finally`. A request aborted or failed before its ticket runs is skipped, never
  computed over pages that may have moved on.

Comparison (`compare`): at `EngineConfig.kv_audit_tolerance` 0, bitwise: right where P and D run the
same batch-invariant kernels and dtype (the torch backend on small models). Otherwise each layer's K and
V may differ by the tolerance relative to their largest |value| in the block: kernels that pick their
tiling by the number of rows (the fused CPU GEMMs, cuBLAS, Triton) round P's whole-prompt prefill and
D's one-block recompute differently in the last bits (1e-6 relative in float32), while wrong KV differs
by orders of magnitude more. Each result is
counted (`stats()`: checked, mismatched, skipped, errors, worst difference) and logged with P's engine
id, D's and the request; a mismatch names the first layer and K or V that differ.

Also here, the fault plan's way to make P send well-formed wrong KV (`perturb_prompt_chunks`): a
prompt marked `perturb_kv` (`pd.engine.step_isolation.PERTURB_KV`) gets its first layer's K shifted at
the positions each of its prefill chunks wrote, after that chunk's forward and before the connector
seals and sends them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from kvcache import KVCacheManager
from pd.engine.kv.layout import KVLayout
from pd.engine.kv.page_pool import PagePool
from pd.engine.sched.output import ScheduledChunk

logger = logging.getLogger(__name__)

# The tolerance where none is set (`kv_audit_tolerance: null`), by KV dtype: comfortably above the worst rounding
# difference measured between P's prefill and D's recompute of SmolLM2-135M (float32, fused CPU kernels:
# 1.2e-6; bfloat16, torch: 0.025), below a 0.5 shift of one layer's K (0.066 relative and up).
DEFAULT_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-4, torch.bfloat16: 0.05, torch.float16: 0.05}
PERTURBATION = 0.5  # added to every element of the perturbed K: finite, well-formed, and far from P's bytes
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def sampled(request_id: str, rate: float) -> bool:
    """Whether a request is audited at this rate: a hash of its id, so the same id always decides alike."""
    if rate <= 0.0:
        return False
    if rate >= 1.0:
        return True
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64 < rate


@dataclasses.dataclass(frozen=True)
class AuditTicket:
    """One sampled request's audit: block `block_index` of its prompt, as received."""

    request_id: str
    prefill_engine: str  # P's engine id (from the request's kv_transfer_params)
    block_index: int
    token_ids: list[int]  # the block's tokens
    prefix_block_ids: tuple[list[int], ...]  # per group: the blocks before it (received or local hits)
    received: tuple[torch.Tensor, ...]  # per group: a copy of the block's page as it landed


@dataclasses.dataclass(frozen=True)
class AuditResult:
    match: bool
    max_rel_diff: float  # of the worst layer's K or V, relative to its largest |value|; inf where a NaN differs
    first_diff: str  # "layer L K|V" of the first differing layer, "" on a match


class KVAuditor:
    """Samples landed loads and checks their last full block (see the module docstring).

    Guarantees: never raises into the step (an error while auditing is counted and logged); every
    scratch block it takes is back in the pool when `run_pending` returns; it never hashes, caches or
    writes a block that a request holds; with rate 0 it does nothing at all.
    """

    def __init__(self, rate: float, tolerance: float | None, engine_id: str, layout: KVLayout, page_pool: PagePool,
                 kv_cache_manager: KVCacheManager, forward: Callable[[list[ScheduledChunk]], object]):
        self.rate = rate
        self.tolerance = DEFAULT_TOLERANCE.get(layout.dtype, 0.05) if tolerance is None else tolerance
        self.engine_id = engine_id
        self.layout = layout
        self.page_pool = page_pool
        self.mgr = kv_cache_manager
        self._forward = forward  # runs chunks through the model (their K/V land in their blocks)
        self._views: list[torch.Tensor] | None = None
        self._pending: list[AuditTicket] = []
        self.num_checked = 0
        self.num_mismatched = 0
        self.num_skipped = 0
        self.num_errors = 0
        self.worst_diff = 0.0
        self.seconds = 0.0

    @property
    def enabled(self) -> bool:
        return self.rate > 0.0

    def views(self) -> list[torch.Tensor]:
        if self._views is None:
            kv = self.layout.bind(self.page_pool)
            self._views = [kv.group_pages(g) for g in range(len(self.layout.groups))]
        return self._views

    # ------------------------------------------------------------------ D: sample and check
    def on_load_landed(self, state) -> None:
        """A request's async load landed (its pages verified); takes a ticket if it is sampled."""
        req = state.request
        if not self.enabled or not sampled(req.request_id, self.rate):
            return
        bs = self.layout.block_size
        num_local = state.num_cached_tokens or 0
        end = num_local + state.num_external_tokens
        j = min(end, req.num_prompt_tokens) // bs - 1
        if j < 0 or (j + 1) * bs <= num_local:  # no full block of the prompt was pulled
            self.num_skipped += 1
            return
        ids = self.mgr.get_block_ids(req.request_id)
        if any(len(g) <= j or g[j] == 0 for g in ids):
            self.num_skipped += 1
            return
        views = self.views()
        received = tuple(views[g][ids[g][j]].clone() for g in range(len(ids)))
        params = req.kv_transfer_params
        prefill_engine = str(getattr(params, "remote_engine_id", None) or "?")
        tokens = list(req.all_token_ids[j * bs:(j + 1) * bs])
        self._pending.append(AuditTicket(req.request_id, prefill_engine, j, tokens, tuple(list(g[:j]) for g in ids),
                                         received))

    def run_pending(self, alive: Mapping[str, object]) -> None:
        """Checks the tickets taken this step (`alive`: the scheduler's live requests by id)."""
        if not self._pending:
            return
        tickets, self._pending = self._pending, []
        for ticket in tickets:
            t0 = time.perf_counter()
            try:
                self._check(ticket, alive)
            except Exception:  # noqa: BLE001 - an audit never fails a step or a request
                self.num_errors += 1
                logger.exception("KV audit of request %s (P %s, D %s) failed", ticket.request_id,
                                 ticket.prefill_engine, self.engine_id)
            self.seconds += time.perf_counter() - t0

    def _check(self, ticket: AuditTicket, alive: Mapping[str, object]) -> None:
        j = ticket.block_index
        held = self.mgr.get_block_ids(ticket.request_id) if ticket.request_id in alive else ()
        if len(held) != len(ticket.prefix_block_ids) or any(list(h[:j]) != p for h, p in
                                                            zip(held, ticket.prefix_block_ids, strict=True)):
            self.num_skipped += 1  # aborted, failed or reset meanwhile: its prefix pages may have moved on
            logger.debug("KV audit of request %s skipped: it no longer holds its prefix", ticket.request_id)
            return
        pool = self.mgr.block_pool
        if pool.get_num_free_blocks() < len(held):
            self.num_skipped += 1
            logger.debug("KV audit of request %s skipped: no free block for the recompute", ticket.request_id)
            return
        scratch = pool.get_new_blocks(len(held))  # one per group; never hashed, so never cached
        try:
            bs = self.layout.block_size
            table = tuple(p + [blk.block_id] for p, blk in zip(ticket.prefix_block_ids, scratch, strict=True))
            self._forward([ScheduledChunk(f"kv-audit:{ticket.request_id}", ticket.token_ids, j * bs, table, False)])
            views = self.views()
            result = compare([views[g][blk.block_id] for g, blk in enumerate(scratch)], ticket.received,
                             self.tolerance, [grp.layer_indices for grp in self.layout.groups])
        finally:
            pool.free_blocks(scratch)
        self._record(ticket, result)

    def _record(self, ticket: AuditTicket, result: AuditResult) -> None:
        self.num_checked += 1
        if not math.isnan(result.max_rel_diff):
            self.worst_diff = max(self.worst_diff, result.max_rel_diff)
        if result.match:
            logger.info("KV audit: request %s from P %s on D %s: block %d matches "
                        "(max relative |diff| %g, tolerance %g)",
                        ticket.request_id, ticket.prefill_engine, self.engine_id, ticket.block_index,
                        result.max_rel_diff, self.tolerance)
            return
        self.num_mismatched += 1
        logger.warning("KV audit MISMATCH: request %s from P %s on D %s: block %d differs from D's recompute "
                       "(first at %s, max relative |diff| %g, tolerance %g): P computed this KV differently",
                       ticket.request_id, ticket.prefill_engine, self.engine_id, ticket.block_index, result.first_diff,
                       result.max_rel_diff, self.tolerance)

    def stats(self) -> dict[str, float | int]:
        return {"kv_audit_checked": self.num_checked, "kv_audit_mismatched": self.num_mismatched,
                "kv_audit_skipped": self.num_skipped, "kv_audit_errors": self.num_errors,
                "kv_audit_worst_diff": self.worst_diff, "kv_audit_seconds": round(self.seconds, 6)}

    # ------------------------------------------------------------------ P: the fault plan's wrong KV
    def perturb_prompt_chunks(self, chunks: Sequence[ScheduledChunk], num_prompt_tokens: Mapping[str, int],
                              marked: Callable[[str], bool]) -> None:
        """Shifts the first layer's K at the prompt positions each marked chunk just wrote (every chunk of a
        chunked or streamed prefill, each before the connector publishes it)."""
        bs = self.layout.block_size
        for chunk in chunks:
            end = min(chunk.start + len(chunk.token_ids), num_prompt_tokens.get(chunk.request_id, 0))
            if end <= chunk.start or not marked(chunk.request_id):
                continue
            table = chunk.block_ids[0]
            positions = [pos for pos in range(chunk.start, end) if table[pos // bs]]
            if not positions:
                continue
            device = self.page_pool.device
            blocks = torch.tensor([table[pos // bs] for pos in positions], dtype=torch.long, device=device)
            offsets = torch.tensor([pos % bs for pos in positions], dtype=torch.long, device=device)
            view = self.views()[0]
            view[blocks, 0, 0, offsets] = view[blocks, 0, 0, offsets] + PERTURBATION
            logger.warning("fault injection: perturbed layer %d K of %d prompt position(s) of request %s on %s",
                           self.layout.groups[0].layer_indices[0], len(positions), chunk.request_id, self.engine_id)


def compare(recomputed: Sequence[torch.Tensor], received: Sequence[torch.Tensor], tolerance: float,
            layers: Sequence[Sequence[int]]) -> AuditResult:
    """Per group, pages of shape (layers, 2, block, heads, dim). Tolerance 0: bitwise. Else each layer's K
    (and V) may differ by at most `tolerance` times its largest |value| in the received block: a relative
    bound, since K and V magnitudes differ by model and layer while rounding errors scale with them."""
    worst, first = 0.0, ""
    bitwise = True
    for g, (a, b) in enumerate(zip(recomputed, received, strict=True)):
        as_int = _SAME_SIZE_INT[a.element_size()]
        same_bits = torch.equal(a.view(as_int), b.view(as_int))
        bitwise = bitwise and same_bits
        if same_bits:
            continue
        diff = (a.float() - b.float()).abs().flatten(2).amax(dim=2)  # (layers, 2): max |diff| per K and V
        scale = b.float().abs().flatten(2).amax(dim=2).clamp_min(1e-30)
        rel = diff / scale
        rel = torch.where(torch.isfinite(rel), rel, torch.full_like(rel, math.inf))  # a NaN differs by inf
        worst = max(worst, float(rel.max()))
        if not first:
            over = (rel > tolerance).nonzero()
            slot, kv = (over[0].tolist() if len(over) else (rel > 0).nonzero()[0].tolist())
            first = f"layer {layers[g][slot]} {'KV'[kv]}"
    match = bitwise or (tolerance > 0 and worst <= tolerance)
    return AuditResult(match, worst, "" if match else first)
