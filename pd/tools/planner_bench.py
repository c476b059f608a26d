"""The prefill planner against the two fixed policies, side by side, in one run.

`python -m pd.tools.planner_bench [--num-requests 24 --loads 1,4 --links fast,throttled ...]`

For each link (fast: loopback; throttled: `transfer.emulated_link` of the deploy config,
`--bandwidth-mbps` / `--latency-ms`) and each policy (`router.planner.mode`:
always_disaggregate, always_local, planner) it starts a 1P1D deployment in this process
(real Workers with engines, ZMQ connectors, HTTP APIs; the real Router; loopback HTTP),
warms it up (each policy sees the same warm-up prompts, so the planner's figures have
samples), then runs the same mixed workload at each load level (closed loop, `load`
requests in flight; the three deployments take it in turns, a slice at a time, so the
machine's other jobs weigh on all alike) and prints one row per (link, load, policy):
TTFT p50 / p90 (client-side, first streamed token), TPOT p90 (per request: seconds per
output token after the first), the share of requests prefilled locally, the median
relative error of the router's TTFT prediction (`pdkv_route`), and the planner's TTFT
relative to the better fixed policy.

Workload: prompt lengths log-uniform in [--min-len, --max-len] (64..8192), random token
ids (no prefix sharing: prefix caching is off), `--max-tokens` output tokens each.
The model is random-weight, 2 layers, hidden 128 (`ARCH`): a prefill of 8k tokens takes
about 2-3 s on one CPU core, and each link's run takes about 2 minutes.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import random
import statistics
import threading
import time

import aiohttp
import torch

from pd.cluster.config import DeployConfig, TransferSection
from pd.cluster.roles import Role, WorkerEndpoint
from pd.router.server import Router
from pd.worker.worker import Worker, WorkerSpec

SECRET = "planner-bench-secret-0123456789abcdef"
ARCH = {"vocab_size": 260, "hidden_size": 128, "intermediate_size": 256, "num_layers": 2, "num_heads": 4,
        "num_kv_heads": 2}
POLICIES = ("always_disaggregate", "always_local", "planner")
WARMUP_LENGTHS = (64, 256, 1024, 4096, 8192, 128, 512, 2048, 64, 8192)


@dataclasses.dataclass(frozen=True)
class BenchSettings:
    num_requests: int = 24
    loads: tuple[int, ...] = (1, 4)
    links: tuple[str, ...] = ("fast", "throttled")
    min_len: int = 64
    max_len: int = 8192
    max_tokens: int = 32
    bandwidth_mbps: float = 200.0
    latency_ms: float = 5.0
    exploration_rate: float = 0.05
    tpot_weight: float = 1.0
    seed: int = 0
    slice_size: int = 4  # requests a policy runs before the next one takes its turn

    def lengths(self) -> list[int]:
        rng = random.Random(self.seed)
        lo, hi = math.log(self.min_len), math.log(self.max_len)
        return [int(math.exp(rng.uniform(lo, hi))) for _ in range(self.num_requests)]


@dataclasses.dataclass(frozen=True)
class Record:
    num_prompt_tokens: int
    ttft_s: float
    tpot_s: float | None
    decision: str | None
    prediction_error: float | None  # |predicted - measured| / measured TTFT, router-side (pdkv_route)


def deploy_config(mode: str, link: str, settings: BenchSettings) -> DeployConfig:
    transfer: dict = {"lease_s": 60.0, "timeout_s": 60.0}
    if link == "throttled":
        transfer.update(data_path="tcp", emulated_link={"bandwidth_mbps": settings.bandwidth_mbps,
                                                        "latency_ms": settings.latency_ms})
    return DeployConfig.from_dict({
        "model": {"name": "pdkv-bench", "seed": 0, "architecture": ARCH},
        "cache": {"block_size": 16, "kv_memory_mb": 160, "enable_prefix_caching": False},
        "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 2048,
                      "max_model_len": settings.max_len + settings.max_tokens + 16},
        "topology": {"mode": "disaggregated"},
        "transfer": transfer,
        "router": {"port": 0, "request_timeout_s": 300.0, "health_interval_s": 1.0, "max_queued_requests": 1024,
                   "planner": {"mode": mode, "exploration_rate": settings.exploration_rate,
                               "tpot_weight": settings.tpot_weight, "min_samples": 3, "seed": settings.seed}},
    })


class _Deployment:
    """1P1D in this process: real workers and router on a private event-loop thread."""

    def __init__(self, config: DeployConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.workers: list[Worker] = []
        self.router: Router | None = None
        self.url = ""

    def run(self, coro, timeout_s: float = 900.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def __enter__(self) -> _Deployment:
        self.thread.start()
        endpoints = []
        for wid, role in (("prefill-0", Role.PREFILL), ("decode-0", Role.DECODE)):
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


async def _one(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> Record:
    body = {"model": "pdkv-bench", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    t0 = time.perf_counter()
    first = last = None
    num_tokens, route = 0, None
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                if choice.get("token_ids"):
                    last = time.perf_counter()
                    first = first or last
                    num_tokens += len(choice["token_ids"])
                route = choice.get("pdkv_route") or route
    if first is None or last is None:
        raise RuntimeError(f"{url}: the stream carried no token")
    tpot = (last - first) / (num_tokens - 1) if num_tokens > 1 else None
    error = None
    if route and route.get("predicted_ttft_s") is not None and route.get("ttft_s"):
        error = abs(route["predicted_ttft_s"] - route["ttft_s"]) / route["ttft_s"]
    return Record(len(prompt), first - t0, tpot, route["decision"] if route else None, error)


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(n)] for n in lengths]


async def _drive(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> list[Record]:
    queue: asyncio.Queue = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    records: list[Record] = []
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def client() -> None:
            while not queue.empty():
                records.append(await _one(session, url, queue.get_nowait(), max_tokens))
        await asyncio.gather(*(client() for _ in range(concurrency)))
    return records


def _pct(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summarize(records: list[Record]) -> dict:
    ttfts = [r.ttft_s for r in records]
    tpots = [r.tpot_s for r in records if r.tpot_s is not None]
    errors = [r.prediction_error for r in records if r.prediction_error is not None]
    return {"num_requests": len(records), "ttft_p50_s": _pct(ttfts, 50), "ttft_p90_s": _pct(ttfts, 90),
            "tpot_p90_s": _pct(tpots, 90), "prediction_error_p50": _pct(errors, 50),
            "local_share": sum(r.decision == "local" for r in records) / max(1, len(records))}


def run_link(link: str, settings: BenchSettings) -> tuple[dict, dict]:
    """({(policy, load): summary}, the planner's figures) on one link. The three deployments
    live side by side and take the workload in turns, a slice each, so a change in the machine's
    load (other jobs) falls on every policy alike rather than on whichever ran then."""
    records: dict[tuple[str, int], list[Record]] = {(m, load): [] for m in POLICIES for load in settings.loads}
    warmup = prompts_of([min(n, settings.max_len) for n in WARMUP_LENGTHS], settings.seed + 1)
    prompts = prompts_of(settings.lengths(), settings.seed)
    with contextlib.ExitStack() as stack:
        deps = {m: stack.enter_context(_Deployment(deploy_config(m, link, settings))) for m in POLICIES}
        for dep in deps.values():
            dep.run(_drive(dep.url, warmup, 1, 4))
        for load in settings.loads:
            step = max(load, settings.slice_size)
            for start in range(0, len(prompts), step):
                for mode, dep in deps.items():
                    records[(mode, load)] += dep.run(_drive(dep.url, prompts[start:start + step], load,
                                                            settings.max_tokens))
        planner = deps["planner"].router
        assert planner is not None
        figures = planner.planner.describe()
    return {key: summarize(recs) for key, recs in records.items()}, figures


def format_table(rows: list[dict]) -> str:
    head = (f"{'link':<10}{'load':>5}  {'policy':<20}{'TTFT p50':>10}{'TTFT p90':>10}{'TPOT p90':>10}"
            f"{'local':>7}{'pred err':>9}{'vs best fixed p50/p90':>24}")
    lines = [head, "-" * len(head)]
    for row in rows:
        ratio = ""
        if "vs_best_p50" in row:
            ratio = f"{row['vs_best_p50']:.2f} / {row['vs_best_p90']:.2f}"
        lines.append(f"{row['link']:<10}{row['load']:>5}  {row['policy']:<20}{row['ttft_p50_s'] * 1e3:>8.0f}ms"
                     f"{row['ttft_p90_s'] * 1e3:>8.0f}ms{row['tpot_p90_s'] * 1e3:>8.1f}ms"
                     f"{row['local_share']:>7.0%}{row['prediction_error_p50']:>9.2f}{ratio:>24}")
    return "\n".join(lines)


def run(settings: BenchSettings) -> list[dict]:
    rows: list[dict] = []
    for link in settings.links:
        if link == "throttled" and "emulated_link" not in TransferSection.model_fields:
            print("throttled link: needs `transfer.emulated_link` (connectors/emulated_link.py); skipped")
            continue
        summaries, figures = run_link(link, settings)
        for load in settings.loads:
            best = {q: min(summaries[(m, load)][f"ttft_{q}_s"] for m in POLICIES[:2]) for q in ("p50", "p90")}
            for mode in POLICIES:
                row = {"link": link, "load": load, "policy": mode, **summaries[(mode, load)]}
                if mode == "planner":
                    row["vs_best_p50"] = row["ttft_p50_s"] / best["p50"]
                    row["vs_best_p90"] = row["ttft_p90_s"] / best["p90"]
                rows.append(row)
        logging.getLogger(__name__).info("planner figures (%s link): %s", link, json.dumps(figures))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = BenchSettings()
    parser.add_argument("--num-requests", type=int, default=d.num_requests)
    parser.add_argument("--loads", default=",".join(map(str, d.loads)), help="requests in flight, comma-separated")
    parser.add_argument("--links", default=",".join(d.links), help="fast and/or throttled")
    parser.add_argument("--min-len", type=int, default=d.min_len)
    parser.add_argument("--max-len", type=int, default=d.max_len)
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens)
    parser.add_argument("--bandwidth-mbps", type=float, default=d.bandwidth_mbps)
    parser.add_argument("--latency-ms", type=float, default=d.latency_ms)
    parser.add_argument("--exploration-rate", type=float, default=d.exploration_rate)
    parser.add_argument("--tpot-weight", type=float, default=d.tpot_weight)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)  # P and D share the machine's cores; a thread each, as on the tests' boxes
    links = tuple(x for x in args.links.split(",") if x)
    for link in links:
        if link not in ("fast", "throttled"):
            parser.error(f"--links: unknown link {link!r}; use fast and/or throttled")
    settings = BenchSettings(args.num_requests, tuple(int(x) for x in args.loads.split(",")), links, args.min_len,
                             args.max_len, args.max_tokens, args.bandwidth_mbps, args.latency_ms,
                             args.exploration_rate, args.tpot_weight, args.seed)
    t0 = time.perf_counter()
    rows = run(settings)
    print(format_table(rows))
    print(f"({settings.num_requests} requests per row, prompts {settings.min_len}..{settings.max_len} tokens "
          f"log-uniform, {settings.max_tokens} output tokens; throttled = {settings.bandwidth_mbps:g} Mbit/s, "
          f"{settings.latency_ms:g} ms; {time.perf_counter() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
