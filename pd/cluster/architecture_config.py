"""The deploy config's `model.architecture`: the shape of a random-weight model.

`ArchitectureSection` is `model.architecture`: the fields of the engine's `ModelConfig`
(`pd.engine.model.config`, the same names and defaults; `dtype` is `model.dtype`), typed and
bounded like every other section, unknown keys refused. Only the keys a file sets are
carried on (`overrides()`, and what `to_dict()` writes): the engine's own defaults apply to
the rest, and an unset `max_position_embeddings` follows `scheduler.max_model_len`.

Guarantees: a shape the engine would refuse (a head count that does not divide the hidden
size, kv heads that do not divide the heads, layer types that do not match the layers, a
sliding layer without a window) is refused here, naming the field; sizes are bounded so that
no random-weight model larger than `MAX_RANDOM_PARAMETERS` is built. This module imports
no torch: the router validates configs too.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from pd.cluster.schema import FieldError, StrictModel
from pd.engine.text.vocab import BYTE_VOCAB_SIZE

MAX_RANDOM_PARAMETERS = 10_000_000_000  # random weights are for tests and benchmarks: a checkpoint beyond
MAX_POSITIONS = 1 << 21
LayerType = Literal["full_attention", "sliding_attention"]


class ArchitectureSection(StrictModel):
    """A random-weight model's shape (`pd.engine.model.config.ModelConfig`'s fields and defaults)."""

    vocab_size: int = Field(BYTE_VOCAB_SIZE, gt=0, le=1 << 22)
    hidden_size: int = Field(64, gt=0, le=1 << 16)
    intermediate_size: int = Field(128, gt=0, le=1 << 18)
    num_layers: int = Field(2, gt=0, le=1024)
    num_heads: int = Field(4, gt=0, le=1024)
    num_kv_heads: int = Field(2, gt=0, le=1024)
    head_dim: int | None = Field(None, gt=0, le=1024, description="empty: hidden_size // num_heads")
    rope_theta: float = Field(10000.0, gt=0, le=1e12)
    rms_norm_eps: float = Field(1e-6, gt=0, lt=1)
    max_position_embeddings: int = Field(4096, gt=0, le=MAX_POSITIONS,
                                          description="unset: max(scheduler.max_model_len, 4096)")
    layer_types: list[LayerType] | None = Field(None, max_length=1024, description="empty: every layer full")
    sliding_window: int | None = Field(None, gt=0, le=MAX_POSITIONS)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = Field(256, ge=0, lt=1 << 22)
    eos_token_id: int | None = Field(257, ge=0, lt=1 << 22)
    architecture: Literal["LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"] = "LlamaForCausalLM"

    @model_validator(mode="after")
    def _shape_holds(self) -> ArchitectureSection:
        # the checks of ModelConfig.__post_init__, made here so a bad shape fails at load, not in a worker
        if self.num_heads % self.num_kv_heads:
            raise FieldError("num_kv_heads", f"must divide num_heads ({self.num_heads}), got {self.num_kv_heads}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise FieldError("num_heads", f"must divide hidden_size ({self.hidden_size}) when head_dim is not "
                             f"given, got {self.num_heads}")
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise FieldError("layer_types", f"has {len(self.layer_types)} entries for {self.num_layers} layers")
        if "sliding_attention" in (self.layer_types or ()) and self.sliding_window is None:
            raise FieldError("sliding_window", "sliding_attention layers need a sliding_window")
        if self.parameter_count() > MAX_RANDOM_PARAMETERS:
            raise FieldError("num_layers", f"a random-weight model of {self.parameter_count():,} parameters "
                             f"(at most {MAX_RANDOM_PARAMETERS:,}; serve a checkpoint instead)")
        return self

    def parameter_count(self) -> int:
        """The weights a random-weight model of this shape allocates (about)."""
        head_dim = self.head_dim or self.hidden_size // self.num_heads
        attention = self.hidden_size * head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        layer = attention + 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embeddings

    def overrides(self) -> dict[str, Any]:
        """The keys the file set (`ModelConfig` keyword arguments; its defaults for the rest)."""
        return self.model_dump(exclude_unset=True)
