"""What `python -m pd.launch` says about a P/D deployment whose workers share one CPU machine.

On one CPU host, P and D share its cores. A P/D request's first token then takes P's prefill, the
KV copy and a step on D, one after the other, where a colocated worker takes one prefill on the
same cores: for a chat-sized prompt that is about twice the time to first token (measured on two
cores: docs/what-pd-is-for.md#one-small-cpu-box-where-pd-costs-ttft). What P/D buys on such a box is
that D's decodes never stall behind a long prompt's prefill; a short prompt is better computed on D
(`router.planner.local_prefill_max_tokens`, or `mode: planner`).

Guarantee: `one_box_notice` returns one line (None where it does not apply: colocated, GPU
workers, or workers on a cluster this launcher cannot see); the line says whether the box is too
small for P/D at all (fewer cores than workers) and whether short prompts already stay on D.
"""
from __future__ import annotations

import os

from pd.cluster.config import DeployConfig

SUGGESTED_LOCAL_PREFILL_MAX_TOKENS = 256  # chat turns stay on D, documents go to P (docs/what-pd-is-for.md)


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS reports one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def one_box_notice(config: DeployConfig, num_cores: int, workers_here: bool) -> str | None:
    """The launcher's `notice:` line for a disaggregated CPU deployment whose workers all run on
    this machine (`workers_here`: an embedded Ray) with `num_cores` cores; None otherwise."""
    topo = config.topology
    if topo.mode.value != "disaggregated" or topo.device != "cpu" or not workers_here:
        return None
    num_workers = topo.num_prefill + topo.num_decode
    threads = topo.resolved_threads_per_worker
    shape = f"{topo.num_prefill}P{topo.num_decode}D"
    head = (f"notice: {shape} on one machine's {num_cores} CPU core{'s' if num_cores != 1 else ''} "
            f"({threads} thread{'s' if threads != 1 else ''} per worker): ")
    if num_cores < num_workers:
        head += (f"too small for P/D to pay (fewer cores than its {num_workers} workers); "
                 "serve colocated (topology.mode: colocated). ")
    head += ("a P/D first token takes P's prefill, the KV copy and a step on D, where colocated takes one "
             "prefill; ")
    planner = config.router.planner
    limit = planner.local_prefill_max_tokens
    if planner.mode == "always_local":
        return head + "router.planner.mode always_local: every prompt prefills on D, P stays idle"
    if limit > 0:
        return head + f"prompts of at most {limit} tokens prefill on D (router.planner.local_prefill_max_tokens)" + (
            ", longer ones where the planner predicts the first token sooner" if planner.mode == "planner" else
            ", longer ones on P")
    if planner.mode == "planner":
        return head + "router.planner.mode planner picks P or D per prompt by predicted TTFT"
    return head + (f"every prompt prefills on P: set router.planner.local_prefill_max_tokens "
                   f"(e.g. {SUGGESTED_LOCAL_PREFILL_MAX_TOKENS}) or mode: planner to keep short prompts on D")
