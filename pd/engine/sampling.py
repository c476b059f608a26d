"""Sampling parameters and the sampler.

Greedy when temperature == 0; otherwise temperature, then top-k, then top-p
(nucleus) filtering, drawn with a per-request torch.Generator. With a seed the
draw sequence of a request depends only on its seed and its logits, never on
which other requests share the batch.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters (validated once)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self) -> torch.Generator | None:
        """The request's private RNG (None for greedy)."""
        if self.greedy:
            return None
        gen = torch.Generator()
        if self.seed is not None:
            gen.manual_seed(self.seed)
        else:
            gen.seed()
        return gen


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits (1-D, float32) with top-k / top-p outside set to -inf."""
    scaled = logits / params.temperature
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_vals, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_vals, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = probs.cumsum(-1) - probs >= params.top_p
        sorted_vals = sorted_vals.masked_fill(drop, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(0, order, sorted_vals)
    return scaled


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of `logits` (R, vocab); greedy rows in one argmax."""
    tokens = torch.argmax(logits, dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        probs = torch.softmax(filter_logits(logits[row].float().cpu(), p), dim=-1)  # generators live on the CPU
        tokens[row] = int(torch.multinomial(probs, 1, generator=gen).item())
    return tokens
