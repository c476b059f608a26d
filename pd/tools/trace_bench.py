"""What tracing costs: served throughput with tracing off and on, side by side in one run.

    python -m pd.tools.trace_bench [--config deploy/local.yaml] [--concurrency 16] [--max-tokens 32]
                                   [--rounds 3] [--exporter file]

One in-process deployment per variant (real workers, connector and router on loopback HTTP, no Ray),
the variants interleaved round by round: `off` (tracing none) and `on` (every request sampled, spans
exported by the chosen exporter; `file` writes JSON lines to a temporary directory). Each round sends
waves of `concurrency` streamed completions of exactly `max_tokens` tokens (EOS ignored, prompts never
repeated) and counts served tokens per second; the median round of each variant is printed with the ratio.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time

import aiohttp

from pd.cluster.config import DeployConfig, Mode, load_deploy_config
from pd.cluster.roles import Role, WorkerEndpoint
from pd.router.server import Router
from pd.tools.sse_stream import SSEStream
from pd.worker.worker import Worker, WorkerSpec

SECRET = "trace-bench-secret-0123456789abcdef"


class _Deployment:
    """Workers and a router on a private loop thread (as the tests' in-process deployment)."""

    def __init__(self, config: DeployConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.workers: list[Worker] = []
        self.router: Router | None = None
        self.url = ""

    def run(self, coro, timeout_s: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def __enter__(self) -> _Deployment:
        self.thread.start()
        colocated = self.config.topology.mode is Mode.COLOCATED
        roles = [("both-0", Role.BOTH)] if colocated else [("prefill-0", Role.PREFILL), ("decode-0", Role.DECODE)]
        endpoints = []
        for wid, role in roles:
            worker = Worker(WorkerSpec(wid, role, self.config, SECRET))
            self.workers.append(worker)
            endpoints.append(WorkerEndpoint(wid, role, self.run(worker.start())))
        self.router = Router(self.config, endpoints, SECRET)
        self.url = self.run(self.router.start())
        return self

    def __exit__(self, *exc) -> None:
        if self.router is not None:
            self.run(self.router.stop())
        for worker in self.workers:
            self.run(worker.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


async def _one(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> int:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    async with session.post(f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=300)) as resp:
        resp.raise_for_status()
        num_tokens = 0
        async for chunk in SSEStream(resp.content):
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
        return num_tokens


async def _round(url: str, concurrency: int, max_tokens: int, num_waves: int, tag: str) -> tuple[float, float]:
    """Served tokens per second, and this process's CPU milliseconds per request (router, workers and
    client all run here, one variant at a time: CPU time is far less swayed by other load than wall time)."""
    async with aiohttp.ClientSession() as session:
        t0, cpu0 = time.perf_counter(), time.process_time()
        total = 0
        for wave in range(num_waves):
            prompts = [f"{tag} wave {wave} request {i}: tell me a story about the sea" for i in range(concurrency)]
            total += sum(await asyncio.gather(*(_one(session, url, p, max_tokens) for p in prompts)))
        cpu_ms = 1000 * (time.process_time() - cpu0) / (num_waves * concurrency)
        return total / (time.perf_counter() - t0), cpu_ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pd.tools.trace_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="deploy/local.yaml")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--waves", type=int, default=2, help="waves per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--exporter", choices=("file", "console", "otlp"), default="file")
    parser.add_argument("--endpoint", default=None, help="otlp: the collector's traces URL")
    args = parser.parse_args(argv)
    base = load_deploy_config(args.config).replace(router__port=0)
    with tempfile.TemporaryDirectory(prefix="pdkv-trace-bench-") as spans_dir:
        on = {"exporter": args.exporter, "file_dir": spans_dir, "endpoint": args.endpoint, "sample_ratio": 1.0}
        variants = {"off": base, "on": base.replace(tracing=on)}
        rates: dict[str, list[float]] = {name: [] for name in variants}
        cpu: dict[str, list[float]] = {name: [] for name in variants}
        with _Deployment(variants["off"]) as off, _Deployment(variants["on"]) as traced:
            deps = {"off": off, "on": traced}
            for name, dep in deps.items():  # warm-up
                asyncio.run(_round(dep.url, args.concurrency, args.max_tokens, 1, f"warm {name}"))
            for r in range(args.rounds):
                for name, dep in (list(deps.items()) if r % 2 == 0 else list(deps.items())[::-1]):
                    rate, cpu_ms = asyncio.run(_round(dep.url, args.concurrency, args.max_tokens, args.waves,
                                                      f"round {r} {name}"))
                    rates[name].append(rate)
                    cpu[name].append(cpu_ms)
    print(f"config {args.config} ({base.topology.mode.value}), c={args.concurrency}, {args.max_tokens} tokens, "
          f"{args.waves} waves x {args.rounds} rounds, exporter {args.exporter}")
    for name, values in rates.items():
        print(f"  tracing {name:>3}: median {statistics.median(values):8.1f} tok/s  "
              f"(rounds: {', '.join(f'{v:.1f}' for v in values)});  CPU {statistics.median(cpu[name]):.2f} ms/request")
    ratio = statistics.median(rates["on"]) / statistics.median(rates["off"])
    cpu_ratio = statistics.median(cpu["on"]) / statistics.median(cpu["off"])
    print(f"  on / off: throughput {ratio:.3f}, CPU per request {cpu_ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
