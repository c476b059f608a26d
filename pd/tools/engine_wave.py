"""The served workload fed straight to the engine: `python -m pd.tools.engine_wave --config deploy/X.yaml`.

Waves of `c` concurrent chat requests (distinct questions, never repeated within a wave
nor across waves), `--new-tokens` each with EOS ignored, arrive at once through the
engine's asyncio `generate()` (its own step thread, as in a worker) with no HTTP, router
or detokenization in the way. The engine is built from the deploy YAML exactly as a
colocated worker builds it (`engine_config_for`; prefix caching as configured), on
`topology.threads_per_worker` threads. Per concurrency: one warm-up wave, then the median
over `--waves` waves of tokens/s (all output tokens over the wave's wall time), TTFT p50
and the process CPU time per output token. It is the in-process rate the served figures of
`pd.tools.peer_bench` are held against (`run_waves` is the API).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time

from pd.engine.engine import Engine
from pd.engine.sample.params import SamplingParams
from pd.engine.text.tokenizer import load_tokenizer
from pd.tools.vs_hf import QUESTIONS


@dataclasses.dataclass(frozen=True)
class WaveFigures:
    concurrency: int
    tokens_per_s: float
    ttft_p50_s: float
    cpu_ms_per_token: float
    num_tokens: int  # output tokens of one wave


def wave_questions(concurrency: int, wave: int) -> list[str]:
    """`concurrency` distinct questions for wave number `wave` (no two alike, in or across waves)."""
    return [f"{QUESTIONS[(i + 7 * wave) % len(QUESTIONS)]} (#{wave}-{i})" for i in range(concurrency)]


def engine_for(config_path: str) -> Engine:
    """An engine as a colocated worker of `config_path` builds it, on its configured threads."""
    import torch

    from pd.cluster.config import load_deploy_config
    from pd.cluster.roles import Role
    from pd.worker.wiring import engine_config_for
    from pd.worker.worker import WorkerSpec

    config = load_deploy_config(config_path).replace(topology__mode="colocated")
    torch.set_num_threads(config.topology.resolved_threads_per_worker)
    return Engine(engine_config_for(WorkerSpec("engine-wave", Role.BOTH, config, "engine-wave-secret-0123")))


async def _wave(eng: Engine, prompts: list[list[int]], new_tokens: int, tag: str) -> tuple[float, list[float], int]:
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)

    async def one(i: int, ids: list[int]) -> tuple[float, int]:
        t0, ttft, n = time.perf_counter(), float("nan"), 0
        async for out in eng.generate(f"{tag}-{i}", ids, params):
            if out.new_token_ids and n == 0:
                ttft = time.perf_counter() - t0
            n += len(out.new_token_ids)
        return ttft, n

    t0 = time.perf_counter()
    done = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
    return time.perf_counter() - t0, [d[0] for d in done], sum(d[1] for d in done)


async def run_waves(eng: Engine, concurrencies: list[int], new_tokens: int = 64,
                    num_waves: int = 3) -> list[WaveFigures]:
    """One warm-up wave, then `num_waves` measured waves per concurrency (medians)."""
    eng.start()
    tokenizer = load_tokenizer(eng.config.model_path) if eng.config.model_path else eng.tokenizer
    results, wave = [], 0
    for c in concurrencies:
        rows = []
        for k in range(num_waves + 1):
            prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in wave_questions(c, wave)]
            cpu0 = time.process_time()
            wall, ttfts, n = await _wave(eng, prompts, new_tokens, f"w{wave}")
            cpu = time.process_time() - cpu0
            wave += 1
            if k:  # the first is the warm-up
                rows.append((n / wall, statistics.median(ttfts), cpu / max(n, 1) * 1e3, n))
        results.append(WaveFigures(c, statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows),
                                   statistics.median(r[2] for r in rows), rows[0][3]))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="deploy YAML (its model, cache, scheduler and threads)")
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated wave sizes")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--waves", type=int, default=3, help="measured waves per concurrency (after one warm-up)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    try:
        concurrencies = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        ap.error("--concurrency must be comma-separated integers")
    if min(concurrencies) < 1 or args.new_tokens < 1 or args.waves < 1:
        ap.error("--concurrency, --new-tokens and --waves must be positive")
    eng = engine_for(args.config)
    try:
        figures = asyncio.run(run_waves(eng, concurrencies, args.new_tokens, args.waves))
    finally:
        eng.shutdown()
    if args.json:
        print(json.dumps({"num_threads": eng.num_threads, "waves": [dataclasses.asdict(f) for f in figures]}))
        return
    print(f"engine alone ({args.config}, {eng.num_threads} threads, {args.new_tokens} tokens each, EOS ignored, "
          f"median of {args.waves} waves after a warm-up):")
    for f in figures:
        print(f"  c={f.concurrency:<3d} {f.tokens_per_s:7.1f} tok/s  TTFT p50 {f.ttft_p50_s * 1e3:6.0f} ms  "
              f"CPU {f.cpu_ms_per_token:.2f} ms/token")


if __name__ == "__main__":
    main()
