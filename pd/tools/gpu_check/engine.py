"""gpu_check, engine: prefill and decode tokens/s of the check model on the GPU."""
from __future__ import annotations

import random
import time

from pd.engine.config import EngineConfig
from pd.engine.model.config import ModelConfig

CHECK_MODEL = ModelConfig(vocab_size=32000, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                          num_kv_heads=2, head_dim=64, max_position_embeddings=4096, dtype="bfloat16",
                          bos_token_id=1, eos_token_id=2)
CHECK_MODEL_DOC = ("Qwen2.5-0.5B-like shape, ~0.42B params (24 layers, hidden 896, 14 q / 2 KV heads of 64, "
                   "SwiGLU 4864, vocab 32000), bfloat16, random weights, block size 16")


def measure_engine(model: ModelConfig = CHECK_MODEL, num_requests: int = 32, prompt_len: int = 512,
                   decode_steps: int = 64) -> dict:
    """Prefill tokens/s (prompts only) and decode tokens/s (steady batch of `num_requests`)."""
    from pd.engine.engine import Engine
    from pd.engine.sample.params import SamplingParams

    t_build = time.perf_counter()
    eng = Engine(EngineConfig(model=model, device="cuda", block_size=16, kv_cache_bytes=8 << 30,
                              max_num_batched_tokens=8192, max_num_seqs=256, enable_prefix_caching=False,
                              max_model_len=prompt_len + decode_steps + 8))
    build_s = time.perf_counter() - t_build
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(3, model.vocab_size) for _ in range(prompt_len)] for i in range(num_requests)}
    eng.generate_sync({"warmup": prompts["r0"][:64]}, SamplingParams(max_tokens=4, ignore_eos=True))
    params = SamplingParams(max_tokens=decode_steps + 1, ignore_eos=True)
    for rid, ids in prompts.items():
        eng.add_request(rid, ids, params)
    generated = {rid: 0 for rid in prompts}
    t0 = time.perf_counter()
    while sum(1 for n in generated.values() if n) < num_requests:  # prefill: until every prompt has its first token
        for out in eng.step():
            generated[out.request_id] += len(out.new_token_ids)
    t1 = time.perf_counter()
    first = sum(generated.values())
    while eng.has_unfinished_requests():
        for out in eng.step():
            generated[out.request_id] += len(out.new_token_ids)
    t2 = time.perf_counter()
    params_count = sum(p.numel() for p in eng.runner.model.parameters())
    return {"model": CHECK_MODEL_DOC if model == CHECK_MODEL else repr(model), "params": params_count,
            "num_requests": num_requests, "prompt_len": prompt_len, "decode_steps": decode_steps,
            "prefill_tokens_per_s": round(num_requests * prompt_len / (t1 - t0), 1),
            "decode_tokens_per_s": round((sum(generated.values()) - first) / (t2 - t1), 1),
            "build_s": round(build_s, 1)}
