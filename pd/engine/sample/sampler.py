"""The sampler: tokens from logits under each request's `SamplingParams`.

Greedy when the temperature is below `MIN_TEMPERATURE` (as vLLM does: dividing
by a temperature that rounds to 0 in float32 gives inf/nan); otherwise
temperature, then top-k, then top-p (nucleus) filtering, drawn with a
per-request torch.Generator. With a seed the draw sequence of a request
depends only on its seed and its logits, never on which other requests share
the batch.

Guarantees of `sample`: it never raises for any parameters `SamplingParams`
accepts and any logits (nan and inf included), and every token it returns is
a valid index into the row, below `num_ids` when given (the ids a tokenizer can
decode: a padded vocabulary's extra ids are never sampled, in any mode). The filtered distribution always keeps at least
the most likely token (a top_p smaller than any representable mass keeps
exactly that one); a row whose distribution is still not finite and positive
before the draw is sampled greedily instead, and logged.
"""
from __future__ import annotations

import logging

import torch

from pd.engine.sample.params import MIN_TEMPERATURE, SamplingParams

logger = logging.getLogger(__name__)


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The request's private RNG (None for greedy)."""
    if params.greedy:
        return None
    gen = torch.Generator()
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return gen


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits (1-D, float64) with top-k / top-p outside set to -inf.

    The row's maximum is subtracted before scaling, so the most likely token scores exactly 0
    and no finite logit overflows, whatever the temperature; that token is never masked (ties:
    the lowest index, as argmax).
    Expects a finite row (`sample` checks)."""
    row = logits.double()
    scaled = (row - row.max()) / max(params.temperature, MIN_TEMPERATURE)
    vocab = scaled.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_vals, order = torch.sort(scaled, descending=True, stable=True)
        probs = torch.softmax(sorted_vals, dim=-1)
        # keep the smallest prefix whose mass reaches top_p, and always the top token: a top_p below
        # the smallest representable mass would otherwise drop every token
        drop = probs.cumsum(-1) - probs >= params.top_p
        drop[0] = False
        sorted_vals = sorted_vals.masked_fill(drop, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(0, order, sorted_vals)
    return scaled


def _greedy_token(row: torch.Tensor) -> int:
    """Argmax that treats nan as the lowest score (a valid index for any row)."""
    return int(torch.argmax(torch.nan_to_num(row.double(), nan=float("-inf"))).item())


def _draw(row: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """One sampled token of a (CPU) row, or the greedy one when the distribution is unusable."""
    if not bool(torch.isfinite(row).all()):
        logger.warning("non-finite logits: sampled greedily")
        return _greedy_token(row)
    probs = torch.softmax(filter_logits(row, params), dim=-1)
    total = float(probs.sum())
    if not (bool(torch.isfinite(probs).all()) and bool((probs >= 0).all()) and total > 0):
        logger.warning("sampling distribution is not finite and positive (%s): sampled greedily", params)
        return _greedy_token(row)
    return int(torch.multinomial(probs, 1, generator=gen).item())


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           num_ids: int | None = None) -> list[int]:
    """One token per row of `logits` (R, vocab), among ids [0, num_ids) when given; greedy rows in one
    argmax. Never raises."""
    if num_ids is not None and num_ids < logits.shape[-1]:
        logits = logits[:, :num_ids]  # the ids past it are not in the tokenizer's vocabulary
    tokens = torch.argmax(torch.nan_to_num(logits, nan=float("-inf")), dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        cpu_row = logits[row].float().cpu()  # generators live on the CPU
        try:
            tokens[row] = _draw(cpu_row, p, gen)
        except Exception:  # noqa: BLE001 - one row's draw must not take the step (and the batch) down
            logger.exception("sampling failed for %s: sampled greedily", p)
            tokens[row] = _greedy_token(cpu_row)
    return tokens
