"""KV transfer between TP gangs: GB/s per rank and in all, TP a -> b beside TP 1 -> 1 on the same bytes.

Every rank is its own process (`--rank-agent`, started by this one; nothing pickled: arguments on
the command line, one JSON line back), holding its heads of the same canonical pages (a seeded
random model's KV). This process plays both rank 0s' control (the gang's ticket and the fan-out
of a load to every D rank), so what is timed is the data plane: every D rank pulling its heads from
the P ranks that hold them, at once, over `tcp` or the mapped pools (`shm`).

    python -m pd.tools.gang_bench                       # P TP 2 -> D TP 1 and 1 -> 1, tcp and shm
    python -m pd.tools.gang_bench --p-tp 4 --d-tp 2 --kv-heads 8 --blocks 64 --reps 10 --json

Per run (a, b, path): the median over `--reps` loads of the whole gang's GB/s (canonical bytes
over the wall time of a load, from the fan-out to the last rank's answer) and each D rank's GB/s
(its bytes over its own pull time). Every load is checked: each D rank's pages must equal its
heads of the canonical pages (checksums, after the last rep).
"""
from __future__ import annotations

import argparse
import json
import secrets
import statistics
import subprocess
import sys
import threading


def _layout(args):
    from pd.engine.kv.layout import KVLayout
    from pd.engine.model.config import ModelConfig

    cfg = ModelConfig(hidden_size=64, num_layers=args.layers, num_heads=max(args.kv_heads, 8),
                      num_kv_heads=args.kv_heads, head_dim=args.head_dim)
    return KVLayout(cfg, block_size=args.block_size)


def _rank_pool(args, layout, tp: int, rank: int, fill: bool):
    from pd.engine.kv.page_pool import PagePool
    from pd.engine.parallel.head_slices import gather_heads, head_view, rank_layout, scatter_heads
    from pd.engine.parallel.tp import TPShape

    local = rank_layout(layout, tp)
    pool = PagePool(args.blocks + 1, local.page_size_bytes)
    if fill:
        heads = TPShape(tp, args.kv_heads).heads_of(rank)
        canonical = _canonical(args, layout)
        everything = list(range(args.blocks + 1))
        scatter_heads(head_view(local, pool), everything, 0,
                      gather_heads(canonical, everything, heads.start, len(heads)))
    return pool, local


def _canonical(args, layout):
    import torch

    from pd.engine.kv.page_pool import PagePool
    from pd.engine.parallel.head_slices import head_view

    pool = PagePool(args.blocks + 1, layout.page_size_bytes, shareable=False)
    rows = layout.bind(pool).token_rows
    rows.copy_(torch.randn(rows.shape, generator=torch.Generator().manual_seed(args.seed)))
    return head_view(layout, pool)


def _agent_main(args) -> None:
    """A child: one rank's pool and agent, until the control stops it or stdin closes."""
    import os

    import torch

    torch.set_num_threads(1)
    from connectors.zmq.gang.head_plan import HeadGeometry, RankHeads
    from connectors.zmq.gang.rank_agent import RankAgent
    from pd.engine.parallel.tp import TPShape

    layout = _layout(args)
    prefill = args.side == "p"
    pool, local = _rank_pool(args, layout, args.tp, args.rank, fill=prefill)
    heads = TPShape(args.tp, args.kv_heads).heads_of(args.rank)
    agent = RankAgent(args.control, pool, HeadGeometry(local.num_kv_heads, local.head_dim, torch.float32),
                      RankHeads(args.rank, heads.start, len(heads)), serve=prefill)
    threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()  # parent gone: exit
    print(json.dumps({"rank": args.rank, "side": args.side}), flush=True)
    agent.join()


def _spawn(args, control: str, side: str, tp: int, rank: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pd.tools.gang_bench", "--rank-agent", "--control", control, "--side", side,
           "--tp", str(tp), "--rank", str(rank)]
    for k in ("kv_heads", "head_dim", "layers", "block_size", "blocks", "seed"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def run_pair(args, p_tp: int, d_tp: int, path: str) -> dict:
    """Starts a P gang of `p_tp` and a D gang of `d_tp` rank processes and times `args.reps` loads."""
    from connectors.zmq.gang.gang_control import GangControl
    from connectors.zmq.gang.head_plan import block_bytes
    from connectors.zmq.paths.page_access import digest
    from pd.engine.parallel.head_slices import gather_heads
    from pd.engine.parallel.tp import TPShape

    p_ctl, d_ctl = GangControl(p_tp), GangControl(d_tp)
    procs = [_spawn(args, p_ctl.address, "p", p_tp, r) for r in range(p_tp)]
    procs += [_spawn(args, d_ctl.address, "d", d_tp, r) for r in range(d_tp)]
    try:
        p_ctl.wait_ranks(args.start_timeout_s)
        d_ctl.wait_ranks(args.start_timeout_s)
        src = list(range(1, args.blocks + 1))
        dst = list(reversed(src))  # other block ids on D
        walls: list[float] = []
        per_rank: dict[int, list[float]] = {r: [] for r in range(d_tp)}
        for _ in range(args.reps + 1):  # the first load warms sockets and mappings: not counted
            ticket = secrets.token_bytes(16)
            p_ctl.grant(ticket, src, ttl_s=120.0)
            try:
                res = d_ctl.load(ticket, p_ctl.sources(), src, dst, path, timeout_s=120.0)
            finally:
                p_ctl.revoke(ticket)
            if not res.ok:
                raise RuntimeError(f"load failed: {res.cause} ({len(res.bad)} bad blocks)")
            walls.append(res.seconds)
            for r in range(d_tp):
                per_rank[r].append(sum(res.by_rank[r].values()) / res.rank_seconds[r])
        walls, per_rank = walls[1:], {r: v[1:] for r, v in per_rank.items()}
        layout = _layout(args)
        canonical = _canonical(args, layout)
        for r in range(d_tp):  # each D rank holds exactly its heads of the canonical pages
            heads = TPShape(d_tp, args.kv_heads).heads_of(r)
            want = [digest(b) for b in block_bytes(gather_heads(canonical, src, heads.start, len(heads)))]
            if d_ctl.digests(r, dst) != want:
                raise RuntimeError(f"D rank {r} does not hold its heads of the canonical pages")
        nbytes = len(src) * layout.page_size_bytes
        return {"p_tp": p_tp, "d_tp": d_tp, "path": path, "bytes": nbytes,
                "gbps": nbytes / statistics.median(walls) / 1e9,
                "rank_gbps": [statistics.median(per_rank[r]) / 1e9 for r in range(d_tp)],
                "rank_bytes": [sum(res.by_rank[r].values()) for r in range(d_tp)],
                "by_rank": {str(r): {str(p): n for p, n in res.by_rank[r].items()} for r in range(d_tp)}}
    finally:
        d_ctl.close()
        p_ctl.close()
        for p in procs:
            try:
                if p.stdin is not None:
                    p.stdin.close()
                p.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                p.kill()
                p.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--p-tp", type=int, default=2)
    ap.add_argument("--d-tp", type=int, default=1)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--paths", default="tcp,shm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout-s", type=float, default=120.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rank-agent", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--control", help=argparse.SUPPRESS)
    ap.add_argument("--side", choices=("p", "d"), help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank_agent:
        _agent_main(args)
        return 0
    from pd.engine.parallel.tp import TPShape

    for tp in (args.p_tp, args.d_tp):
        TPShape(tp, args.kv_heads)  # refuses a TP the KV heads cannot be split by, naming both
    paths = [p for p in args.paths.split(",") if p]
    if any(p not in ("tcp", "shm") for p in paths) or args.blocks < 1 or args.reps < 1:
        ap.error("--paths takes tcp and/or shm; --blocks and --reps must be positive")
    rows = [run_pair(args, a, b, path) for path in paths for a, b in ((1, 1), (args.p_tp, args.d_tp))]
    if args.json:
        print(json.dumps(rows))
        return 0
    mib = rows[0]["bytes"] / 2**20
    print(f"{args.blocks} canonical pages ({mib:.1f} MiB), KV heads {args.kv_heads}, median of {args.reps} loads")
    print(f"{'path':5} {'P->D':6} {'GB/s all':>9}  GB/s per D rank (MiB received)")
    for r in rows:
        ranks = ", ".join(f"D{i} {g:.2f} ({n / 2**20:.1f})"
                          for i, (g, n) in enumerate(zip(r["rank_gbps"], r["rank_bytes"], strict=True)))
        print(f"{r['path']:5} {r['p_tp']}->{r['d_tp']:<3} {r['gbps']:9.2f}  {ranks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
