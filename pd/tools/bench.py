"""Engine benchmark: `python -m pd.tools.bench [--vs-hf] [--quick]`.

Reports, at the documented model size (BENCH_MODEL unless overridden):
- prefill tokens/s and decode tokens/s of the engine;
- scheduler overhead per step (schedule + update, µs) with 256 running
  requests, kept apart from model time (a tiny model keeps that run short);
- with --vs-hf: batched greedy decode tokens/s of this engine against Hugging
  Face transformers' `generate()` on the same weights (written with our
  checkpoint writer, loaded with LlamaForCausalLM.from_pretrained) and the same
  32 mixed-length prompts, side by side, and the ratio.

`--gemm` prints only the GEMM table of pd/tools/gemm_bench.py (GFLOP/s per projection shape,
packed GEMM and torch, beside a large torch.mm's). `--vs-hf --model PATH` runs only that
comparison, on a real checkpoint (PATH as `model.path` takes it: an HF directory, a .gguf, `package:NAME/FILE`) with 32
chat-rendered questions; the engine is built as a serving worker builds it, and the
report names the decode attention backend it ran (pd/tools/vs_hf.py).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from typing import Any

import torch

from pd.engine.model.checkpoint import save_checkpoint
from pd.engine.config import EngineConfig
from pd.engine.model.config import ModelConfig
from pd.engine.engine import Engine
from pd.engine.model.llama import build_model
from pd.engine.sample.params import SamplingParams
from pd.tools.vs_hf import bench_vs_hf_model, side_by_side, summarize

# Documented benchmark model: 29.4M parameters (8 layers, hidden 512, 8 query / 4 KV heads of 64,
# SwiGLU 1536, vocab 4096), Llama layout, float32, block size 16.
BENCH_MODEL = ModelConfig(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_layers=8,
                          num_heads=8, num_kv_heads=4, max_position_embeddings=4096,
                          bos_token_id=1, eos_token_id=2)
ATTENTION = "auto"  # the C++ decode kernel wherever it is valid, else torch (as serving runs)
TINY_MODEL = ModelConfig(vocab_size=260, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2)


def _prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for i in range(n)}


def _engine(cfg: ModelConfig, **kw) -> Engine:
    defaults: dict[str, Any] = dict(model=cfg, block_size=16, kv_cache_bytes=1 << 30, max_num_batched_tokens=4096,
                    max_num_seqs=256, enable_prefix_caching=False, attention_backend=ATTENTION)
    defaults.update(kw)
    return Engine(EngineConfig(**defaults))


def bench_throughput(cfg: ModelConfig, num_requests: int, prompt_len: int, decode_steps: int) -> dict:
    """Prefill tokens/s (prompts only) and decode tokens/s (steady-state batch)."""
    eng = _engine(cfg, max_num_batched_tokens=max(4096, prompt_len))
    prompts = _prompts(num_requests, prompt_len, prompt_len, cfg.vocab_size)
    params = SamplingParams(max_tokens=decode_steps + 1, ignore_eos=True)
    for rid, ids in prompts.items():
        eng.add_request(rid, ids, params)
    t0 = time.perf_counter()
    prefill_tokens = 0
    eng.step()
    while any(s.request.num_output_tokens == 0 for s in eng.scheduler.requests.values()) or eng.scheduler.waiting:
        eng.step()
    prefill_tokens = num_requests * prompt_len
    t_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    decoded = 0
    while eng.has_unfinished_requests():
        decoded += sum(len(o.new_token_ids) for o in eng.step())
    t_decode = time.perf_counter() - t0
    eng.shutdown()
    return {"prefill_tokens_per_s": prefill_tokens / t_prefill, "decode_tokens_per_s": decoded / t_decode,
            "num_requests": num_requests, "prompt_len": prompt_len, "decode_steps": decode_steps}


def bench_scheduler_overhead(num_running: int = 256, steps: int = 50) -> dict:
    """Per-step scheduler time (schedule + update_from_output) with `num_running` decoding requests."""
    eng = _engine(TINY_MODEL, max_num_batched_tokens=8192, max_num_seqs=num_running)
    params = SamplingParams(max_tokens=steps + 10, ignore_eos=True)
    for rid, ids in _prompts(num_running, 8, 64, 256).items():
        eng.add_request(rid, ids, params)
    eng.step()
    while any(s.request.num_output_tokens == 0 for s in eng.scheduler.requests.values()) or eng.scheduler.waiting:
        eng.step()
    assert len(eng.scheduler.running) == num_running
    samples = []
    for _ in range(steps):
        eng.step()
        samples.append(dict(eng.last_timing))
    # Medians: robust to other processes stealing the CPU for a few steps.
    med = {key: statistics.median(s[key] for s in samples) * 1e6 for key in samples[0]}
    out = {"num_running": num_running, "steps": steps,
           "scheduler_us_per_step": statistics.median((s["schedule_s"] + s["update_s"]) for s in samples) * 1e6,
           "schedule_us_per_step": med["schedule_s"], "update_us_per_step": med["update_s"],
           "model_us_per_step": med["model_s"]}
    for rid in list(eng.scheduler.requests):
        eng.abort_request(rid)
    eng.step()
    eng.shutdown()
    return out


def bench_vs_hf(cfg: ModelConfig, num_requests: int, lo: int, hi: int, max_new: int, rounds: int = 2) -> dict:
    from transformers import LlamaForCausalLM  # optional extra: pip install 'pdkv[bench]'

    prompts = _prompts(num_requests, lo, hi, cfg.vocab_size, seed=1)
    model = build_model(cfg, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(model, tmp)
        hf = LlamaForCausalLM.from_pretrained(tmp, torch_dtype=torch.float32).eval()
        eng = Engine(EngineConfig(model_path=tmp, block_size=16, kv_cache_bytes=1 << 30, attention_backend=ATTENTION,
                                  max_num_batched_tokens=4096, max_num_seqs=num_requests, enable_prefix_caching=False))
    try:
        run = side_by_side(eng, hf, prompts, pad_id=0, max_new=max_new, rounds=rounds)
    finally:
        eng.shutdown()
    return summarize(run, num_requests, max_new, rounds, f"{lo}-{hi}")


def _print_vs_hf(v: dict) -> None:
    print(f"vs HF generate: {v['num_requests']} requests, prompts {v['prompt_lens']} tokens, "
          f"{v['max_new_tokens']} new tokens each, greedy, same weights, best of {v['rounds']} interleaved rounds")
    if "attention_backend" in v:
        print(f"  model {v['model_path']} (HF loads {v['hf_dir']}); pdkv decode attention: "
              f"{v['attention_backend']}; torch threads {v['torch_threads']}")
    for c, label in (("wall", "wall clock"), ("cpu", "process CPU time")):
        m = v[c]
        print(f"  [{label}] decode: pdkv {m['ours_decode_tokens_per_s']:.0f} tok/s  HF "
              f"{m['hf_decode_tokens_per_s']:.0f} tok/s  ratio {m['decode_ratio']:.2f}x | end-to-end: pdkv "
              f"{m['ours_e2e_tokens_per_s']:.0f} tok/s ({m['ours_s']:.1f}s)  HF {m['hf_e2e_tokens_per_s']:.0f} tok/s "
              f"({m['hf_s']:.1f}s)  ratio {m['e2e_ratio']:.2f}x")
    print(f"  identical greedy outputs: {v['greedy_outputs_identical']}")
    for d in v.get("divergences", []):
        margin = d.get("hf_top1_top2_margin")
        print(f"    {d['request']}: first divergence at new token {d['first_divergence']} "
              f"(pdkv {d['pdkv_token']}, HF {d['hf_token']})"
              + (f", HF top-1/top-2 logit margin there {margin:.2e}" if margin is not None else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vs-hf", action="store_true", help="compare batched greedy decode with transformers generate()")
    ap.add_argument("--model", metavar="PATH", help="with --vs-hf: a real checkpoint, spelled as model.path in a "
                    "deploy YAML (HF directory, .gguf, package:NAME/FILE), with chat prompts; skips the other runs")
    ap.add_argument("--num-requests", type=int, default=32, help="batch size in --vs-hf")
    ap.add_argument("--quick", action="store_true", help="smaller runs (smoke test)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens generated per request in --vs-hf")
    ap.add_argument("--max-prompt", type=int, default=512, help="prompt lengths in --vs-hf are uniform in [16, this]")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved pdkv/HF rounds in --vs-hf (best of each)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ap.add_argument("--gemm", action="store_true", help="only the GEMM table: packed and torch GFLOP/s per "
                    "SmolLM2-135M projection shape beside a large torch.mm's (pd/tools/gemm_bench.py)")
    args = ap.parse_args()
    if args.model and not args.vs_hf:
        ap.error("--model needs --vs-hf (it compares that checkpoint with transformers generate())")
    for name in ("num_requests", "new_tokens", "rounds"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.gemm:
        from pd.tools.gemm_bench import SMOLLM2_SHAPES, print_table

        print_table(SMOLLM2_SHAPES, [1, 2, 4, 8, 32, 512], repeats=20)
        return
    if args.model:
        v = bench_vs_hf_model(args.model, args.num_requests, args.new_tokens, args.rounds)
        if args.json:
            print(json.dumps({"vs_hf": v}, indent=2))
        else:
            _print_vs_hf(v)
        return
    cfg = TINY_MODEL if args.quick else BENCH_MODEL
    results = {"model": {k: v for k, v in cfg.__dict__.items() if v is not None},
               "torch_threads": torch.get_num_threads()}
    results["throughput"] = bench_throughput(cfg, num_requests=32, prompt_len=64 if args.quick else 256,
                                             decode_steps=16 if args.quick else 64)
    results["scheduler"] = bench_scheduler_overhead(256, steps=10 if args.quick else 50)
    if args.vs_hf:
        results["vs_hf"] = bench_vs_hf(cfg, args.num_requests, 16, 128 if args.quick else args.max_prompt,
                                       16 if args.quick else args.new_tokens, rounds=args.rounds)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"model: {results['model']}  (torch threads: {results['torch_threads']})")
    tp = results["throughput"]
    print(f"prefill: {tp['prefill_tokens_per_s']:.0f} tok/s   decode: {tp['decode_tokens_per_s']:.0f} tok/s "
          f"({tp['num_requests']} requests, prompt {tp['prompt_len']}, {tp['decode_steps']} decode steps)")
    sc = results["scheduler"]
    print(f"scheduler overhead @ {sc['num_running']} running: {sc['scheduler_us_per_step']:.0f} us/step "
          f"(schedule {sc['schedule_us_per_step']:.0f} + update {sc['update_us_per_step']:.0f}); "
          f"model+runner {sc['model_us_per_step']:.0f} us/step (tiny model)")
    if args.vs_hf:
        _print_vs_hf(results["vs_hf"])


if __name__ == "__main__":
    main()
