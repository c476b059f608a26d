"""pdkv KVCacheManager benchmark, comparable line for line with vLLM's anchor.

    python -m kvcache.bench [--trace FILE] [--concurrency N] [--hash sha256|xxhash]
    python -m kvcache.bench --vs-vllm [VENV] [--rounds 3] [--concurrency 64]

Replays a request trace through one full-attention KVCacheManager exactly like
../shared/anchors/vllm_kv_bench.py does for vLLM: per request get_computed_blocks ->
allocate_slots(prompt) -> decode_steps x allocate_slots(1) -> free, one sampled token appended
per step; C > 1 interleaves C live requests round-robin. Only manager calls are timed into
manager_ops_per_s (get_computed_blocks, allocate prompt, allocate decode, free); request
construction and token appends (which hash new blocks) are timed separately, as in the anchor.
The trace is either read from a JSON-lines file written by the anchor's --dump-trace or
generated with the anchor's generator (numpy default_rng(seed), same defaults), so both
sides see the identical workload. Prints one line `JSON:{...}` with the anchor's keys.

--vs-vllm runs the anchor script in the given venv and this benchmark alternately (fresh
processes, same generated trace, sha256 on both), checks that the trace and the decisions
(prefix_hit_rate, free_blocks_end, hit_tokens, alloc_failures) agree, and prints both
figures and the median ratio as one `JSON:{...}` line; it exits non-zero if the traces or the
decisions differ.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvcache import (
    BlockHasher,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    Request,
)

DEFAULT_VENV = Path.home() / ".cache" / "pdkv-anchors" / "vllm-venv"
# The anchors live in the project's shared folder beside the checkout (../shared/anchors).
_SHARED_ANCHORS = Path(__file__).resolve().parents[2] / "shared" / "anchors"
DEFAULT_ANCHOR = Path(os.environ.get("PDKV_ANCHORS_DIR", _SHARED_ANCHORS)) / "vllm_kv_bench.py"
MANAGER_OPS = ("get_computed_blocks", "allocate_prompt", "allocate_decode", "free")
TIMED = ("make_request",) + MANAGER_OPS[:3] + ("append_token", "free")
TRACE_ARGS = ("requests", "block_size", "num_blocks", "max_model_len", "prompt_min", "prompt_max",
              "prefix_len", "share_frac", "decode_steps", "vocab", "seed")


# --- trace -----------------------------------------------------------------------------------
def make_trace(n, seed, prompt_min, prompt_max, prefix_len, share_frac, decode_steps, vocab):
    """The anchor's generator, draw for draw (same rng calls in the same order)."""
    import numpy as np  # only the generator needs numpy; kvcache itself never imports it

    rng = np.random.default_rng(seed)
    system_prefix = rng.integers(0, vocab, prefix_len).tolist()
    trace = []
    for i in range(n):
        plen = int(rng.integers(prompt_min, prompt_max + 1))
        shared = bool(rng.random() < share_frac)
        if shared:
            suffix = max(plen - prefix_len, 16)
            prompt = system_prefix + rng.integers(0, vocab, suffix).tolist()
        else:
            prompt = rng.integers(0, vocab, plen).tolist()
        decode = rng.integers(0, vocab, decode_steps + 1).tolist()
        trace.append({"id": str(i), "prompt": prompt, "decode": decode, "shared": shared})
    return trace


def load_trace(path) -> list[dict]:
    trace = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                trace.append({"id": str(item["id"]), "prompt": list(item["prompt"]),
                              "decode": list(item["decode"]), "shared": item.get("shared")})
            except (ValueError, KeyError, TypeError) as e:
                raise SystemExit(f"{path}:{lineno}: not a trace line ({e})") from e
    return trace


def dump_trace(trace, path) -> None:
    with open(path, "w") as f:
        for item in trace:
            f.write(json.dumps(item) + "\n")


def trace_for(args) -> list[dict]:
    if args.trace:
        trace = load_trace(args.trace)
        args.requests = len(trace)
        short = [t["id"] for t in trace if len(t["decode"]) < args.decode_steps + 1]
        if short:
            raise SystemExit(f"trace has fewer than --decode-steps+1 decode tokens (ids {short[:5]})")
        return trace
    return make_trace(args.requests, args.seed, args.prompt_min, args.prompt_max,
                      args.prefix_len, args.share_frac, args.decode_steps, args.vocab)


# --- replay (mirrors the anchor's run()) ------------------------------------------------------
def make_manager(args) -> KVCacheManager:
    spec = FullAttentionSpec(block_size=args.block_size, num_kv_heads=1, head_size=1,
                             dtype="float32")
    cfg = KVCacheConfig(num_blocks=args.num_blocks,
                        groups=(KVCacheGroupSpec(layer_names=("layer",), spec=spec),))
    return KVCacheManager(cfg, args.max_model_len, enable_caching=True,
                          hash_block_size=args.block_size)


def run(args, trace, mgr: KVCacheManager | None = None) -> dict:
    """Replay `trace`; `mgr` (default: make_manager(args)) lets a caller audit the pool."""
    hasher = BlockHasher(block_size=args.block_size, algorithm=args.hash)
    mgr = make_manager(args) if mgr is None else mgr
    t = {k: 0.0 for k in TIMED}
    n = {k: 0 for k in TIMED}
    totals = {"prompt_tokens": 0, "hit_tokens": 0, "alloc_fail": 0}
    pc = time.perf_counter
    max_tokens = args.decode_steps + 1
    decode_steps = args.decode_steps

    def start(item):
        t0 = pc()
        req = Request(item["id"], item["prompt"], block_hasher=hasher, max_tokens=max_tokens)
        t1 = pc()
        blocks, num_hit = mgr.get_computed_blocks(req)
        t2 = pc()
        new_blocks = mgr.allocate_slots(req, req.num_tokens - num_hit, num_hit, blocks)
        t3 = pc()
        t["make_request"] += t1 - t0
        t["get_computed_blocks"] += t2 - t1
        t["allocate_prompt"] += t3 - t2
        n["make_request"] += 1
        n["get_computed_blocks"] += 1
        n["allocate_prompt"] += 1
        totals["prompt_tokens"] += req.num_prompt_tokens
        totals["hit_tokens"] += num_hit
        if new_blocks is None:
            totals["alloc_fail"] += 1
            return None
        req.num_computed_tokens = req.num_tokens
        t4 = pc()
        req.append_output_token_ids(item["decode"][0])
        t["append_token"] += pc() - t4
        n["append_token"] += 1
        return [req, item, 0]

    def step(live):
        req, item, k = live
        t0 = pc()
        nb = mgr.allocate_slots(req, req.num_tokens - req.num_computed_tokens)
        t1 = pc()
        t["allocate_decode"] += t1 - t0
        n["allocate_decode"] += 1
        if nb is None:
            totals["alloc_fail"] += 1
        req.num_computed_tokens = req.num_tokens
        t2 = pc()
        req.append_output_token_ids(item["decode"][k + 1])
        t["append_token"] += pc() - t2
        n["append_token"] += 1
        live[2] = k + 1
        return live[2] >= decode_steps

    def finish(live):
        t0 = pc()
        mgr.free(live[0])
        t["free"] += pc() - t0
        n["free"] += 1

    wall0 = pc()
    pending = iter(trace)
    live: list = []
    exhausted = False
    while True:
        while not exhausted and len(live) < args.concurrency:
            item = next(pending, None)
            if item is None:
                exhausted = True
                break
            lv = start(item)
            if lv is not None:
                live.append(lv)
        if not live:
            break
        still = []
        for lv in live:
            if step(lv):
                finish(lv)
            else:
                still.append(lv)
        live = still
    wall = pc() - wall0

    mgr_time = sum(t[k] for k in MANAGER_OPS)
    mgr_nops = sum(n[k] for k in MANAGER_OPS)
    return {
        "impl": "pdkv",
        "vllm_version": None,
        "torch_version": None,
        "args": vars(args),
        "wall_s": round(wall, 3),
        "manager_ops": mgr_nops,
        "manager_time_s": round(mgr_time, 3),
        "manager_ops_per_s": round(mgr_nops / mgr_time),
        "ops_per_s_wall": round(mgr_nops / wall),
        "requests_per_s_wall": round(len(trace) / wall, 1),
        "prefix_hit_rate": round(totals["hit_tokens"] / totals["prompt_tokens"], 4),
        "prompt_tokens": totals["prompt_tokens"],
        "hit_tokens": totals["hit_tokens"],
        "alloc_failures": totals["alloc_fail"],
        "mean_us": {k: round(t[k] / n[k] * 1e6, 2) for k in TIMED if n[k]},
        "total_s": {k: round(v, 3) for k, v in t.items()},
        "free_blocks_end": mgr.block_pool.get_num_free_blocks(),
    }


# --- side by side with vLLM -----------------------------------------------------------------
def _json_line(stdout: str, what: str) -> dict:
    for line in reversed(stdout.splitlines()):
        if line.startswith("JSON:"):
            return json.loads(line[5:])
    raise RuntimeError(f"{what} printed no JSON line; output tail:\n{stdout[-2000:]}")


def _trace_flags(args) -> list[str]:
    flags = []
    for name in TRACE_ARGS:
        flags += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return flags + ["--concurrency", str(args.concurrency), "--hash", "sha256"]


def _run_cmd(cmd, what, timeout, env=None) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return _json_line(proc.stdout, what)


def _file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def vs_vllm(args) -> dict:
    """Alternate anchor and pdkv runs; returns both figure lists and the median ratio."""
    python = Path(args.vs_vllm) / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no python in vLLM venv {args.vs_vllm} (run setup_vllm_anchor.sh)")
    if not Path(args.anchor).exists():
        raise SystemExit(f"anchor script not found: {args.anchor}")
    flags = _trace_flags(args)
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    vllm_runs, pdkv_runs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs = Path(tmp) / "pdkv.jsonl", Path(tmp) / "vllm.jsonl"
        for i in range(args.rounds):
            dump = ["--dump-trace", str(theirs)] if i == 0 else []
            vllm_runs.append(_run_cmd([str(python), str(args.anchor), *flags, *dump],
                                      "vLLM anchor", args.timeout))
            dump = ["--dump-trace", str(ours)] if i == 0 else []
            pdkv_runs.append(_run_cmd([sys.executable, "-m", "kvcache.bench", *flags, *dump],
                                      "pdkv bench", args.timeout, env=env))
            print(f"round {i + 1}/{args.rounds}: vLLM {vllm_runs[-1]['manager_ops_per_s']} "
                  f"ops/s, pdkv {pdkv_runs[-1]['manager_ops_per_s']} ops/s", file=sys.stderr)
        trace_identical = _file_sha256(ours) == _file_sha256(theirs)
    decision_keys = ("prefix_hit_rate", "free_blocks_end", "hit_tokens", "prompt_tokens",
                     "alloc_failures", "manager_ops")
    disagreements = {k: [r[k] for r in vllm_runs + pdkv_runs] for k in decision_keys
                     if len({json.dumps(r[k]) for r in vllm_runs + pdkv_runs}) != 1}
    v_ops = [r["manager_ops_per_s"] for r in vllm_runs]
    p_ops = [r["manager_ops_per_s"] for r in pdkv_runs]
    return {
        "comparison": "pdkv vs vLLM KVCacheManager, same trace, sha256 both",
        "vllm_version": vllm_runs[0]["vllm_version"],
        "concurrency": args.concurrency,
        "requests": args.requests,
        "rounds": args.rounds,
        "trace_identical": trace_identical,
        "decisions_agree": not disagreements,
        "disagreements": disagreements,
        "vllm_manager_ops_per_s": v_ops,
        "pdkv_manager_ops_per_s": p_ops,
        "vllm_median": statistics.median(v_ops),
        "pdkv_median": statistics.median(p_ops),
        "ratio_median": round(statistics.median(p_ops) / statistics.median(v_ops), 2),
        "ratio_per_round": [round(p / v, 2) for p, v in zip(p_ops, v_ops, strict=True)],
        "prefix_hit_rate": {"vllm": vllm_runs[0]["prefix_hit_rate"],
                            "pdkv": pdkv_runs[0]["prefix_hit_rate"]},
        "free_blocks_end": {"vllm": vllm_runs[0]["free_blocks_end"],
                            "pdkv": pdkv_runs[0]["free_blocks_end"]},
        "vllm_mean_us": vllm_runs[0]["mean_us"],
        "pdkv_mean_us": pdkv_runs[0]["mean_us"],
    }


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kvcache.bench",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default="", help="JSON-lines trace (anchor's --dump-trace)")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=10000)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--prompt-min", type=int, default=512)
    ap.add_argument("--prompt-max", type=int, default=4096)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--share-frac", type=float, default=0.5)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hash", default="sha256", choices=("sha256", "xxhash"))
    ap.add_argument("--dump-trace", default="", help="write the replayed trace as JSON lines")
    ap.add_argument("--vs-vllm", nargs="?", const=str(DEFAULT_VENV), default=None,
                    metavar="VENV", help=f"compare with vLLM in VENV (default {DEFAULT_VENV})")
    ap.add_argument("--rounds", type=int, default=3, help="--vs-vllm: runs per side")
    ap.add_argument("--anchor", default=str(DEFAULT_ANCHOR), help="vllm_kv_bench.py path")
    ap.add_argument("--timeout", type=float, default=900, help="--vs-vllm: seconds per run")
    args = ap.parse_args(argv)
    if args.concurrency < 1 or args.requests < 1 or args.rounds < 1:
        ap.error("--concurrency, --requests and --rounds must be >= 1")
    if args.vs_vllm is not None and args.trace:
        ap.error("--vs-vllm uses the generated trace (the anchor cannot read --trace files)")
    if args.vs_vllm is not None and args.hash != "sha256":
        ap.error("--vs-vllm compares sha256 on both sides")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.vs_vllm is not None:
        result = vs_vllm(args)
        print("JSON:" + json.dumps(result))
        if not (result["trace_identical"] and result["decisions_agree"]):
            raise SystemExit("pdkv and vLLM replayed different traces or made different decisions")
        return
    trace = trace_for(args)
    if args.dump_trace:
        dump_trace(trace, args.dump_trace)
    print("JSON:" + json.dumps(run(args, trace)))


if __name__ == "__main__":
    main()
