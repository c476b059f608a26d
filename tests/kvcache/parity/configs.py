"""Parity configurations (plain JSON-able data).

A config describes one KVCacheManager: its groups ("full" or "swa" with a block size and, for
SWA, a window), num_blocks (including the null block), max_model_len, max_num_batched_tokens,
watermark and enable_caching. Both the vLLM and the pdkv adapter build their manager from it.
"""
from __future__ import annotations

from math import gcd, lcm


def config(name, groups, num_blocks, max_model_len=8192, max_num_batched_tokens=None,
           watermark=0.0, enable_caching=True):
    return {"name": name, "groups": groups, "num_blocks": num_blocks,
            "max_model_len": max_model_len, "max_num_batched_tokens": max_num_batched_tokens,
            "watermark": watermark, "enable_caching": enable_caching}


def full(block_size):
    return {"kind": "full", "block_size": block_size}


def swa(block_size, window):
    return {"kind": "swa", "block_size": block_size, "sliding_window": window}


def block_sizes(cfg) -> tuple[int, int]:
    """(scheduler_block_size, hash_block_size) the way vLLM resolves them for the manager."""
    sizes = [g["block_size"] for g in cfg["groups"]]
    if len(sizes) == 1:
        return sizes[0], sizes[0]
    return lcm(*sizes), gcd(*sizes)


# --- hand-written scenario configs -------------------------------------------------------------------------------
FULL16 = config("full16", [full(16)], num_blocks=11)
FULL16_NOCACHE = config("full16_nocache", [full(16)], num_blocks=11, enable_caching=False)
FULL16_3 = config("full16_3", [full(16)], num_blocks=3)
FULL16_64 = config("full16_64", [full(16)], num_blocks=64)
FULL16_WM = config("full16_watermark", [full(16)], num_blocks=11, watermark=0.2)
FULL4 = config("full4", [full(4)], num_blocks=16, max_model_len=256)
SWA4 = config("swa4", [swa(4, 10)], num_blocks=16, max_model_len=256, max_num_batched_tokens=16)
HYBRID4 = config("hybrid4", [full(4), swa(4, 10)], num_blocks=32, max_model_len=256,
                 max_num_batched_tokens=16)
# kvcache/tests/test_state_machine.py's "hybrid" layout
HYBRID4_SM = config("hybrid4_sm", [full(4), swa(4, 10)], num_blocks=40, max_model_len=96)
HYBRID3 = config("hybrid3", [full(4), swa(4, 10), swa(4, 6)], num_blocks=48, max_model_len=256,
                 max_num_batched_tokens=16)
HYBRID_TWIN = config("hybrid_twin", [full(4), swa(4, 10), swa(4, 10)], num_blocks=48,
                     max_model_len=256, max_num_batched_tokens=16)
HYBRID_MIXED = config("hybrid_mixed", [full(4), swa(8, 12)], num_blocks=40, max_model_len=256,
                      max_num_batched_tokens=16)

