"""Record vLLM 0.25.1's decisions for every parity scenario (runs INSIDE the anchor venv).

    cd tests/kvcache && $VENV/bin/python -m parity.record_vllm --out parity/fixtures/vllm_0_25_1.json

Builds vLLM KVCacheManager objects the way vLLM's tests/v1/core tests do (kv_cache_tensors=[],
one layer per group, scheduler block size = lcm of the group block sizes, hash block size =
the block size for one group and the gcd for several), executes each scenario and writes the
ops plus the observations as JSON. Only decisions are recorded, never hash values.
"""
from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch
import vllm
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus

from parity import configs, driver, runner, scenarios

HASH_FN = get_hash_fn_by_name("sha256")
init_none_hash(HASH_FN)


def _spec(group):
    common = dict(block_size=group["block_size"], num_kv_heads=1, head_size=1,
                  dtype=torch.float32)
    if group["kind"] == "full":
        return FullAttentionSpec(**common)
    return SlidingWindowSpec(**common, sliding_window=group["sliding_window"])


class VllmAdapter(runner.ManagerAdapter):
    """runner.ManagerAdapter over vLLM 0.25.1's KVCacheManager."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        kv_cfg = KVCacheConfig(
            num_blocks=cfg["num_blocks"], kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], _spec(g))
                             for i, g in enumerate(cfg["groups"])])
        scheduler_block_size, hash_block_size = configs.block_sizes(cfg)
        self.mgr = KVCacheManager(
            kv_cfg, max_model_len=cfg["max_model_len"],
            scheduler_block_size=scheduler_block_size, hash_block_size=hash_block_size,
            max_num_batched_tokens=cfg["max_num_batched_tokens"],
            enable_caching=cfg["enable_caching"], watermark=cfg["watermark"],
            log_stats=True, enable_kv_cache_events=True)
        self.hasher = get_request_block_hasher(hash_block_size, HASH_FN)
        self.lora_ids: dict[str, int] = {}

    def make_request(self, request_id, tokens, salt, lora, skip_read, max_tokens):
        params = SamplingParams(max_tokens=max_tokens)
        params.update_from_generation_config({}, eos_token_id=100)
        lora_request = None
        if lora is not None:
            lora_id = self.lora_ids.setdefault(lora, len(self.lora_ids) + 1)
            lora_request = LoRARequest(lora_name=lora, lora_int_id=lora_id, lora_path="/x")
        req = Request(request_id=request_id, prompt_token_ids=tokens, mm_features=None,
                      sampling_params=params, pooling_params=None, lora_request=lora_request,
                      cache_salt=salt, block_hasher=self.hasher)
        if skip_read:
            req.skip_reading_prefix_cache = True
        return req

    def status(self, name):
        return RequestStatus[name]


def record_all() -> dict:
    out = {"vllm_version": vllm.__version__, "format": 1, "scenarios": []}
    for name, cfg, build in scenarios.HANDWRITTEN:
        adapter = VllmAdapter(cfg)
        ops, observed = runner.resolve_and_run(lambda op: runner.execute(adapter, op),
                                               scenarios.observed(build()))
        out["scenarios"].append({"name": name, "config": cfg, "ops": ops,
                                 "expected": observed})
    for name, cfg, params in driver.RANDOM_SCENARIOS:
        ops, observed = driver.generate(VllmAdapter(cfg), cfg, params)
        out["scenarios"].append({"name": name, "config": cfg, "ops": ops,
                                 "expected": observed})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    data = record_all()
    with open(args.out, "w") as f:
        json.dump(data, f, separators=(",", ":"), sort_keys=True)
        f.write("\n")
    num_ops = sum(len(s["ops"]) for s in data["scenarios"])
    print(f"recorded {len(data['scenarios'])} scenarios, {num_ops} ops -> {args.out}")


if __name__ == "__main__":
    main()
