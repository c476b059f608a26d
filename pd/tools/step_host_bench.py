"""Host time of a decode step: what the scheduler, the input build and the output update cost while the
device waits, at a few batch sizes, on the CPU with a 1-layer tiny random model (the torch backend, so the
model's own time stays small; it is printed apart, for context).

Each batch runs `--steps` decode steps after `--warmup` ones, every request decoding the whole time
(ignore_eos, max_tokens past the end), and reports the median of the engine's own per-step timing
(`Engine.last_timing`: schedule_s, inputs_s, model_s, update_s). Medians, because other processes on a
loaded machine steal the CPU for a few steps at a time; `--repeat N` runs each batch N times, in turn, in
fresh engines, and reports the median of the runs' medians (for a machine whose load changes by the minute).

    python -m pd.tools.step_host_bench [--batches 32 128 256] [--steps 200] [--repeat 3] [--prefix-caching] [--json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys

import torch

from pd.engine.config import EngineConfig
from pd.engine.engine import Engine
from pd.engine.model.config import ModelConfig
from pd.engine.sample.params import SamplingParams

MODEL = ModelConfig(num_layers=1)  # the tiny default shape, one layer
KEYS = ("schedule_s", "inputs_s", "update_s", "model_s")


def measure(batch: int, steps: int, warmup: int, prompt_len: int = 32, block_size: int = 16,
            backend: str = "torch", seed: int = 0, prefix_caching: bool = False) -> dict:
    """Median per-step timings (microseconds) of `steps` decode steps at `batch` running requests."""
    if batch <= 0 or steps <= 0 or warmup < 0 or prompt_len <= 0:
        raise ValueError("batch, steps and prompt_len must be positive, warmup at least 0")
    total = prompt_len + warmup + steps + 4
    blocks = batch * (-(-total // block_size)) + 8
    eng = Engine(EngineConfig(model=MODEL, block_size=block_size, num_blocks=blocks, max_num_seqs=batch,
                              max_num_batched_tokens=max(2048, batch * prompt_len), attention_backend=backend,
                              max_model_len=total + block_size, enable_prefix_caching=prefix_caching))
    try:
        rng = random.Random(seed)
        params = SamplingParams(max_tokens=warmup + steps + 2, ignore_eos=True)
        for i in range(batch):
            eng.add_request(f"r{i}", [rng.randrange(256) for _ in range(prompt_len)], params)
        while eng.scheduler.waiting or any(s.request.num_output_tokens == 0 for s in eng.scheduler.requests.values()):
            eng.step()
        for _ in range(warmup):
            eng.step()
        samples = []
        for _ in range(steps):
            eng.step()
            if len(eng.scheduler.running) != batch:
                raise RuntimeError(f"{len(eng.scheduler.running)} requests running, expected {batch}")
            samples.append(dict(eng.last_timing))
        for rid in list(eng.scheduler.requests):
            eng.abort_request(rid)
        eng.step()
        audit = eng.audit()
        if not (audit.all_free and audit.consistent):
            raise RuntimeError(f"the KV pool after the run: {audit.detail}")
    finally:
        eng.shutdown()
    med = {key.replace("_s", "_us"): statistics.median(s[key] for s in samples) * 1e6 for key in KEYS}
    host = statistics.median(s["schedule_s"] + s["inputs_s"] + s["update_s"] for s in samples) * 1e6
    return {"batch": batch, "steps": steps, "host_us": host, **med}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 128, 256])
    ap.add_argument("--steps", type=int, default=200, help="measured decode steps per batch")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--repeat", type=int, default=1, help="runs per batch; the median of their medians")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="with the prefix cache on (the engine's default; off here unless asked, as before)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    runs: dict[int, list[dict]] = {b: [] for b in args.batches}
    for _ in range(args.repeat):  # (batches in turn, so a burst of load spreads over them)
        for b in args.batches:
            runs[b].append(measure(b, args.steps, args.warmup, prefix_caching=args.prefix_caching))
    rows = [{**runs[b][0], **{k: statistics.median(r[k] for r in runs[b]) for k in runs[b][0] if k.endswith("_us")},
             "runs": args.repeat} for b in args.batches]
    if args.json:
        json.dump({"model": "1 layer, hidden 64, torch backend, CPU", "threads": args.threads,
                   "prefix_caching": args.prefix_caching, "rows": rows}, sys.stdout)
        print()
        return 0
    runs_note = (f", median of {args.repeat} runs" if args.repeat > 1 else "") + \
        (", prefix cache on" if args.prefix_caching else "")
    print(f"decode step host time, median of {args.steps} steps (µs{runs_note}); 1-layer tiny model, torch backend, "
          f"CPU, {args.threads} thread(s)")
    print(f"{'batch':>6} {'schedule':>9} {'inputs':>8} {'update':>8} {'host':>8} {'model':>8}")
    for r in rows:
        print(f"{r['batch']:>6} {r['schedule_us']:>9.0f} {r['inputs_us']:>8.0f} {r['update_us']:>8.0f} "
              f"{r['host_us']:>8.0f} {r['model_us']:>8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
