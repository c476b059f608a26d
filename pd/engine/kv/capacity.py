"""Whether a request can ever run on an engine: the one capacity rule, checked at the engine's edge."""
from __future__ import annotations

from collections.abc import Sequence

from kvcache.specs import KVCacheSpec, cdiv


def check_fits(specs: Sequence[KVCacheSpec], num_usable_blocks: int, max_model_len: int, num_prompt_tokens: int,
               max_tokens: int, request_id: str = "") -> None:
    """Raises ValueError for a request that could never run: its prompt leaves no room for a token
    under `max_model_len`, or its whole sequence (capped at `max_model_len`) needs more KV blocks, over
    every group's `specs` (a sliding window's group holds its window's blocks at most), than the pool's
    `num_usable_blocks` (it would wait forever)."""
    who = f"request {request_id}: " if request_id else "request "
    if num_prompt_tokens >= max_model_len:
        raise ValueError(f"{who}prompt of {num_prompt_tokens} tokens leaves no room under "
                         f"max_model_len={max_model_len}")
    num_tokens = min(num_prompt_tokens + max_tokens, max_model_len)
    need = 0
    for spec in specs:
        blocks = cdiv(num_tokens, spec.block_size)
        window = spec.sliding_window_size
        need += min(blocks, cdiv(window, spec.block_size) + 1) if window else blocks
    if need > num_usable_blocks:
        raise ValueError(f"{who}needs {need} KV blocks for {num_tokens} tokens; the pool has {num_usable_blocks}")
