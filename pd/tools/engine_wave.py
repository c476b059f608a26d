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

`--step-overhead-tokens 0,16` compares scheduler settings side by side on the same engine
(`scheduler.step_overhead_tokens`, docs/engine.md "A burst of prompts"): per concurrency the
settings take turns wave by wave (the order flips every wave), and each also reports its TTFT
p50 in process CPU time (the CPU the process had used when the median first token came out) and
its output tokens per CPU second: the figures that the load of a shared machine distorts least.
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
    ttft_cpu_p50_s: float = float("nan")  # the process CPU time used from the wave's start to the median first token
    step_overhead_tokens: int | None = None  # the scheduler setting the waves ran with (None: the config's)


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


async def _wave(eng: Engine, prompts: list[list[int]], new_tokens: int,
                tag: str) -> tuple[float, list[float], int, list[float]]:
    """Wall time, each TTFT, output tokens and each TTFT in process CPU time of one wave."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    cpu0 = time.process_time()

    async def one(i: int, ids: list[int]) -> tuple[float, int, float]:
        t0, ttft, n, cpu = time.perf_counter(), float("nan"), 0, float("nan")
        async for out in eng.generate(f"{tag}-{i}", ids, params):
            if out.new_token_ids and n == 0:
                ttft, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            n += len(out.new_token_ids)
        return ttft, n, cpu

    t0 = time.perf_counter()
    done = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
    return time.perf_counter() - t0, [d[0] for d in done], sum(d[1] for d in done), [d[2] for d in done]


async def run_waves(eng: Engine, concurrencies: list[int], new_tokens: int = 64, num_waves: int = 3,
                    step_overheads: list[int] | None = None) -> list[WaveFigures]:
    """One warm-up wave, then `num_waves` measured waves per concurrency (medians); with `step_overheads`,
    that many waves per setting, the settings taking turns (one figure per concurrency and setting)."""
    eng.start()
    tokenizer = load_tokenizer(eng.config.model_path) if eng.config.model_path else eng.tokenizer
    settings: list[int | None] = list(step_overheads) if step_overheads else [None]
    base = eng.scheduler.config
    results, wave = [], 0
    for c in concurrencies:
        rows: dict[int | None, list[tuple]] = {s: [] for s in settings}
        for k in range(num_waves + 1):
            for setting in settings if k % 2 else settings[::-1]:
                if setting is not None:  # (the scheduler reads its config at every step; the engine is idle here)
                    eng.scheduler.config = dataclasses.replace(base, step_overhead_tokens=setting)
                prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in wave_questions(c, wave)]
                cpu0 = time.process_time()
                wall, ttfts, n, ttft_cpus = await _wave(eng, prompts, new_tokens, f"w{wave}")
                cpu = time.process_time() - cpu0
                wave += 1
                if k:  # the first round is the warm-up
                    rows[setting].append((n / wall, statistics.median(ttfts), cpu / max(n, 1) * 1e3, n,
                                          statistics.median(ttft_cpus)))
        for setting, r in rows.items():
            def med(i: int, r: list[tuple] = r) -> float:
                return statistics.median(x[i] for x in r)

            results.append(WaveFigures(c, med(0), med(1), med(2), r[0][3], med(4), setting))
    eng.scheduler.config = base
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="deploy YAML (its model, cache, scheduler and threads)")
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated wave sizes")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--waves", type=int, default=3, help="measured waves per concurrency (after one warm-up)")
    ap.add_argument("--step-overhead-tokens", default=None,
                    help="comma-separated scheduler.step_overhead_tokens settings to compare side by side")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    try:
        concurrencies = [int(c) for c in args.concurrency.split(",")]
        overheads = [int(o) for o in args.step_overhead_tokens.split(",")] if args.step_overhead_tokens else None
    except ValueError:
        ap.error("--concurrency and --step-overhead-tokens must be comma-separated integers")
    if min(concurrencies) < 1 or args.new_tokens < 1 or args.waves < 1:
        ap.error("--concurrency, --new-tokens and --waves must be positive")
    if overheads is not None and min(overheads) < 0:
        ap.error("--step-overhead-tokens must be >= 0")
    eng = engine_for(args.config)
    try:
        figures = asyncio.run(run_waves(eng, concurrencies, args.new_tokens, args.waves, overheads))
    finally:
        eng.shutdown()
    if args.json:
        print(json.dumps({"num_threads": eng.num_threads, "waves": [dataclasses.asdict(f) for f in figures]}))
        return
    print(f"engine alone ({args.config}, {eng.num_threads} threads, {args.new_tokens} tokens each, EOS ignored, "
          f"median of {args.waves} waves after a warm-up):")
    for f in figures:
        setting = "" if f.step_overhead_tokens is None else f"step_overhead_tokens {f.step_overhead_tokens:<4d} "
        print(f"  c={f.concurrency:<3d} {setting}{f.tokens_per_s:7.1f} tok/s  TTFT p50 {f.ttft_p50_s * 1e3:6.0f} ms "
              f"({f.ttft_cpu_p50_s * 1e3:.0f} ms of process CPU)  CPU {f.cpu_ms_per_token:.2f} ms/token")


if __name__ == "__main__":
    main()
