"""Prefix-aware vs least-loaded vs round-robin routing on one workload, side by side.

`python -m pd.tools.route_bench [--workload sessions|branching|bursts] [--seeds 3] ...`

Starts a 2P2D deployment for each policy (real Workers, each in a process of its own as a
deployment runs them, with engines, ZMQ connectors and KV event streams; the real Router
and its KV index in this process; loopback HTTP), runs the same workload against it
(pd.tools.route_bench.workload: `sessions`, multi-turn chains; `branching`, tree-shaped
multi-tenant traffic with one-offs and client aborts; `bursts`, those trees arriving in bursts of
one tenant's conversations) and prints one table row per policy.
The load is closed loop by default (`--concurrency` conversations at once, the next one
starting when one ends) or open loop with `--rate R` (conversations start at Poisson
arrival times, R per second, whatever the deployment's speed, as users arrive). Columns:
- prefix hit rate: prompt tokens P served from its prefix cache / prompt tokens;
- oracle: per request, the best hit any P held when the request was routed
  (the index knows every cache), over prompt tokens;
- choice loss / late loss: how the policy's hit falls short of the oracle: the
  chosen P was predicted less than the best one (choice), or held less by the time
  the prompt ran than the index predicted at routing (late: evicted meanwhile, or
  computed by a request still in flight), each over prompt tokens (late loss can be
  negative: a prefix computed meanwhile by another request is a hit no one predicted);
- bound: the hit rate of one unbounded cache that saw every earlier prompt;
- TTFT p50 / p90 (streamed: to the chunk of the first token, which the router writes even where
  its text is empty; the last table also gives the p90 to the first visible text), throughput (requests/s and
  generated tokens/s) and blocks transferred P->D (the D workers' blocks_recv).
Aborted requests are counted apart and left out of every other figure. Under each
table a line per policy gives the share of requests on the busiest P and D, and for
the slowest tenth of requests their mean TTFT stages (the router's `pdkv_timing`),
prompt, cached and best-hit tokens. With `--seeds N` the workload runs with seeds
seed..seed+N-1. A last table puts the policies side by side per seed: prefix_aware's hit
rate over its oracle, and the TTFT p50 / p90 of prefix_aware, least_loaded and round_robin
with prefix_aware's ratios to the other two. After each run the index is compared with
every worker's cache (pd.tools.route_bench.exactness): the `index exact` column.
`--repeats K` runs each seed and policy K times, each on a fresh deployment, and pools
their requests into one row: the TTFT p90 of one ~100-request run is its 10th-slowest
request and varies from run to run.
`--side-by-side` runs the policies at once, each deployment in a child process, so that
they share the machine's load (on a shared machine; on a quiet one, one after another
gives each deployment the cores it would have alone).
The model is `pdkv-small`: random weights, 4 layers, hidden 256, byte tokenizer.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import aiohttp
import torch

from pd.cluster.config import DeployConfig
from pd.cluster.roles import Role
from pd.tools.route_bench.exactness import index_matches_caches
from pd.tools.route_bench.report import METHOD, format_summary, format_table, request_figures
from pd.tools.route_bench.workload import (Abort, BranchingWorkload, BurstWorkload, Node, Workload, arrival_offsets,
                                           unbounded_bound)
from pd.tools.sse_stream import SSEStream
from pd.tools.pinned_deployment import PinnedDeployment, WorkerPlan

ARCH = {"vocab_size": 260, "hidden_size": 256, "intermediate_size": 512, "num_layers": 4, "num_heads": 8,
        "num_kv_heads": 4}
POLICIES = ("prefix_aware", "least_loaded", "round_robin")
WORKLOADS: dict[str, type] = {"sessions": Workload, "branching": BranchingWorkload, "bursts": BurstWorkload}
KV_MEMORY_MB = {"sessions": 16.0, "branching": 12.0, "bursts": 12.0}  # 256, 192, 192 blocks: every worker evicts
AnyWorkload = Workload | BranchingWorkload | BurstWorkload


def bench_config(kv_memory_mb: float) -> DeployConfig:
    return DeployConfig.from_dict({
        "model": {"name": "pdkv-small", "seed": 0, "architecture": ARCH},
        "cache": {"block_size": 16, "kv_memory_mb": kv_memory_mb},
        "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 2048, "max_model_len": 2048},
        "topology": {"mode": "disaggregated"},
        "transfer": {"lease_s": 30.0, "timeout_s": 10.0},
        "router": {"port": 0, "request_timeout_s": 120.0, "health_interval_s": 0.5, "max_queued_requests": 1024,
                   "report_route": True},  # the bench reads each answer's workers from pdkv_route
    })


@dataclasses.dataclass
class Record:
    ttft_s: float  # to the first streamed token
    prompt_tokens: int
    cached_tokens: int
    best_hit: int
    completion_tokens: int
    predicted_hit: int = 0  # the index's prediction on the chosen P
    workers: tuple[str | None, str | None] = (None, None)  # (P, D), from the `pdkv_route` extension
    stages: dict | None = None  # the `pdkv_timing` extension's stages, where the router has them
    start_s: float = 0.0  # when it was sent, seconds from the run's start
    text_s: float = 0.0  # time to the first chunk with visible text (ttft_s is to the first token's chunk)


PLANS = [WorkerPlan(wid, role, None, 1) for wid, role in (("prefill-0", Role.PREFILL), ("prefill-1", Role.PREFILL),
                                                          ("decode-0", Role.DECODE), ("decode-1", Role.DECODE))]


@contextlib.contextmanager
def deployment(config: DeployConfig, policy: str, policy_options: dict | None) -> Iterator[PinnedDeployment]:
    """2P2D, each worker in a process of its own (as a deployment runs them), the router here, its
    index exact on every worker before the first request."""
    with PinnedDeployment(config, PLANS, f"route-{policy}",
                          {"policy": policy, "policy_options": policy_options}) as dep:
        assert dep.router is not None and dep.router.kv_feed is not None  # (the config turns prefix caching on)
        dep.run(dep.router.kv_feed.wait_exact([p.worker_id for p in PLANS]), 120.0)
        yield dep


def _blocks_recv(dep: PinnedDeployment) -> int:
    """Blocks the D workers pulled from P, from their own stats."""
    assert dep.router is not None  # (set by __enter__)
    total = 0
    for load in dep.router.pool.all():
        if load.endpoint.role is Role.DECODE:
            stats = dep.run(dep.router.client.get_json(load.endpoint.url, "/internal/stats", 30.0), 60.0)
            total += int(stats.get("transfer", {}).get("blocks_recv", 0))
    return total


async def _one(session: aiohttp.ClientSession, url: str, node: Node, max_tokens: int, pool,
               run_t0: float) -> Record | None:
    """One request; None for an aborted one (the client goes away as the node says)."""
    body = {"model": "pdkv-small", "prompt": node.prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    t0 = time.perf_counter()
    ttft, text_s, usage, rid, stages = None, None, None, None, None
    route: dict = {}
    async with session.post(f"{url}/v1/completions", json=body, headers={"x-pdkv-timing": "1"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        if node.abort is Abort.HEADERS:
            resp.close()
            return None
        async for chunk in SSEStream(resp.content):
            if node.abort is Abort.FIRST_CHUNK:
                resp.close()
                return None
            rid = chunk.get("id", rid)
            if chunk.get("choices"):
                # the router writes a chunk per token: the first one is the first token, even where its text
                # is empty (this model's byte noise often starts with a cut UTF-8 character)
                if ttft is None:
                    ttft = time.perf_counter() - t0
                if text_s is None and chunk["choices"][0].get("text"):
                    text_s = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                route = choice.get("pdkv_route") or route
            stages = (chunk.get("pdkv_timing") or {}).get("stages", stages)
    if usage is None:
        raise RuntimeError(f"{url}: the stream ended without a usage chunk")
    key = (f"{rid}-0", "prefill")
    end = time.perf_counter() - t0
    return Record(ttft or end, usage["prompt_tokens"],
                  usage["prompt_tokens_details"]["cached_tokens"], pool.last_best_hit.get(key, 0),
                  usage["completion_tokens"], pool.last_predicted.get(key) or 0,
                  (route.get("prefill_worker"), route.get("decode_worker")), stages, t0 - run_t0,
                  text_s or end)


async def _drive(url: str, trees: list[Node], work: AnyWorkload,
                 pool) -> tuple[list[Record], int, float]:
    """Runs `work.concurrency` trees at once (closed loop), or starts each tree at its Poisson arrival
    time (`work.rate` > 0, open loop: later trees do not wait for earlier ones); a node's children go
    together once it answered."""
    sem = asyncio.Semaphore(work.concurrency if work.rate <= 0 else len(trees) or 1)
    if isinstance(work, BurstWorkload):
        offsets = work.arrivals()
    else:
        offsets = arrival_offsets(len(trees), work.rate, work.seed) if work.rate > 0 else [0.0] * len(trees)
    max_tokens, abort_max_tokens = work.max_tokens, getattr(work, "abort_max_tokens", work.max_tokens)
    records: list[Record] = []
    aborted = 0

    async def node_then_children(node: Node) -> None:
        nonlocal aborted
        record = await _one(session, url, node, abort_max_tokens if node.abort is not Abort.NONE else max_tokens,
                            pool, t0)
        if record is None:
            aborted += 1
        else:
            records.append(record)
        await asyncio.gather(*(node_then_children(c) for c in node.children))

    async def tree(root: Node, offset: float) -> None:
        await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
        async with sem:
            await node_then_children(root)

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(tree(t, offset) for t, offset in zip(trees, offsets, strict=True)))
        return records, aborted, time.perf_counter() - t0


@dataclasses.dataclass
class Run:
    """One run of a workload against a fresh deployment."""

    records: list[Record]
    aborted: int
    seconds: float
    blocks_p_to_d: int
    index_exact: dict[str, bool] = dataclasses.field(default_factory=dict)  # per worker, after the run


def run_policy(policy: str, work: AnyWorkload, kv_memory_mb: float, options: dict,
               repeats: int = 1) -> dict:
    """`repeats` runs, each on a fresh deployment (cold caches), pooled into one table row."""
    runs = []
    for _ in range(repeats):
        with deployment(bench_config(kv_memory_mb), policy,
                        (options or None) if policy == "prefix_aware" else None) as dep:
            runs.append(measure(dep, work))
    return summarize(policy, work.seed, runs)


def measure(dep: PinnedDeployment, work: AnyWorkload) -> Run:
    """Runs the workload against the deployment."""
    assert dep.router is not None  # (set by __enter__)
    records, aborted, seconds = asyncio.run(_drive(dep.url, work.trees(), work, dep.router.pool))
    blocks = _blocks_recv(dep)
    return Run(records, aborted, seconds, blocks, dep.run(index_matches_caches(dep.router), 120.0))


def summarize(policy: str, seed: int, runs: list[Run]) -> dict:
    """One table row over the runs' requests pooled: rates over all prompt tokens, TTFT percentiles over
    all requests (a p90 over a few hundred requests, not the 10th-slowest of one short run), and
    per-run means for the throughput and the blocks moved."""
    records = [r for run in runs for r in run.records]
    seconds = sum(run.seconds for run in runs)
    prompt = sum(r.prompt_tokens for r in records)
    rows = [{"run": i, **dataclasses.asdict(r)} for i, run in enumerate(runs) for r in run.records]
    return {"policy": policy, "seed": seed, "repeats": len(runs), "requests": len(records),
            "aborted": sum(run.aborted for run in runs), **request_figures(rows),
            "choice_loss": sum(r.best_hit - r.predicted_hit for r in records) / prompt,
            "late_loss": sum(r.predicted_hit - r.cached_tokens for r in records) / prompt,
            "req_per_s": len(records) / seconds,
            "tok_per_s": sum(r.completion_tokens for r in records) / seconds,
            "blocks_p_to_d": round(sum(run.blocks_p_to_d for run in runs) / len(runs)),
            "busiest_p_share": _busiest(records, 0), "busiest_d_share": _busiest(records, 1),
            "slowest_stages_s": _slowest_stages(records), "seconds": seconds,
            "index_checks": [ok for run in runs for ok in run.index_exact.values()], "records": rows}


def _busiest(records: list[Record], hop: int) -> float:
    """The share of requests that went to the busiest worker of the hop (0: P, 1: D)."""
    counts: dict[str, int] = {}
    for r in records:
        wid = r.workers[hop]
        if wid is not None:
            counts[wid] = counts.get(wid, 0) + 1
    return max(counts.values()) / sum(counts.values()) if counts else 0.0


def _slowest_stages(records: list[Record]) -> dict[str, float]:
    """Mean seconds per TTFT stage over the slowest tenth of requests (the TTFT p90 tail)."""
    tail = sorted(records, key=lambda r: r.ttft_s)[-max(1, len(records) // 10):]
    out: dict[str, float] = {}
    for r in tail:
        for name, value in (r.stages or {}).items():
            out[name] = out.get(name, 0.0) + value / len(tail)
    out["prompt_tokens"] = sum(r.prompt_tokens for r in tail) / len(tail)
    out["cached_tokens"] = sum(r.cached_tokens for r in tail) / len(tail)
    out["best_hit"] = sum(r.best_hit for r in tail) / len(tail)
    return {k: round(v, 3) for k, v in out.items()}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m pd.tools.route_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="sessions")
    names: dict[str, type] = {}
    for cls in WORKLOADS.values():
        for field in dataclasses.fields(cls):
            names.setdefault(field.name, float if field.type == "float" else int)
    for name, kind in names.items():  # defaults are the workload's own (None: not given)
        ap.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None)
    ap.add_argument("--seeds", type=int, default=1, help="run seeds seed..seed+N-1")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per seed and policy, each on a fresh deployment, pooled into one row (a TTFT p90 "
                         "of one short run is its 10th-slowest request: it varies from run to run)")
    ap.add_argument("--kv-memory-mb", type=float, default=None,
                    help="KV pool per worker; default 16 (256 blocks) for sessions, 12 (192 blocks) for branching")
    ap.add_argument("--queue-weight", type=float, default=None)
    ap.add_argument("--running-weight", type=float, default=None)
    ap.add_argument("--evict-aware", type=int, choices=(0, 1), default=None, help="prefix_aware: 0 counts hits whole")
    ap.add_argument("--evict-from", type=float, default=None)
    ap.add_argument("--pending-hits", type=int, choices=(0, 1), default=None,
                    help="prefix_aware: 1 also counts the blocks that prompts sent ahead to a worker will compute")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--json", help="also write the rows here, each with its requests' records")
    ap.add_argument("--side-by-side", action="store_true",
                    help="run the policies at once, each deployment in a process of its own, so that they share "
                         "the machine's load alike (on a shared machine the figures of runs one after another "
                         "differ by the load of the moment)")
    return ap


def _run_side_by_side(args, given: dict, seed: int, kv_memory_mb: float, options: dict) -> list[dict]:
    """One child process per policy, all at once; their rows come back as JSON files."""
    with tempfile.TemporaryDirectory() as tmp:
        children = []
        for policy in args.policies.split(","):
            argv = [sys.executable, "-m", "pd.tools.route_bench", "--workload", args.workload, "--seed", str(seed),
                    "--policies", policy, "--repeats", str(args.repeats), "--kv-memory-mb", str(kv_memory_mb),
                    "--json", f"{tmp}/{policy}.json"]
            for name, value in {**given, **options}.items():
                argv += [f"--{name.replace('_', '-')}", str(value)]
            children.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL))
        for child, policy in zip(children, args.policies.split(","), strict=True):
            if child.wait(timeout=1800) != 0:
                raise RuntimeError(f"the {policy} run exited with status {child.returncode}")
        rows = []
        for policy in args.policies.split(","):
            with open(f"{tmp}/{policy}.json") as f:
                rows += json.load(f)
        return rows


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    cls = WORKLOADS[args.workload]
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if getattr(args, f.name) is not None}
    mine = {f.name for f in dataclasses.fields(cls)}
    others = {f.name for c in WORKLOADS.values() for f in dataclasses.fields(c)} - mine
    unknown = ["--" + n.replace("_", "-") for n in sorted(others) if getattr(args, n) is not None]
    if unknown:
        raise SystemExit(f"--workload {args.workload} takes no {', '.join(unknown)}")
    if args.repeats < 1 or args.seeds < 1:
        raise SystemExit("--repeats and --seeds must be at least 1")
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR)  # the table is the output; per-request warnings are noise here
    os.environ.setdefault("PDKV_LOG_LEVEL", "ERROR")  # the same for the worker processes (pd.tools.pinned_worker)
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)  # a worker writing to an aborted client
    options = {k: v for k in ("queue_weight", "running_weight", "evict_aware", "evict_from", "pending_hits")
               if (v := getattr(args, k)) is not None}
    first = given.pop("seed", 0)
    kv_memory_mb = args.kv_memory_mb or KV_MEMORY_MB[args.workload]
    rows = []
    for seed in range(first, first + args.seeds):
        work = cls(seed=seed, **given)
        seed_rows = []
        t0 = time.perf_counter()
        if args.side_by_side:
            seed_rows = _run_side_by_side(args, given, seed, kv_memory_mb, options)
            print(f"seed {seed}: {args.policies} side by side, done in {time.perf_counter() - t0:.1f}s", flush=True)
        for policy in [] if args.side_by_side else args.policies.split(","):
            seed_rows.append(run_policy(policy, work, kv_memory_mb, options, args.repeats))
            print(f"seed {seed} {policy}: done in {time.perf_counter() - t0:.1f}s", flush=True)
            t0 = time.perf_counter()
        pooled = f", {args.repeats} runs per policy pooled" if args.repeats > 1 else ""
        load = (f"open loop, bursts of {work.burst_size} trees, {work.rate:g} bursts/s"
                if isinstance(work, BurstWorkload) else f"open loop, {work.rate:g} conversations/s" if work.rate > 0
                else f"closed loop, {work.concurrency} at once")
        print(f"\nseed {seed} ({load}{pooled}):\n" + format_table(seed_rows, unbounded_bound(work.trees())),
              flush=True)
        for r in seed_rows:
            print(f"{r['policy']}: busiest P {r['busiest_p_share']:.2f} and D {r['busiest_d_share']:.2f} of the "
                  f"requests; slowest tenth, mean stage s: {r['slowest_stages_s']}", flush=True)
        rows += seed_rows
    print("\n" + format_summary(rows))
    print("\n" + METHOD)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
