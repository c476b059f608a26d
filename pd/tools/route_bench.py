"""Prefix-aware vs least-loaded vs round-robin routing on one workload, side by side.

`python -m pd.tools.route_bench [--tenants 12 --sessions 2 --turns 4 ...]`

Starts a 2P2D deployment in this process for each policy (real Workers with
engines, ZMQ connectors and KV event streams; the real Router and its KV
index; loopback HTTP), runs the same multi-tenant, multi-turn workload
against it and prints one table row per policy:
- prefix hit rate: prompt tokens P served from its prefix cache / prompt tokens;
- oracle: per request, the best hit any P held when the request was routed
  (the index knows every cache), over prompt tokens;
- bound: the hit rate of one unbounded cache that saw every earlier prompt;
- TTFT p50 / p90 (streamed, router-side first text), throughput (requests/s and
  generated tokens/s) and blocks transferred P->D (the D workers' blocks_recv).

Workload: `tenants` each have a long system prompt; `sessions` conversations per
tenant grow turn by turn (user text + a fixed assistant reply appended), all
conversations run at once up to `concurrency`. The KV pool of each worker
(`kv_memory_mb`) is sized so that one worker cannot hold every tenant's prefix.
The model is `pdkv-small`: random weights, 4 layers, hidden 256, byte tokenizer.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import random
import statistics
import string
import threading
import time

import aiohttp
import torch

from pd.cluster.config import DeployConfig
from pd.cluster.roles import Role, WorkerEndpoint
from pd.router.server import Router
from pd.tools.sse_stream import SSEStream
from pd.worker.worker import Worker, WorkerSpec

SECRET = "route-bench-secret-0123456789abcdef"
ARCH = {"vocab_size": 260, "hidden_size": 256, "intermediate_size": 512, "num_layers": 4, "num_heads": 8,
        "num_kv_heads": 4}
POLICIES = ("prefix_aware", "least_loaded", "round_robin")


@dataclasses.dataclass(frozen=True)
class Workload:
    tenants: int = 12
    sessions: int = 2
    turns: int = 4
    system_tokens: int = 512
    user_tokens: int = 48
    max_tokens: int = 8
    concurrency: int = 8
    seed: int = 0

    def conversations(self) -> list[list[str]]:
        """Each conversation's prompts, turn by turn."""
        rng = random.Random(self.seed)
        words = lambda n: "".join(rng.choices(string.ascii_lowercase + "     ", k=n))  # noqa: E731
        systems = [f"system of tenant {t}: " + words(self.system_tokens) for t in range(self.tenants)]
        out = []
        for t in range(self.tenants):
            for s in range(self.sessions):
                history, prompts = systems[t], []
                for turn in range(self.turns):
                    history += f"\nuser {s}.{turn}: " + words(self.user_tokens) + "\nassistant:"
                    prompts.append(history)
                    history += " noted, here is my answer."
                out.append(prompts)
        rng.shuffle(out)
        return out


def _config(kv_memory_mb: float) -> DeployConfig:
    return DeployConfig.from_dict({
        "model": {"name": "pdkv-small", "seed": 0, "architecture": ARCH},
        "cache": {"block_size": 16, "kv_memory_mb": kv_memory_mb},
        "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 2048, "max_model_len": 2048},
        "topology": {"mode": "disaggregated"},
        "transfer": {"lease_s": 30.0, "timeout_s": 10.0},
        "router": {"port": 0, "request_timeout_s": 120.0, "health_interval_s": 0.5, "max_queued_requests": 1024},
    })


@dataclasses.dataclass
class Record:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    best_hit: int
    completion_tokens: int


class _Deployment:
    def __init__(self, config: DeployConfig, policy: str, policy_options: dict) -> None:
        self.config, self.policy, self.options = config, policy, policy_options
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.workers: list[Worker] = []
        self.router: Router | None = None

    def run(self, coro, timeout_s: float = 600.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def __enter__(self) -> _Deployment:
        self.thread.start()
        endpoints = []
        for wid, role in (("prefill-0", Role.PREFILL), ("prefill-1", Role.PREFILL),
                          ("decode-0", Role.DECODE), ("decode-1", Role.DECODE)):
            worker = Worker(WorkerSpec(wid, role, self.config, SECRET))
            self.workers.append(worker)
            endpoints.append(WorkerEndpoint(wid, role, self.run(worker.start())))
        router = self.router = Router(self.config, endpoints, SECRET, policy=self.policy, policy_options=self.options)
        self.url = self.run(router.start())
        assert router.kv_feed is not None  # (the config turns prefix caching on)
        self.run(router.kv_feed.wait_exact([w.spec.worker_id for w in self.workers]))
        return self

    def __exit__(self, *exc) -> None:
        assert self.router is not None  # (set by __enter__)
        self.run(self.router.stop())
        for worker in self.workers:
            self.run(worker.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def blocks_recv(self) -> int:
        return sum(int(w.stats().get("transfer", {}).get("blocks_recv", 0)) for w in self.workers
                   if w.spec.role is Role.DECODE)


async def _one(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, pool) -> Record:
    body = {"model": "pdkv-small", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    t0 = time.perf_counter()
    ttft, usage, rid = None, None, None
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for chunk in SSEStream(resp.content):
            rid = chunk.get("id", rid)
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    if usage is None:
        raise RuntimeError(f"{url}: the stream ended without a usage chunk")
    best = pool.last_best_hit.get((f"{rid}-0", "prefill"), 0)
    return Record(ttft or (time.perf_counter() - t0), usage["prompt_tokens"],
                  usage["prompt_tokens_details"]["cached_tokens"], best, usage["completion_tokens"])


async def _drive(url: str, work: Workload, pool) -> tuple[list[Record], float]:
    sem = asyncio.Semaphore(work.concurrency)
    records: list[Record] = []

    async def conversation(prompts: list[str]) -> None:
        async with sem:
            for prompt in prompts:
                records.append(await _one(session, url, prompt, work.max_tokens, pool))

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(c) for c in work.conversations()))
        return records, time.perf_counter() - t0


def unbounded_bound(work: Workload, block_size: int = 16) -> float:
    """Hit rate of one unbounded cache holding every earlier prompt's full blocks (the last
    prompt token is never a hit, as on a worker)."""
    seen: set[str] = set()
    hit = total = 0
    for prompts in work.conversations():  # the order of sessions does not change which prefixes exist
        for p in prompts:
            n = 0
            while (n + 1) * block_size <= len(p) - 1 and p[:(n + 1) * block_size] in seen:
                n += 1
            hit, total = hit + n * block_size, total + len(p)
            seen.update(p[:(i + 1) * block_size] for i in range(len(p) // block_size))
    return hit / total


def _pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def run_policy(policy: str, work: Workload, kv_memory_mb: float, options: dict) -> dict:
    with _Deployment(_config(kv_memory_mb), policy, options if policy == "prefix_aware" else {}) as dep:
        assert dep.router is not None  # (set by __enter__)
        records, seconds = asyncio.run(_drive(dep.url, work, dep.router.pool))
        blocks = dep.blocks_recv()
    prompt = sum(r.prompt_tokens for r in records)
    ttfts = [r.ttft_s for r in records]
    return {"policy": policy, "requests": len(records), "hit_rate": sum(r.cached_tokens for r in records) / prompt,
            "oracle": sum(r.best_hit for r in records) / prompt, "ttft_p50_s": _pct(ttfts, 50),
            "ttft_p90_s": _pct(ttfts, 90), "req_per_s": len(records) / seconds,
            "tok_per_s": sum(r.completion_tokens for r in records) / seconds, "blocks_p_to_d": blocks}


def format_table(rows: list[dict], bound: float) -> str:
    head = ("| policy | prefix hit rate | oracle (best P) | TTFT p50 s | TTFT p90 s | req/s | gen tok/s "
            "| blocks P->D |\n|---|---|---|---|---|---|---|---|")
    lines = [head] + [f"| {r['policy']} | {r['hit_rate']:.3f} | {r['oracle']:.3f} | {r['ttft_p50_s']:.3f} | "
                      f"{r['ttft_p90_s']:.3f} | {r['req_per_s']:.2f} | {r['tok_per_s']:.1f} | {r['blocks_p_to_d']} |"
                      for r in rows]
    lines.append(f"\nunbounded single-cache bound on the hit rate: {bound:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Workload()
    for field in dataclasses.fields(Workload):
        ap.add_argument(f"--{field.name.replace('_', '-')}", type=int, default=getattr(defaults, field.name))
    ap.add_argument("--kv-memory-mb", type=float, default=16.0, help="KV pool per worker")
    ap.add_argument("--queue-weight", type=float, default=1.0)
    ap.add_argument("--running-weight", type=float, default=16.0)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR)  # the table is the output; per-request warnings are noise here
    work = Workload(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Workload)})
    options = {"queue_weight": args.queue_weight, "running_weight": args.running_weight}
    rows = []
    for policy in args.policies.split(","):
        t0 = time.perf_counter()
        rows.append(run_policy(policy, work, args.kv_memory_mb, options))
        print(f"{policy}: done in {time.perf_counter() - t0:.1f}s", flush=True)
    print(format_table(rows, unbounded_bound(work)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
