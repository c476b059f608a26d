"""Sampling a whole batch on the logits' device, with one device-to-host copy a step.

`BatchedSampler.sample(logits, params, rngs)` picks one token per row of a
(B, vocab) logits tensor wherever it lives, with the semantics of
`sample/sampler.py`: greedy rows take the argmax (nan counts as the lowest
score, ties the lowest id); the others are temperature-scaled from the row's
maximum, then top-k, then top-p filtered as `filter_logits` does (in float32
rather than its float64: the same tokens kept but where a running mass lands
within float32 rounding of top_p; the top token always kept), and drawn.
Top-k takes one `torch.topk`, not a sort. A top-p row looks for its nucleus among
its 64 largest scores first (a `torch.topk`, and a sort of those 64 only): a
peaked row is settled there, with the whole-row sort's kept tokens; a row whose
nucleus reaches past them is drawn again with 8x as many, then sorted whole
(`_nucleus_of_top`, `_nucleus_sorted`).
Its temporaries stay within `SAMPLER_BYTES_PER_LOGIT` bytes per drawn logit,
what the GPU memory plan reserves (pd/cluster/gpu_share.py). A row whose
logits are not all finite is sampled greedily and logged. Ids at or above
`num_ids` (the tokenizer's vocabulary) are never returned. The only host
synchronisation is the single copy of the chosen tokens (with their fallback
and settled flags) at the end, and one more for each redraw of a wide nucleus.

Draws use the Gumbel-max trick with counter-based noise: the noise of row r
for token t is a hash of (the request's seed, how many tokens it has drawn,
t), turned into a uniform in (0, 1). So a request's draws depend only on its
seed and its logits, never on its batch neighbours, its row, or the device;
`RowRng` keeps a request's seed and draw count. (The draws differ from
`sampler.py`'s torch.Generator streams for the same seed: the guarantee is
reproducibility, not the same numbers.)
"""
from __future__ import annotations

import dataclasses
import logging
import secrets

import torch

from pd.engine.sample.params import MIN_TEMPERATURE, SamplingParams

logger = logging.getLogger(__name__)

_M32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # < 2**27: a 32-bit value times it stays inside int64
_GOLDEN = 0x9E3779B9


@dataclasses.dataclass
class RowRng:
    """One request's random stream: its seed and the number of draws made so far."""

    seed: int
    draws: int = 0


def make_row_rng(params: SamplingParams) -> RowRng | None:
    """The request's stream (None for greedy): its seed, or a fresh random one."""
    if params.greedy:
        return None
    return RowRng(params.seed if params.seed is not None else secrets.randbits(64))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 values in [0, 2**32) (xor-shift-multiply, three rounds), in place on `x`
    (one temporary of its size at a time)."""
    for _ in range(2):
        x ^= x >> 16
        x *= _MIX
        x &= _M32
    x ^= x >> 16
    return x


def uniform_noise(seed_lo: torch.Tensor, seed_hi: torch.Tensor, draws: torch.Tensor, vocab: int) -> torch.Tensor:
    """(R, vocab) float32 uniforms in (0, 1) (23 random bits, centred in their cells), a function of each row's
    (seed, draws) and the token id only."""
    key = _mix32(_mix32(_mix32(seed_lo ^ _GOLDEN) ^ seed_hi) ^ (draws & _M32))[:, None]
    token = torch.arange(vocab, device=key.device, dtype=torch.int64)[None, :]
    bits = _mix32(key ^ token) >> 9
    return (bits.float() + 0.5) / float(1 << 23)


def filter_rows(scores: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                max_k: int | None = None, top_p_rows: list[int] | None = None) -> torch.Tensor:
    """Batched `sampler.filter_logits`: finite rows (R, V) -> scaled rows with top-k / top-p outside set to
    -inf, in the rows' dtype (the sampler's float32; float64 gives filter_logits' numbers). temperature,
    top_p: (R,) floats; top_k: (R,) int64, 0 = off.

    No row is sorted for top-k: its k-th score comes from one `torch.topk` of the largest k in force
    (`max_k`), and every score below it is dropped (ties with it stay, as filter_logits keeps them). Only
    the rows in `top_p_rows` (those with top_p < 1) are sorted, for the nucleus' running mass. `max_k` and
    `top_p_rows` are what the caller knows on the host; None reads them from the tensors (a host sync)."""
    vocab = scores.shape[1]
    scaled = scores - scores.max(dim=1, keepdim=True).values
    scaled /= temperature.to(scaled.dtype).clamp(min=MIN_TEMPERATURE)[:, None]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    if max_k is None:
        max_k = int(torch.where(k < vocab, k, 0).max()) if k.numel() else 0
    if 0 < max_k < vocab:
        kth = torch.topk(scaled, max_k, dim=1).values.gather(1, (k.clamp(max=max_k) - 1)[:, None])
        kth = kth.masked_fill((k >= vocab)[:, None], float("-inf"))  # rows with top-k off keep every token
        scaled.masked_fill_(scaled < kth, float("-inf"))
    if top_p_rows is None:
        top_p_rows = torch.nonzero(top_p < 1.0).flatten().tolist()
    if top_p_rows:
        rows = torch.tensor(top_p_rows, device=scaled.device)
        scaled.index_copy_(0, rows, _nucleus_sorted(scaled.index_select(0, rows), top_p.index_select(0, rows)))
    return scaled


CANDIDATES = 64  # a top-p row's first candidate set (its largest scores); 8x as many each time it falls short


def _nucleus_of_top(rows: torch.Tensor, top_p: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` with every token outside its row's nucleus at -inf, the nucleus looked for among each row's `size`
    largest scores (`torch.topk`, then a sort of those `size` by score, ties by id), and whether that settles
    the row: when the candidates' mass reaches top_p before their last one and every score outside is below the
    last kept one (so ties at the border are all candidates), the kept tokens are the whole-row sort's; an
    unsettled row's result is not to be used."""
    values, ids = torch.topk(rows, size, dim=1)
    ids, by_id = torch.sort(ids, dim=1)  # ties in score ordered by id, as the whole row's stable sort orders them
    values, order = torch.sort(values.gather(1, by_id), dim=1, descending=True, stable=True)
    ids = ids.gather(1, order)
    probs = torch.exp(values - torch.logsumexp(rows, dim=1, keepdim=True))
    drop = probs.cumsum(dim=1) - probs >= top_p.to(probs.dtype)[:, None]
    drop[:, 0] = False  # the top token always stays
    lowest_kept = values.masked_fill(drop, float("inf")).min(dim=1).values
    settled = drop[:, -1] & (values[:, -1] < lowest_kept)
    kept = torch.full_like(rows, float("-inf")).scatter_(1, ids, values.masked_fill_(drop, float("-inf")))
    return kept, settled


def _nucleus_sorted(rows: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`rows` with every token outside its row's nucleus at -inf, by sorting each whole row (stable: ties by id):
    a token stays while the mass before it is below top_p, the top token always."""
    ordered, order = torch.sort(rows, dim=1, descending=True, stable=True)
    probs = torch.softmax(ordered, dim=1)
    drop = probs.cumsum(dim=1) - probs >= top_p.to(probs.dtype)[:, None]
    drop[:, 0] = False  # the top token always stays
    ordered.masked_fill_(drop, float("-inf"))
    del probs, drop
    return torch.full_like(ordered, float("-inf")).scatter_(1, order, ordered)


class BatchedSampler:
    """One token per logits row on the logits' device (see the module docstring).

    Guarantees: never raises for parameters `SamplingParams` accepts and any logits (nan and inf
    included); every token is below `num_ids` (or the row's width); each non-greedy row's `RowRng`
    advances by one draw per call; one device-to-host copy per call (one more per redraw of top-p rows
    whose nucleus is wider than their candidates).
    """

    def __init__(self, num_ids: int | None = None):
        if num_ids is not None and num_ids <= 0:
            raise ValueError(f"num_ids must be positive, got {num_ids}")
        self.num_ids = num_ids

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], rngs: list[RowRng | None]) -> list[int]:
        if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(rngs):
            raise ValueError(f"logits {tuple(logits.shape)} need one SamplingParams and one RowRng slot per row "
                             f"(got {len(params)} and {len(rngs)})")
        if logits.shape[0] == 0:
            return []
        width = logits.shape[1] if self.num_ids is None else min(self.num_ids, logits.shape[1])
        rows = logits[:, :width]
        greedy = torch.argmax(torch.nan_to_num(rows.float(), nan=float("-inf")), dim=1)
        drawn = [i for i, p in enumerate(params) if not p.greedy]
        if not drawn:
            return greedy.tolist()  # the step's one copy
        streams: list[RowRng] = []
        for i in drawn:
            rng = rngs[i]
            if rng is None:
                raise ValueError(f"row {i} samples ({params[i]}) but has no RowRng")
            streams.append(rng)
        size: int | None = CANDIDATES
        index, chosen, finite, settled = self._draw(rows, drawn, params, streams, size)
        tokens = greedy.clone()
        tokens[index] = chosen
        # the step's one copy: tokens, fallback flags, and which top-p rows their candidates settled
        host = torch.cat([tokens, finite.long(), settled.long()]).tolist()
        b = len(params)
        out, ok, done = host[:b], host[b:b + len(drawn)], host[b + len(drawn):]
        while not all(done):  # a nucleus wider than its candidates: those rows again, 8x the candidates or sorted
            redo = [j for j, d in enumerate(done) if not d]
            size = size * 8 if size is not None and size * 8 * 4 <= rows.shape[1] else None
            _, chosen, _, settled = self._draw(rows, [drawn[j] for j in redo], params,
                                               [streams[j] for j in redo], size)
            again = torch.cat([chosen, settled.long()]).tolist()
            for j, token, d in zip(redo, again[:len(redo)], again[len(redo):], strict=True):
                out[drawn[j]], done[j] = token, d
        for i, rng, fine in zip(drawn, streams, ok, strict=True):
            rng.draws += 1
            if not fine:
                logger.warning("non-finite logits: sampled greedily (%s)", params[i])
        return out

    def _draw(self, rows: torch.Tensor, drawn: list[int], params: list[SamplingParams], streams: list[RowRng],
              size: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows in `drawn` (as a device tensor), their sampled tokens, finite flags and settled flags (no
        sync: the rows' settings travel in one host-to-device copy). `streams`: the RowRng of each drawn row.
        `size`: top-p rows look for their nucleus among that many largest scores (at least their top-k), and a
        row it does not settle (its flag False) must be drawn again; None, or a size over a quarter of the
        vocabulary, sorts them whole (every row settled)."""
        device = rows.device
        settings = torch.tensor(
            [[params[i].temperature, params[i].top_k, params[i].top_p, i, rng.seed & _M32, (rng.seed >> 32) & _M32,
              rng.draws] for i, rng in zip(drawn, streams, strict=True)],
            dtype=torch.float64).to(device, non_blocking=True)
        width = rows.shape[1]
        max_k = max((params[i].top_k if 0 < params[i].top_k < width else 0) for i in drawn)
        top_p_rows = [j for j, i in enumerate(drawn) if params[i].top_p < 1.0]
        index = settings[:, 3].long()
        scores = rows.index_select(0, index).float()
        finite = torch.isfinite(scores).all(dim=1)
        scores.masked_fill_(~finite[:, None], 0.0)
        as_int = settings[:, 4:].long()
        if size is not None:
            size = max(size, max_k)
            if size * 4 > width or not top_p_rows:
                size = None
        settled = torch.ones(len(drawn), dtype=torch.bool, device=device)
        filtered = filter_rows(scores, settings[:, 0], settings[:, 1].long(), settings[:, 2], max_k,
                               top_p_rows if size is None else [])
        del scores
        if size is not None:  # the nucleus among each top-p row's `size` largest scores
            at = torch.tensor(top_p_rows, device=device)
            kept, found = _nucleus_of_top(filtered.index_select(0, at), settings[:, 2].index_select(0, at), size)
            filtered.index_copy_(0, at, kept)
            settled.index_copy_(0, at, found)
            del kept
        gumbel = uniform_noise(as_int[:, 0], as_int[:, 1], as_int[:, 2], width)
        gumbel.log_().neg_().log_().neg_().add_(filtered)  # -log(-log(u)) + the filtered scores
        chosen = torch.argmax(gumbel, dim=1)
        fallback = torch.argmax(torch.nan_to_num(rows.index_select(0, index).float(), nan=float("-inf")), dim=1)
        return index, torch.where(finite, chosen, fallback), finite, settled | ~finite  # (those are greedy)
