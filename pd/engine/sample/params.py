"""Sampling parameters (no torch: the router builds them too).

Greedy when the temperature is below `MIN_TEMPERATURE` (as vLLM does: dividing
by a temperature that rounds to 0 in float32 gives inf/nan); otherwise
temperature, then top-k, then top-p (nucleus) filtering, drawn with a
per-request torch.Generator. With a seed the draw sequence of a request
depends only on its seed and its logits, never on which other requests share
the batch.

Guarantees of `sample`: it never raises for any parameters `SamplingParams`
accepts and any logits (nan and inf included), and every token it returns is
a valid index into the row. The filtered distribution always keeps at least
the most likely token (a top_p smaller than any representable mass keeps
exactly that one); a row whose distribution is still not finite and positive
before the draw is sampled greedily instead, and logged.
"""
from __future__ import annotations

import dataclasses
import logging

logger = logging.getLogger(__name__)

# Below this temperature sampling is greedy: logits / T overflows float32 long before T reaches 0.
MIN_TEMPERATURE = 1e-5


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
        if not self.temperature >= 0:  # (also refuses nan)
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        """Argmax decoding: a temperature too small to divide by, or top_k of 1."""
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

