"""Small builders for tests and benchmarks (tiny specs, seeded hashers).

Not used by production code. Hashers are seeded ("pdkv-test") so hashes are
the same in every process.
"""
from __future__ import annotations

from collections.abc import Sequence

from kvcache.config import KVCacheConfig, KVCacheGroupSpec
from kvcache.hashing import BlockHasher
from kvcache.manager import KVCacheManager
from kvcache.request import Request
from kvcache.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec

_HASHERS: dict[tuple[int, str], BlockHasher] = {}


def fa_spec(block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float32")


def swa_spec(block_size: int, sliding_window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float32",
                             sliding_window=sliding_window)


def mamba_spec(block_size: int, mamba_cache_mode: str = "none") -> MambaSpec:
    return MambaSpec(block_size=block_size, shapes=((1,),), dtypes=("float32",), mamba_cache_mode=mamba_cache_mode)


def make_config(num_blocks: int, *specs: KVCacheSpec) -> KVCacheConfig:
    """One group (one layer "l<i>") per spec."""
    return KVCacheConfig(num_blocks=num_blocks,
                         groups=tuple(KVCacheGroupSpec((f"l{i}",), s) for i, s in enumerate(specs)))


def make_manager(num_blocks: int, *specs: KVCacheSpec, max_model_len: int = 8192, **kwargs) -> KVCacheManager:
    return KVCacheManager(make_config(num_blocks, *(specs or (fa_spec(),))), max_model_len, **kwargs)


def hasher(block_size: int = 16, algorithm: str = "sha256") -> BlockHasher:
    key = (block_size, algorithm)
    h = _HASHERS.get(key)
    if h is None:
        h = _HASHERS[key] = BlockHasher(block_size, algorithm, seed="pdkv-test")
    return h


def make_request(request_id: str, prompt: Sequence[int], block_size: int = 16, **kwargs) -> Request:
    kwargs.setdefault("block_hasher", hasher(block_size))
    return Request(request_id, list(prompt), **kwargs)
