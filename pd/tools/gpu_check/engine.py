"""gpu_check, engine: prefill and decode tokens/s of the check model on the GPU, and one batch of
given prompts timed the way the transformers comparison (engine_compare.py) needs it."""
from __future__ import annotations

import random
import time
from collections.abc import Sequence

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
                              attention_backend="auto", max_num_batched_tokens=8192, max_num_seqs=256,
                              enable_prefix_caching=False, max_model_len=prompt_len + decode_steps + 8))
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


def check_engine(model: ModelConfig = CHECK_MODEL, device: str = "cuda", max_model_len: int = 1024,
                 max_num_seqs: int = 256, kv_cache_bytes: int = 8 << 30):
    """The engine gpu_check compares, as a deployment gets it (`attention_backend: auto`: Triton with decode CUDA
    graphs on a GPU): prefix caching off (every prompt is prefilled), block size 16."""
    from pd.engine.engine import Engine

    return Engine(EngineConfig(model=model, device=device, block_size=16, kv_cache_bytes=kv_cache_bytes,
                               attention_backend="auto", max_num_batched_tokens=8192, max_num_seqs=max_num_seqs,
                               enable_prefix_caching=False, max_model_len=max_model_len))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def measure_engine_batch(eng, prompts: Sequence[Sequence[int]], new_tokens: int, profile_steps: int = 0,
                         device: str = "cuda") -> dict:
    """Greedy generation of `new_tokens` for every prompt at once: prefill time (until every request has
    its first token), decode tokens/s over the steps after it, and, with `profile_steps`, the GPU-busy
    share of that many decode steps (profiled apart from the timed ones). Returns the tokens too."""
    from pd.engine.sample.params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    rids = [f"b{len(prompts)}-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {rid: [] for rid in rids}

    def step() -> None:
        for out in eng.step():
            if out.request_id in tokens:
                tokens[out.request_id].extend(out.new_token_ids)

    _sync(device)
    t0 = time.perf_counter()
    for rid, ids in zip(rids, prompts, strict=True):
        eng.add_request(rid, list(ids), params)
    while any(not t for t in tokens.values()):
        step()
    _sync(device)
    prefill_s = time.perf_counter() - t0
    busy: dict = {}
    if profile_steps and device.startswith("cuda"):
        from pd.tools.gpu_check.gpu_busy import profile_busy

        busy = profile_busy(step, profile_steps)
    before = sum(len(t) for t in tokens.values())
    _sync(device)
    t1 = time.perf_counter()
    while eng.has_unfinished_requests():
        step()
    _sync(device)
    decode_s = time.perf_counter() - t1
    decoded = sum(len(t) for t in tokens.values()) - before
    return {"prefill_s": round(prefill_s, 4), "decode_tokens_per_s": round(decoded / max(decode_s, 1e-9), 1),
            "decode_step_ms": round(1000 * decode_s / max(1, decoded // len(prompts)), 3), **busy,
            "tokens": [tokens[rid] for rid in rids]}
