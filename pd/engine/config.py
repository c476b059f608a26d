"""Engine and model configuration: frozen dataclasses validated once.

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


KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


def check_device(device: str) -> None:
    """'cpu', 'cuda' or 'cuda:N', and a CUDA device must exist on this machine.

    Raises ValueError at config time, so a GPU deployment on a machine
    without CUDA fails at startup with this message, not inside a forward.
    """
    kind, _, index = str(device).partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but CUDA is not available on this machine "
                             f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); "
                             "use device 'cpu' or run on a GPU node")
        if index and int(index) >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
# auto: "fused" wherever it is valid (float32 on the CPU, the C++ kernel builds), else "torch";
# fused: the C++ decode kernel, refused at engine start where it is not valid; torch: the reference path.
ATTENTION_BACKENDS = ("auto", "torch", "fused")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs besides the weights.

    Either `model_path` (a local HF-style directory or a .gguf file) or `model`
    (random init with `seed`) defines the model; `dtype`, when set, is the serving dtype
    of either (a checkpoint is converted on load). The page pool holds `num_blocks` pages
    when given, else as many as `kv_cache_bytes` allows.
    """

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    model_path: str | None = None
    seed: int = 0
    block_size: int = 16
    kv_cache_bytes: int = 64 * 1024 * 1024
    num_blocks: int | None = None
    max_model_len: int | None = None  # None: model.max_position_embeddings
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    long_prefill_token_threshold: int = 0  # >0: chunk prefills to at most this many tokens per step
    enable_prefix_caching: bool = True
    watermark: float = 0.0
    full_sequence_must_fit: bool = False
    kv_load_failure_policy: str = "recompute"
    hash_algorithm: str = "sha256"
    dtype: str | None = None  # None: the checkpoint's (model_path) or model.dtype
    hash_seed: str | None = None  # None: env PDKV_HASH_SEED, else per-process random (hashes mean nothing outside)
    enable_kv_events: bool = False  # record prefix-cache events for `Engine.kv_event_sink`
    device: str = "cpu"
    attention_backend: str = "torch"  # see ATTENTION_BACKENDS; the C++ kernel is built on first use
    engine_id: str = "engine-0"

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {self.num_blocks}")
        if self.num_blocks is None and self.kv_cache_bytes <= 0:
            raise ValueError("kv_cache_bytes must be positive")
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        check_device(self.device)
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError("max_model_len must be positive")

    @property
    def resolved_max_model_len(self) -> int:
        return self.max_model_len or self.model.max_position_embeddings
