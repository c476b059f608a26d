"""The prefill planner against the two fixed policies, side by side, in one run.

`python -m pd.tools.planner_bench [--num-requests 48 --loads 1,4 --links fast,throttled ...]`

For each link (fast: loopback; throttled: `transfer.emulated_link` of the deploy config,
`--bandwidth-mbps` / `--latency-ms`) and each policy (`router.planner.mode`:
always_disaggregate, always_local, planner) it starts a 1P1D deployment: P and D each in a
process of its own (`pd.tools.pinned_worker`: the real Worker with its engine, ZMQ
connector and HTTP API; one torch thread; P pinned to one core and D to another where this
process may use two), the real Router in this process, loopback HTTP. It warms each up
(the same warm-up prompts, so the planner's figures have samples), then runs the workloads
(the three deployments take each in turns, a slice at a time, so the machine's other jobs
weigh on all alike) and prints one row per (link, load, policy): TTFT p50 / p90
(client-side, first streamed token), TPOT p90 (per request: seconds per output token after
the first), the share of requests prefilled locally, the median relative error of the
router's TTFT prediction (`pdkv_route`), and the planner's TTFT relative to the better
fixed policy.

Workloads: the sweep, prompt lengths log-uniform in [--min-len, --max-len] (64..8192),
`--max-tokens` output tokens each, closed loop with `load` requests in flight, for each of
`--loads`; and "mixed": one client sends long prompts (4096..max-len tokens, 64 output
tokens) one after another while two interactive clients send short ones (64..512 tokens)
meanwhile, so short prompts arrive while a long one is prefilling or decoding. Random
token ids (no prefix sharing: prefix caching is off). The model is random-weight, 2 layers,
hidden 128 (`ARCH`): a prefill of 8k tokens takes about 2 s on one CPU core, and each
link's run takes about 3 minutes.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import time

import aiohttp

from pd.cluster.config import DeployConfig, TransferSection
from pd.cluster.roles import Role
from pd.tools.percentile import percentile
from pd.tools.pinned_deployment import PinnedDeployment, WorkerPlan
from pd.tools.sse_stream import SSEStream

ARCH = {"vocab_size": 260, "hidden_size": 128, "intermediate_size": 256, "num_layers": 2, "num_heads": 4,
        "num_kv_heads": 2}
POLICIES = ("always_disaggregate", "always_local", "planner")
WARMUP_LENGTHS = (64, 256, 1024, 4096, 8192, 128, 512, 2048, 64, 8192)


@dataclasses.dataclass(frozen=True)
class BenchSettings:
    num_requests: int = 48
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
    mixed: bool = True
    num_mixed_long: int = 4  # the mixed workload's long prompts (4k..8k, --mixed-long-tokens output tokens)
    num_mixed_short: int = 16  # and its interactive short ones (64..512), arriving while the long run
    mixed_long_tokens: int = 64

    def lengths(self) -> list[int]:
        rng = random.Random(self.seed)
        lo, hi = math.log(self.min_len), math.log(self.max_len)
        return [int(math.exp(rng.uniform(lo, hi))) for _ in range(self.num_requests)]

    def mixed_lengths(self) -> tuple[list[int], list[int]]:
        """(long, short) prompt lengths of the mixed workload, uniform in 4096..max_len and 64..512."""
        rng = random.Random(self.seed + 2)
        longs = [rng.randint(min(4096, self.max_len), self.max_len) for _ in range(self.num_mixed_long)]
        shorts = [rng.randint(64, 512) for _ in range(self.num_mixed_short)]
        return longs, shorts


@dataclasses.dataclass(frozen=True)
class Record:
    num_prompt_tokens: int
    ttft_s: float
    tpot_s: float | None
    decision: str | None
    reason: str | None
    predicted_ttft_s: float | None
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
                      "max_model_len": settings.max_len + max(settings.max_tokens, settings.mixed_long_tokens) + 16},
        "topology": {"mode": "disaggregated"},
        "transfer": transfer,
        "router": {"port": 0, "request_timeout_s": 300.0, "health_interval_s": 1.0, "max_queued_requests": 1024,
                   "report_route": True,  # the bench reads the router's predictions from pdkv_route
                   "planner": {"mode": mode, "exploration_rate": settings.exploration_rate,
                               "tpot_weight": settings.tpot_weight, "min_samples": 3, "seed": settings.seed}},
    })


def _deployment(config: DeployConfig, cpus: tuple[int | None, int | None]) -> PinnedDeployment:
    """1P1D, each worker in a process of its own with one torch thread, pinned to its own core where the
    machine has two, and the real Router here."""
    plans = [WorkerPlan(wid, role, None if cpu is None else (cpu,), 1)
             for (wid, role), cpu in zip((("prefill-0", Role.PREFILL), ("decode-0", Role.DECODE)), cpus, strict=True)]
    return PinnedDeployment(config, plans, "planner-bench")


def worker_cpus() -> tuple[int | None, int | None]:
    """P on one core, D on another, where this process may use two; else unpinned."""
    if not hasattr(os, "sched_getaffinity"):
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    return (cpus[0], cpus[1]) if len(cpus) >= 2 else (None, None)


async def _one(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> Record:
    body = {"model": "pdkv-bench", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    t0 = time.perf_counter()
    first = last = None
    num_tokens, route = 0, None
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for chunk in SSEStream(resp.content):
            for choice in chunk.get("choices", []):
                if choice.get("token_ids"):
                    last = time.perf_counter()
                    first = first or last
                    num_tokens += len(choice["token_ids"])
                route = choice.get("pdkv_route") or route
    if first is None or last is None:
        raise RuntimeError(f"{url}: the stream carried no token")
    tpot = (last - first) / (num_tokens - 1) if num_tokens > 1 else None
    error, route = None, route or {}
    measured = route.get("decode_start_s") or route.get("ttft_s")  # what the prediction is of (explain.py)
    if route.get("predicted_ttft_s") is not None and measured:
        error = abs(route["predicted_ttft_s"] - measured) / measured
    return Record(len(prompt), first - t0, tpot, route.get("decision"), route.get("reason"),
                  route.get("predicted_ttft_s"), error)


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(n)] for n in lengths]


async def _drive(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> list[Record]:
    """Closed loop: `concurrency` clients take the prompts from one queue."""
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


async def _drive_mixed(url: str, longs: list[list[int]], shorts: list[list[int]], long_tokens: int,
                       short_tokens: int) -> list[Record]:
    """The mixed workload's slice: one client sends the long prompts one after another (each
    decodes `long_tokens`), two interactive clients send the short ones meanwhile, starting
    once the first long prompt is under way."""
    records: list[Record] = []
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def stream(prompts: list[list[int]], num_tokens: int, delay_s: float) -> None:
            await asyncio.sleep(delay_s)
            for prompt in prompts:
                records.append(await _one(session, url, prompt, num_tokens))
        await asyncio.gather(stream(longs, long_tokens, 0.0), stream(shorts[0::2], short_tokens, 0.05),
                             stream(shorts[1::2], short_tokens, 0.1))
    return records


def summarize(records: list[Record]) -> dict:
    ttfts = [r.ttft_s for r in records]
    tpots = [r.tpot_s for r in records if r.tpot_s is not None]
    errors = [r.prediction_error for r in records if r.prediction_error is not None]
    return {"num_requests": len(records),
            "ttft_p50_s": percentile(ttfts, 50, math.nan), "ttft_p90_s": percentile(ttfts, 90, math.nan),
            "tpot_p90_s": percentile(tpots, 90, math.nan), "prediction_error_p50": percentile(errors, 50, math.nan),
            "local_share": sum(r.decision == "local" for r in records) / max(1, len(records))}


def run_link(link: str, settings: BenchSettings) -> tuple[dict, dict, dict]:
    """({(policy, load): summary}, the planner's figures, {(policy, load): records}) on one link; load
    "mixed" is the mixed workload. The three deployments live side by side and take the workload
    in turns, a slice each, so a change in the machine's load (other jobs) falls on every policy
    alike rather than on whichever ran then."""
    loads: list[int | str] = [*settings.loads, *(["mixed"] if settings.mixed else [])]
    records: dict[tuple[str, int | str], list[Record]] = {(m, load): [] for m in POLICIES for load in loads}
    warmup = prompts_of([min(n, settings.max_len) for n in WARMUP_LENGTHS], settings.seed + 1)
    prompts = prompts_of(settings.lengths(), settings.seed)
    long_lengths, short_lengths = settings.mixed_lengths()
    longs, shorts = prompts_of(long_lengths, settings.seed + 3), prompts_of(short_lengths, settings.seed + 4)
    cpus = worker_cpus()
    with contextlib.ExitStack() as stack:
        deps = {m: stack.enter_context(_deployment(deploy_config(m, link, settings), cpus)) for m in POLICIES}
        for dep in deps.values():
            dep.run(_drive(dep.url, warmup, 1, 4))
        for load in settings.loads:
            step = max(load, settings.slice_size)
            for start in range(0, len(prompts), step):
                for mode, dep in deps.items():
                    records[(mode, load)] += dep.run(_drive(dep.url, prompts[start:start + step], load,
                                                            settings.max_tokens))
        if settings.mixed:  # a slice = one long prompt and its share of the short ones
            per_long = max(1, len(shorts) // max(1, len(longs)))
            for i, long in enumerate(longs):
                part = shorts[i * per_long:(i + 1) * per_long]
                for mode, dep in deps.items():
                    records[(mode, "mixed")] += dep.run(_drive_mixed(dep.url, [long], part,
                                                                     settings.mixed_long_tokens,
                                                                     settings.max_tokens))
        planner = deps["planner"].router
        assert planner is not None
        figures = planner.planner.describe()
    return {key: summarize(recs) for key, recs in records.items()}, figures, records


def format_table(rows: list[dict]) -> str:
    head = (f"{'link':<10}{'load':>6}  {'policy':<20}{'TTFT p50':>10}{'TTFT p90':>10}{'TPOT p90':>10}"
            f"{'local':>7}{'pred err':>9}{'vs best fixed p50/p90':>24}")
    lines = [head, "-" * len(head)]
    for row in rows:
        ratio = ""
        if "vs_best_p50" in row:
            ratio = f"{row['vs_best_p50']:.2f} / {row['vs_best_p90']:.2f}"
        lines.append(f"{row['link']:<10}{row['load']!s:>6}  {row['policy']:<20}{row['ttft_p50_s'] * 1e3:>8.0f}ms"
                     f"{row['ttft_p90_s'] * 1e3:>8.0f}ms{row['tpot_p90_s'] * 1e3:>8.1f}ms"
                     f"{row['local_share']:>7.0%}{row['prediction_error_p50']:>9.2f}{ratio:>24}")
    return "\n".join(lines)


def run(settings: BenchSettings, decisions: list | None = None) -> list[dict]:
    """The table's rows; the planner's figures and per-request decisions go to `decisions`."""
    rows: list[dict] = []
    decisions = [] if decisions is None else decisions
    for link in settings.links:
        if link == "throttled" and "emulated_link" not in TransferSection.model_fields:
            print("throttled link: needs `transfer.emulated_link` (connectors/links/emulated_link.py); skipped")
            continue
        summaries, figures, records = run_link(link, settings)
        for load in [*settings.loads, *(["mixed"] if settings.mixed else [])]:
            best = {q: min(summaries[(m, load)][f"ttft_{q}_s"] for m in POLICIES[:2]) for q in ("p50", "p90")}
            for mode in POLICIES:
                row = {"link": link, "load": load, "policy": mode, **summaries[(mode, load)]}
                if mode == "planner":
                    row["vs_best_p50"] = row["ttft_p50_s"] / best["p50"]
                    row["vs_best_p90"] = row["ttft_p90_s"] / best["p90"]
                rows.append(row)
        logging.getLogger(__name__).info("planner figures (%s link): %s", link, json.dumps(figures))
        decisions.append({"link": link, "figures": figures,
                          "records": {f"{mode} {load}": [dataclasses.asdict(r) for r in recs]
                                      for (mode, load), recs in records.items()}})
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
    parser.add_argument("--no-mixed", action="store_true", help="skip the mixed workload")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--decisions", help="write the planner's figures and every request's record here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    links = tuple(x for x in args.links.split(",") if x)
    for link in links:
        if link not in ("fast", "throttled"):
            parser.error(f"--links: unknown link {link!r}; use fast and/or throttled")
    settings = BenchSettings(args.num_requests, tuple(int(x) for x in args.loads.split(",")), links, args.min_len,
                             args.max_len, args.max_tokens, args.bandwidth_mbps, args.latency_ms,
                             args.exploration_rate, args.tpot_weight, args.seed, mixed=not args.no_mixed)
    t0 = time.perf_counter()
    decisions: list = []
    rows = run(settings, decisions)
    print(format_table(rows))
    print(f"({settings.num_requests} requests per row, prompts {settings.min_len}..{settings.max_len} tokens "
          f"log-uniform, {settings.max_tokens} output tokens; throttled = {settings.bandwidth_mbps:g} Mbit/s, "
          f"{settings.latency_ms:g} ms; mixed = {settings.num_mixed_long} prompts of 4096..{settings.max_len} tokens "
          f"decoding {settings.mixed_long_tokens} tokens, one after another, beside "
          f"{settings.num_mixed_short} of 64..512 from 2 interactive clients; {time.perf_counter() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.decisions:
        with open(args.decisions, "w") as f:
            json.dump(decisions, f, indent=1)


if __name__ == "__main__":
    main()
