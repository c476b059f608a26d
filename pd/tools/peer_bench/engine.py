"""The engine's own rate on the peer benchmark's workload (pd/tools/peer_bench/cli.py).

The same waves (prompts rendered with the model's chat template, as the router renders them),
the same output length (EOS ignored, greedy) and concurrency, fed straight to one engine built
from the colocated deploy YAML exactly as its worker builds it (pd.tools.engine_wave.engine_for:
prefix caching as configured, the benchmark's thread count): a wave's c requests are added at
once and stepped until all finish; its rate is its tokens over that wall time. Per c: the median
over the measured rounds (the warm-up wave is run and dropped), and the GFLOP/s of the
projections that rate implies (their flops per token times tokens/s, prefill included).

It runs in a child process started with a worker's environment (pd.worker.process_env: OpenMP
threads that sleep between ops), as the served workers are, so that neither the benchmark's own
process state nor its environment weighs on the figure it is held against:
`python -m pd.tools.peer_bench.engine --config deploy/smollm2-colocated.yaml --concurrency 1,8,32`
prints the figures as JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from pd.engine.sample.params import SamplingParams
from pd.tools.percentile import percentile
from pd.tools.peer_bench.workload import Wave, build_waves, messages_for
from pd.worker.process_env import worker_env


def engine_rates(config_path: str, waves: list[Wave], output_len: int,
                 threads: int | None, timeout_s: float = 1800.0) -> tuple[dict[int, dict], dict]:
    """Per c: median tokens/s and median in-process TTFT p50 (s) over the measured waves, and the
    projections' GFLOP/s; and the engine's KV pool audit after the run (all free, consistent). Runs
    `main` in a child process with a worker's environment; `waves` must be `build_waves(cs, rounds)`."""
    concurrencies = sorted({w.concurrency for w in waves})
    rounds = sum(1 for w in waves if w.concurrency == concurrencies[0] and not w.warmup)
    cmd = [sys.executable, "-m", "pd.tools.peer_bench.engine", "--config", config_path,
           "--concurrency", ",".join(map(str, concurrencies)), "--rounds", str(rounds),
           "--output-len", str(output_len)] + (["--threads", str(threads)] if threads else [])
    done = subprocess.run(cmd, env={**os.environ, **worker_env()}, capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"exit {done.returncode}: {done.stderr.strip()[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {int(c): v for c, v in result["rates"].items()}, result["audit"]


def _measure(config_path: str, waves: list[Wave], output_len: int, threads: int | None) -> dict:
    from pd.engine.text.tokenizer import load_tokenizer
    from pd.tools.engine_wave import engine_for

    eng = engine_for(config_path)
    if threads:
        torch.set_num_threads(threads)
    tokenizer = load_tokenizer(eng.config.model_path) if eng.config.model_path else eng.tokenizer
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
    return {"rates": rates, "audit": audit}


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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pd.tools.peer_bench.engine", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="deploy YAML whose colocated worker's engine to build")
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated wave sizes")
    ap.add_argument("--rounds", type=int, default=3, help="measured waves per concurrency (after one warm-up)")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the config's)")
    args = ap.parse_args(argv)
    waves = build_waves([int(c) for c in args.concurrency.split(",") if c.strip()], args.rounds)
    print(json.dumps(_measure(args.config, waves, args.output_len, args.threads)))


if __name__ == "__main__":
    main()
