"""Sampling parameters: one frozen, validated `SamplingParams` per request, in the one form it keeps
from the router to the sampler (no torch: the router builds them too; what they mean when tokens are
drawn is `pd/engine/sample/sampler.py`'s docstring)."""
from __future__ import annotations

import dataclasses
import logging

logger = logging.getLogger(__name__)

# Below this temperature sampling is greedy: logits / T overflows float32 long before T reaches 0.
MIN_TEMPERATURE = 1e-5
# The most a step's sampling allocates beside the logits, in bytes per logit of the batch (the device
# sampler's float32 temporaries: scores, the sorted nucleus rows, the noise), held by a test; the GPU
# memory plan reserves it (pd/cluster/gpu_share.py). Here because the plan imports no torch.
SAMPLER_BYTES_PER_LOGIT = 36


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

