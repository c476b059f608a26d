"""runner.ManagerAdapter over pdkv's KVCacheManager (same configuration rules as vLLM's side)."""
from __future__ import annotations

from kvcache import (
    BlockHasher,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    Request,
    RequestStatus,
    SlidingWindowSpec,
)

from parity import configs, runner


def _spec(group):
    common = dict(block_size=group["block_size"], num_kv_heads=1, head_size=1, dtype="float32")
    if group["kind"] == "full":
        return FullAttentionSpec(**common)
    return SlidingWindowSpec(**common, sliding_window=group["sliding_window"])


def make_manager(cfg: dict) -> tuple[KVCacheManager, BlockHasher]:
    """A pdkv manager and block hasher for a parity config (sha256, as on vLLM's side)."""
    kv_cfg = KVCacheConfig(
        num_blocks=cfg["num_blocks"],
        groups=tuple(KVCacheGroupSpec(layer_names=(f"layer{i}",), spec=_spec(g))
                     for i, g in enumerate(cfg["groups"])))
    _, hash_block_size = configs.block_sizes(cfg)
    mgr = KVCacheManager(kv_cfg, cfg["max_model_len"], enable_caching=cfg["enable_caching"],
                         hash_block_size=hash_block_size, watermark=cfg["watermark"],
                         max_num_batched_tokens=cfg["max_num_batched_tokens"],
                         log_stats=True, enable_kv_cache_events=True)
    return mgr, BlockHasher(block_size=hash_block_size, algorithm="sha256")


class PdkvAdapter(runner.ManagerAdapter):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.mgr, self.hasher = make_manager(cfg)

    def make_request(self, request_id, tokens, salt, lora, skip_read, max_tokens):
        return Request(request_id, tokens, block_hasher=self.hasher, max_tokens=max_tokens,
                       cache_salt=salt, lora_name=lora, skip_reading_prefix_cache=skip_read)

    def status(self, name):
        return RequestStatus[name]
