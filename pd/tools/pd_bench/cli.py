"""What P/D is for, on the real model: `python -m pd.tools.pd_bench [--plot pd_bench.png]`.

SmolLM2-135M-Instruct (deploy/smollm2.yaml's model and engine settings) served three ways
side by side in one run: colocated (one worker on both cores, two torch threads) and 1P1D (P
pinned to one core, D to the other, one thread each: the same cores and threads) on loopback
(`data_path: auto`) and on an emulated link (`transfer.emulated_link`, 200 Mbit/s + 5 ms by
default); with `transfer.streaming` modes too where this version has them
(pd/tools/pd_bench/deploy.py). Two workload classes at once (pd/tools/pd_bench/load.py):
interactive chat streams (short prompts, 128-token answers, closed loop) and long documents
(1k-2k fresh token ids, one every --doc-interval-s). The deployments take the mixed load in
turns, a slice each, so the machine's other jobs weigh on all alike. First, on each idle
deployment, 2k-token documents one at a time: what the KV transfer adds to TTFT beyond the
prefill (the router's `pdkv_timing` stages).

Printed: TTFT p50/p90 and TPOT p50/p90 per class and deployment, the idle table, the
acceptance ratios against colocated, whether the documents' tokens match colocated's (greedy),
and the load average at start and end; `--plot PATH` draws the per-class figures.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import time
from pathlib import Path

from pd.tools.pinned_deployment import REPO
from pd.tools.pd_bench.deploy import deploy_config, deployment, variants
from pd.tools.pd_bench.load import Record, Serials, Workload, run_idle, run_slice
from pd.tools.pd_bench.report import (class_figures, format_idle, format_ratios, format_table, identical,
                                      idle_figures, plot)

LINKS = ("loopback", "emulated")
PLANNER_MODES = ("always_disaggregate", "planner", "always_local")


def _load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _planner(args: argparse.Namespace) -> dict:
    return {"mode": args.planner_mode, "local_prefill_max_tokens": args.local_prefill_max_tokens}


def run(args: argparse.Namespace, load: Workload) -> tuple[dict, dict, dict]:
    """({label: {kind: figures}}, {label: idle figures}, {label: (same tokens, compared)})."""
    links = tuple(x for x in args.links.split(",") if x)
    chosen = variants(links)
    records: dict[str, list[Record]] = {v.label: [] for v in chosen}
    serials = Serials(args.seed)
    with contextlib.ExitStack() as stack:
        deps = {v.label: stack.enter_context(deployment(v, deploy_config(v, Path(args.config), args.bandwidth_mbps,
                                                                          args.latency_ms, _planner(args))))
                for v in chosen}
        warm = Workload(load.model, slice_s=1.0, num_chat_clients=1, chat_tokens=8, doc_interval_s=10.0,
                        doc_min_tokens=256, doc_max_tokens=256, doc_tokens=4)
        warm_serials = Serials(args.seed + 100)
        for label, dep in deps.items():
            dep.run(run_slice(dep.url, label, warm, warm_serials))
        for _ in range(args.num_idle):
            for label, dep in deps.items():
                records[label] += dep.run(run_idle(dep.url, label, load, serials, 1))
        for _ in range(args.num_slices):
            for label, dep in deps.items():
                records[label] += dep.run(run_slice(dep.url, label, load, serials))
    figures = {label: {kind: class_figures([r for r in recs if r.kind == kind]) for kind in ("chat", "doc")}
               for label, recs in records.items()}
    idle = {label: idle_figures([r for r in recs if r.kind == "idle"]) for label, recs in records.items()}
    same = {label: identical(recs, records["colocated"]) for label, recs in records.items() if label != "colocated"}
    if args.json:
        Path(args.json).write_text(json.dumps({"figures": figures, "idle": idle, "identical": same}, indent=1))
    return figures, idle, same


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pd.tools.pd_bench", description=__doc__.splitlines()[0])
    d = Workload(model="")
    parser.add_argument("--config", default=str(REPO / "deploy/smollm2.yaml"), help="model and engine settings")
    parser.add_argument("--links", default=",".join(LINKS), help="1P1D links: loopback and/or emulated")
    parser.add_argument("--bandwidth-mbps", type=float, default=200.0)
    parser.add_argument("--latency-ms", type=float, default=5.0)
    parser.add_argument("--num-slices", type=int, default=4,
                        help="turns of the mixed load per deployment (0: only the idle documents)")
    parser.add_argument("--slice-s", type=float, default=d.slice_s)
    parser.add_argument("--chat-clients", type=int, default=d.num_chat_clients)
    parser.add_argument("--chat-tokens", type=int, default=d.chat_tokens)
    parser.add_argument("--doc-interval-s", type=float, default=d.doc_interval_s)
    parser.add_argument("--doc-min-tokens", type=int, default=d.doc_min_tokens)
    parser.add_argument("--doc-max-tokens", type=int, default=d.doc_max_tokens)
    parser.add_argument("--doc-tokens", type=int, default=d.doc_tokens)
    parser.add_argument("--num-idle", type=int, default=3, help="idle 2k-token documents per deployment")
    parser.add_argument("--idle-tokens", type=int, default=d.idle_tokens)
    parser.add_argument("--planner-mode", default="always_disaggregate", choices=PLANNER_MODES,
                        help="router.planner.mode of the 1P1D deployments")
    parser.add_argument("--local-prefill-max-tokens", type=int, default=256,
                        help="router.planner.local_prefill_max_tokens of the 1P1D deployments: prompts with at most "
                             "this many tokens to compute prefill on D (0: every prompt takes the mode's path)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", help="write the chart here (PNG)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    for link in args.links.split(","):
        if link and link not in LINKS:
            parser.error(f"--links: unknown link {link!r}; use {' and/or '.join(LINKS)}")
    if not 0 < args.doc_min_tokens <= args.doc_max_tokens <= 2048 or not 0 < args.idle_tokens <= 2048:
        parser.error("document lengths must be in 1..2048 tokens, --doc-min-tokens <= --doc-max-tokens")
    if args.local_prefill_max_tokens < 0:
        parser.error("--local-prefill-max-tokens must be >= 0")
    if args.num_slices < 0 or args.num_idle < 0 or args.num_slices + args.num_idle == 0:
        parser.error("--num-slices and --num-idle must be >= 0, not both 0 (--num-slices 0: the idle table only)")
    if min(args.chat_clients, args.chat_tokens, args.doc_tokens) <= 0 or args.slice_s <= 0:
        parser.error("--slice-s, --chat-clients, --chat-tokens and --doc-tokens must be positive")
    logging.basicConfig(level=logging.WARNING)
    from pd.cluster.config import load_deploy_config

    load = Workload(load_deploy_config(args.config).model.name, args.slice_s, args.chat_clients, args.chat_tokens,
                    args.doc_interval_s, args.doc_min_tokens, args.doc_max_tokens, args.doc_tokens, args.idle_tokens)
    start_load, t0 = _load_average(), time.perf_counter()
    figures, idle, same = run(args, load)
    if args.num_slices:
        print(format_table(figures))
        print()
    if args.num_idle:
        print(format_idle(idle))
        print()
    if args.num_slices:
        print(format_ratios(figures))
    for label, (n_same, n) in same.items():
        print(f"{label}: {n_same}/{n} documents token-identical to colocated (greedy)")
    print(f"({args.num_slices} slices of {args.slice_s:g} s per deployment: {args.chat_clients} chat clients, "
          f"{args.chat_tokens}-token answers; a {args.doc_min_tokens}..{args.doc_max_tokens}-token document every "
          f"{args.doc_interval_s:g} s, {args.doc_tokens}-token answers; emulated link {args.bandwidth_mbps:g} Mbit/s "
          f"+ {args.latency_ms:g} ms; 1P1D router.planner: {_planner(args)}; "
          f"{time.perf_counter() - t0:.0f} s; load average {start_load} at start, "
          f"{_load_average()} at end)")
    if args.plot and args.num_slices:
        plot(figures, args.plot, f"pd_bench: SmolLM2-135M, load avg {start_load} -> {_load_average()}")
        print(f"chart: {args.plot}")
