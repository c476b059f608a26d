"""Model configuration: a frozen dataclass validated once.

`ModelConfig` describes a Llama-style decoder (also Qwen2 / Mistral layouts)
and converts to and from a Hugging Face `config.json` dict. `EngineConfig`
holds everything the engine needs besides weights: KV cache sizing,
scheduling limits and policies.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder.

    Invariants: num_heads is a multiple of num_kv_heads; every layer type is
    "full_attention" or "sliding_attention"; sliding layers imply a positive
    sliding_window; dtype is one of DTYPES.
    """

    vocab_size: int = 260
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_heads
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    layer_types: tuple[str, ...] | None = None  # None: every layer full attention
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 uses biases on q/k/v
    dtype: str = "float32"
    bos_token_id: int | None = 256
    eos_token_id: int | None = 257
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads when head_dim is not given")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        types = self.resolved_layer_types
        if len(types) != self.num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {self.num_layers} layers")
        bad = [t for t in types if t not in LAYER_TYPES]
        if bad:
            raise ValueError(f"unknown layer types {bad}; expected one of {LAYER_TYPES}")
        if SLIDING_ATTENTION in types and (self.sliding_window is None or self.sliding_window <= 0):
            raise ValueError("sliding_attention layers need a positive sliding_window")
        if self.layer_types is not None and not isinstance(self.layer_types, tuple):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def resolved_layer_types(self) -> tuple[str, ...]:
        if self.layer_types is None:
            return (FULL_ATTENTION,) * self.num_layers
        return tuple(self.layer_types)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def to_hf_dict(self) -> dict[str, Any]:
        """A `config.json` dict that transformers' Llama/Qwen2/Mistral classes accept."""
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": {"Qwen2ForCausalLM": "qwen2",
                           "MistralForCausalLM": "mistral"}.get(self.architecture, "llama"),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.resolved_head_dim,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "torch_dtype": self.dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if self.layer_types is not None:
            out["layer_types"] = list(self.layer_types)
        # Written even when None: Mistral's and Qwen2's defaults are a 4096-token window.
        out["sliding_window"] = self.sliding_window
        if self.architecture == "Qwen2ForCausalLM":
            out["use_sliding_window"] = SLIDING_ATTENTION in self.resolved_layer_types
        return out
