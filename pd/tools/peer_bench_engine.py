"""The engine's own rate on the peer benchmark's workload (pd/tools/peer_bench.py).

The same waves (prompts rendered with the model's chat template, as the router renders them),
the same output length (EOS ignored, greedy) and concurrency, fed straight to one engine built
as a colocated worker builds it (pd.tools.vs_hf.serving_engine): a wave's c requests are added
at once and stepped until all finish; its rate is its tokens over that wall time. Per c: the
median over the measured rounds (the warm-up wave is run and dropped), and the GFLOP/s of the
projections that rate implies (their flops per token times tokens/s, prefill included).
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from pd.engine.sampling import SamplingParams
from pd.tools.loadgen_report import percentile
from pd.tools.peer_bench_workload import Wave, messages_for


def engine_rates(model_path: str, waves: list[Wave], output_len: int,
                 threads: int | None) -> tuple[dict[int, dict], dict]:
    """Per c: median tokens/s and median in-process TTFT p50 (s) over the measured waves; and the
    engine's KV pool audit after the run (all free, consistent)."""
    from pd.engine.tokenizer import load_tokenizer
    from pd.tools.vs_hf import serving_engine

    if threads:
        torch.set_num_threads(threads)
    tokenizer = load_tokenizer(model_path)
    eng = serving_engine(model_path, max(w.concurrency for w in waves))
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    per_c: dict[int, list[tuple[float, float]]] = {}
    try:
        for index, wave in enumerate(waves):
            ids = {f"w{index}-{i}": tokenizer.encode_chat(messages_for(p)) for i, p in enumerate(wave.prompts)}
            rate, ttft_p50 = _run_wave(eng, ids, params)
            if not wave.warmup:
                per_c.setdefault(wave.concurrency, []).append((rate, ttft_p50))
        audit = dataclasses.asdict(eng.audit())
    finally:
        eng.shutdown()
    flops = projection_flops_per_token(eng.runner.model)
    rates = {c: {"tokens_per_s": statistics.median(r for r, _ in runs),
                 "ttft_p50_s": statistics.median(t for _, t in runs)} for c, runs in per_c.items()}
    for v in rates.values():
        v["gemm_gflops"] = v["tokens_per_s"] * flops / 1e9
    return rates, audit


def projection_flops_per_token(model: torch.nn.Module) -> int:
    """2 flops per weight of every projection and the lm_head (the GEMMs; embeddings are lookups)."""
    return sum(2 * m.in_features * m.out_features for m in model.modules() if hasattr(m, "in_features")
               and hasattr(m, "out_features") and not isinstance(m, torch.nn.Embedding))


def _run_wave(eng, prompts: dict[str, list[int]], params: SamplingParams) -> tuple[float, float]:
    t0 = time.perf_counter()
    for rid, ids in prompts.items():
        eng.add_request(rid, ids, params)
    first: dict[str, float] = {}
    num_tokens = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.error:
                raise RuntimeError(f"engine request {out.request_id} failed: {out.error}")
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - t0
            num_tokens += len(out.new_token_ids)
    elapsed = time.perf_counter() - t0
    return num_tokens / elapsed, percentile(list(first.values()), 50)
