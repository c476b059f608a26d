"""The host time of a decode step: `python -m pd.tools.step_host_bench [--batches 32 128 256]`.

What a GPU waits on between two decode steps, measured on the CPU with a 1-layer model (its forward is
short, so the host parts dominate): the scheduler (`schedule`), building the step's inputs (`inputs`:
`StepInputBuilder.build`, the step metadata), and applying the sampled tokens (`update`:
`Scheduler.update_from_output`). The engine's own `last_timing` gives schedule and update; the input build
is timed around the runner's builder. Per batch size: `batch` requests of a short prompt are admitted and
prefilled, then `--steps` decode steps (every request in each) are timed, and the median of each part
printed, in ms, with one JSON line per batch for scripts.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from pd.engine.config import EngineConfig
from pd.engine.engine import Engine
from pd.engine.model.config import ModelConfig
from pd.engine.sample.params import SamplingParams

PROMPT_TOKENS = 16


def measure(batch: int, steps: int, block_size: int = 16, engine_out: list[Engine] | None = None,
            backend: str = "auto") -> dict[str, float]:
    """Median host milliseconds of a decode step at `batch` (schedule, inputs, update, and the step's total).
    The requests then run to their end; `engine_out` receives the engine (for a caller's checks)."""
    model = ModelConfig(num_layers=1, bos_token_id=None, eos_token_id=None)
    blocks = batch * (-(-(PROMPT_TOKENS + steps + 2) // block_size) + 1) + 8
    engine = Engine(EngineConfig(model=model, seed=0, block_size=block_size, num_blocks=blocks,
                                 max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * PROMPT_TOKENS),
                                 attention_backend=backend))
    builder = engine.runner.inputs
    build = builder.build
    spent: list[float] = []

    def timed_build(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return build(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - t0)

    builder.build = timed_build  # type: ignore[method-assign]  # (timed for the run, put back below)
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [(7 * i + j) % 200 + 3 for j in range(PROMPT_TOKENS)], params)
    engine.step()  # the prompts, in one step (the token budget holds them)
    rows: dict[str, list[float]] = {"schedule": [], "inputs": [], "update": [], "step": []}
    for _ in range(steps):
        spent.clear()
        t0 = time.perf_counter()
        engine.step()
        total = time.perf_counter() - t0
        timing = engine.last_timing
        rows["schedule"].append(timing["schedule_s"])
        rows["inputs"].append(sum(spent))
        rows["update"].append(timing["update_s"])
        rows["step"].append(total)
    builder.build = build  # type: ignore[method-assign]
    while engine.has_unfinished_requests():
        engine.step()
    if engine_out is not None:
        engine_out.append(engine)
    return {name: 1e3 * statistics.median(values) for name, values in rows.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 128, 256])
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per batch size")
    parser.add_argument("--backend", default="auto", help="attention_backend (auto: what a deployment runs)")
    args = parser.parse_args(argv)
    print(f"{'batch':>6} {'schedule ms':>12} {'inputs ms':>10} {'update ms':>10} {'host ms':>8} {'step ms':>8}")
    for batch in args.batches:
        ms = measure(batch, args.steps, backend=args.backend)
        host = ms["schedule"] + ms["inputs"] + ms["update"]
        print(f"{batch:>6} {ms['schedule']:>12.3f} {ms['inputs']:>10.3f} {ms['update']:>10.3f} {host:>8.3f} "
              f"{ms['step']:>8.3f}")
        print(json.dumps({"batch": batch, **{f"{k}_ms": round(v, 4) for k, v in ms.items()},
                          "host_ms": round(host, 4)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
