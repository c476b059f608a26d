"""pdkv KV cache accounting: block pool, prefix cache, per-group managers.

Pure Python (stdlib, optional xxhash): importing this package must never pull
in torch, ray or zmq. Block ids only, never tensors.
"""
from kvcache.block_pool import BlockPool
from kvcache.blocks import FreeKVCacheBlockQueue, KVCacheBlock
from kvcache.config import KVCacheConfig, KVCacheGroupSpec, num_blocks_for_budget
from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcache.hashing import BlockHasher
from kvcache.kv_cache_blocks import KVCacheBlocks
from kvcache.manager import KVCacheManager
from kvcache.request import Request, RequestStatus
from kvcache.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec
from kvcache.stats import PrefixCacheStats

__all__ = [
    "AllBlocksCleared", "BlockHasher", "BlockPool", "BlockRemoved", "BlockStored",
    "FreeKVCacheBlockQueue", "FullAttentionSpec", "KVCacheBlock", "KVCacheBlocks",
    "KVCacheConfig", "KVCacheGroupSpec", "KVCacheManager", "KVCacheSpec", "MambaSpec",
    "PrefixCacheStats", "Request", "RequestStatus", "SlidingWindowSpec", "num_blocks_for_budget",
]
