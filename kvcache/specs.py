"""KV cache specs: what one layer's KV cache looks like, per block.

A spec is a frozen dataclass validated once at construction. Two layers with
equal specs may share one KV cache group; the hybrid coordinator also batches
groups with equal specs into one prefix-cache lookup. Every spec knows its
`page_size_bytes` (one block of one layer) and its `kind` string, which is what
KV events carry.

Guarantees: `block_size > 0`; dtype names are known; page sizes are positive.
Sliding-window and full-attention specs are distinct classes (neither is a
subclass of the other), because the hybrid coordinator treats them differently.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import ClassVar

DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
}


def dtype_size(dtype: str) -> int:
    """Bytes per element of a dtype given by name ("float32", "bfloat16", ...)."""
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_SIZES)}") from None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """Base spec: `block_size` tokens per block."""

    block_size: int
    kind: ClassVar[str] = "unknown"

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError

    @property
    def sliding_window_size(self) -> int | None:
        """The window reported in KV events (None for non-windowed specs)."""
        return None

    def max_admission_blocks_per_request(self, max_num_batched_tokens: int, max_model_len: int) -> int | None:
        """Blocks a request can hold at most at any time, or None when unbounded
        below `cdiv(max_model_len, block_size)` (full attention keeps all)."""
        return None

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int | None = None) -> int:
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """Key/value attention: per block, K and V for every token and head."""

    num_kv_heads: int
    head_size: int
    dtype: str
    head_size_v: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_kv_heads <= 0 or self.head_size <= 0:
            raise ValueError("num_kv_heads and head_size must be positive")
        dtype_size(self.dtype)
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        elif self.head_size_v <= 0:
            raise ValueError("head_size_v must be positive")

    @property
    def page_size_bytes(self) -> int:
        head_size_v = self.head_size if self.head_size_v is None else self.head_size_v  # (set by __post_init__)
        return self.block_size * self.num_kv_heads * (self.head_size + head_size_v) * dtype_size(self.dtype)


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Causal attention over the whole sequence: every block is kept."""

    kind: ClassVar[str] = "full_attention"

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int | None = None) -> int:
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Attention over the last `sliding_window` tokens: blocks that leave the
    window are returned to the pool (replaced by the null block)."""

    sliding_window: int
    kind: ClassVar[str] = "sliding_window"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.sliding_window, int) or self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be a positive int, got {self.sliding_window!r}")

    @property
    def sliding_window_size(self) -> int | None:
        return self.sliding_window

    def max_admission_blocks_per_request(self, max_num_batched_tokens: int, max_model_len: int) -> int:
        # A chunk holds the last window-1 computed tokens plus the new ones;
        # +1 because the window rarely starts on a block boundary.
        num_tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size) + 1

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int | None = None) -> int:
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max_model_len
        blocks = self.max_admission_blocks_per_request(max_num_batched_tokens, max_model_len)
        return blocks * self.page_size_bytes


MAMBA_CACHE_MODES = ("none", "all")


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """Recurrent state: one block holds the whole state after `block_size`-aligned
    prefixes; only the latest state is kept per request (plus speculative ones).

    `mamba_cache_mode` is "none" (one state block per request, usually with
    block_size >= max_model_len) or "all" (a state per block boundary, older ones
    returned to the pool). vLLM's "align" mode is not supported.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0
    kind: ClassVar[str] = "mamba"

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "shapes", tuple(tuple(int(d) for d in s) for s in self.shapes))
        object.__setattr__(self, "dtypes", tuple(self.dtypes))
        if not self.shapes or len(self.shapes) != len(self.dtypes):
            raise ValueError("MambaSpec needs one dtype per state shape (and at least one)")
        for d in self.dtypes:
            dtype_size(d)
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ValueError(f"mamba_cache_mode must be one of {MAMBA_CACHE_MODES}, got {self.mamba_cache_mode!r}")
        if self.num_speculative_blocks < 0:
            raise ValueError("num_speculative_blocks must be >= 0")

    @property
    def page_size_bytes(self) -> int:
        return sum(prod(s) * dtype_size(d) for s, d in zip(self.shapes, self.dtypes, strict=True))

    def max_memory_usage_bytes(self, max_model_len: int, max_num_batched_tokens: int | None = None) -> int:
        if self.mamba_cache_mode == "all":
            return (cdiv(max_model_len, self.block_size) + self.num_speculative_blocks) * self.page_size_bytes
        return (1 + self.num_speculative_blocks) * self.page_size_bytes
