"""gpu_check, served: the check model served through Ray and the router, colocated and as 1P1D on one GPU.

Deployments one after the other, on one embedded Ray instance (`pd.deploy.launch.Deployment`):
1. colocated, one worker: a load at each concurrency (1, 8, 32): TTFT and TPOT p50, output tokens/s;
2. 1P1D on one GPU (`deploy/gpu-1p1d-one-gpu.yaml`: each worker 0.5 of the GPU, its KV pool sized from
   that share): the same loads, plus the KV transfer time per request (the router's `kv_transfer_s`
   stage, p50, and the decode worker's mean load time from its /metrics).
Both answer the same greedy prompts (`return_token_ids`), and 1P1D's tokens must equal colocated's. That
comparison runs in float32 (`ServedPlan.greedy_dtype`) on its own colocated / 1P1D pair: in bfloat16, D's
one-token recompute of the last prompt token and a different batch shape round differently from
colocated's prefill, which flips near-tied argmaxes of random weights without anything being wrong (the
served dtype's agreement is reported beside it, for information).

The loads are `python -m pd.loadgen` in a process of its own (as `pd.launch --run-load` runs it: the
router's event loop then has this process's GIL to itself), random prompts, greedy,
ignore_eos, a different seed per concurrency so that no run hits an earlier run's prefix cache.

The model is the one-GPU config's: gpu_check's CHECK_MODEL shape (Qwen2.5-0.5B-like, 24 layers,
hidden 896) with the byte tokenizer's 260-id vocabulary (~0.36B parameters, bfloat16, random weights),
since a deployment without a checkpoint serves the byte tokenizer.

`measure_served` returns the section; `render_served` its markdown lines; `served_ok` whether every
load completed without failures, the greedy tokens matched and every KV pool ended all free.
`python -m pd.tools.gpu_check.served` runs it alone.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from pd.cluster.config import DeployConfig, load_deploy_config

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[3]
ONE_GPU_CONFIG = REPO / "deploy" / "gpu-1p1d-one-gpu.yaml"
LOAD_TIMEOUT_S = 300.0
HTTP_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class ServedPlan:
    """What the served run sends: loads per concurrency and the greedy comparison's prompts."""

    concurrencies: tuple[int, ...] = (1, 8, 32)
    prompts_per_slot: int = 2  # a load at concurrency c sends max(4, prompts_per_slot * c) requests
    input_len: int = 256
    output_len: int = 64
    greedy_prompts: int = 8
    greedy_tokens: int = 32
    greedy_dtype: str | None = "float32"  # None: the served dtype (no extra deployments)
    warmups: int = 2

    def num_prompts(self, concurrency: int) -> int:
        return max(4, self.prompts_per_slot * concurrency)


def served_configs(base: DeployConfig) -> dict[str, DeployConfig]:
    """The two deployments from one base (its model, cache, scheduler and GPU share): colocated, 1P1D."""
    router = {"router__port": 0, "router__host": "127.0.0.1"}
    return {"colocated": base.replace(topology__mode="colocated", topology__num_colocated=1, **router),
            "pd_one_gpu": base.replace(topology__mode="disaggregated", topology__num_prefill=1,
                                       topology__num_decode=1, **router)}


def greedy_prompts(plan: ServedPlan, seed: int = 7) -> list[str]:
    """Seeded printable prompts of varied lengths (the byte tokenizer: one token a byte)."""
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz ,."
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(plan.input_len // 4, plan.input_len)))
            for _ in range(plan.greedy_prompts)]


def _post_json(url: str, body: dict, api_key: str | None) -> dict:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as resp:
        return json.loads(resp.read())


def greedy_token_ids(url: str, prompts: list[str], max_tokens: int, api_key: str | None) -> list[list[int]]:
    """One non-streamed completion request carrying every prompt; each prompt's sampled token ids."""
    body = {"prompt": prompts, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    choices = sorted(_post_json(f"{url}/v1/completions", body, api_key)["choices"], key=lambda c: c["index"])
    return [list(c["token_ids"]) for c in choices]


def run_load(url: str, concurrency: int, plan: ServedPlan, config: DeployConfig) -> dict:
    """`python -m pd.loadgen` at one concurrency; the figures this check reports from its result JSON."""
    with tempfile.TemporaryDirectory(prefix="pdkv-served-") as tmp:
        result_path = Path(tmp) / "result.json"
        args = ["--base-url", url, "--dataset-name", "random", "--random-input-len", str(plan.input_len),
                "--random-output-len", str(plan.output_len), "--num-prompts", str(plan.num_prompts(concurrency)),
                "--max-concurrency", str(concurrency), "--request-rate", "inf", "--temperature", "0",
                "--ignore-eos", "--seed", str(concurrency), "--num-warmups", str(plan.warmups),
                "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
                "--disable-tqdm", "--save-result", "--result-filename", str(result_path)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        api_key = next(iter(config.router.tenant_keys().values()), None)
        if api_key:
            env["OPENAI_API_KEY"] = api_key  # in the environment, not on a command line
        if config.router.admin_key:
            env["PDKV_ADMIN_KEY"] = config.router.admin_key
        proc = subprocess.run([sys.executable, "-m", "pd.loadgen", *args], env=env, capture_output=True,
                              text=True, timeout=LOAD_TIMEOUT_S)
        if proc.returncode != 0 or not result_path.is_file():
            raise RuntimeError(f"pd.loadgen at concurrency {concurrency} exited {proc.returncode}: "
                               f"{(proc.stderr or proc.stdout)[-800:]}")
        result = json.loads(result_path.read_text())
    return load_figures(concurrency, result)


def load_figures(concurrency: int, result: dict) -> dict:
    """A loadgen result JSON -> this check's row: TTFT / TPOT p50, tokens/s and, after P/D, transfer time."""
    row = {"concurrency": concurrency, "completed": result["completed"], "failed": result["failed"],
           "ttft_p50_ms": round(result["median_ttft_ms"], 2), "ttft_p99_ms": round(result["p99_ttft_ms"], 2),
           "tpot_p50_ms": round(result["median_tpot_ms"], 3), "itl_p50_ms": round(result["median_itl_ms"], 3),
           "output_tokens_per_s": round(result["output_throughput"], 1), "duration_s": round(result["duration"], 2)}
    stages = (result.get("pdkv_ttft_breakdown") or {}).get("stages_p50_s") or {}
    if "kv_transfer_s" in stages:
        row["kv_transfer_p50_ms"] = round(1e3 * stages["kv_transfer_s"], 3)
    loads = result.get("pdkv_kv_load_latency_mean_ms") or {}
    if loads:
        row["kv_load_mean_ms"] = round(max(loads.values()), 3)  # the decode worker (the only one that loads)
    if result.get("pdkv_kv_loads"):
        row["kv_loads"] = int(result["pdkv_kv_loads"])
    return row


def serve_one(name: str, config: DeployConfig, plan: ServedPlan, prompts: list[str], loads: bool = True) -> dict:
    """Starts one deployment, runs the greedy prompts (and the loads), audits the pools, stops it."""
    from pd.deploy.launch import Deployment

    t0 = time.perf_counter()
    share = config.topology.gpus_per_worker if config.topology.device == "cuda" else None
    out: dict = {"topology": _shape(config), "gpus_per_worker": share}
    deployment = Deployment(config)
    try:
        url = deployment.start()
        out["start_s"] = round(time.perf_counter() - t0, 1)
        api_key = next(iter(config.router.tenant_keys().values()), None)
        out["greedy_token_ids"] = greedy_token_ids(url, prompts, plan.greedy_tokens, api_key)
        if loads:
            out["runs"] = [run_load(url, c, plan, config) for c in plan.concurrencies]
        audits = deployment.pool_audits()
        out["pools_all_free"] = bool(audits) and all(a.get("all_free") for a in audits.values())
        if not out["pools_all_free"]:
            out["pool_audits"] = {wid: a.get("detail") or a for wid, a in audits.items() if not a.get("all_free")}
    except Exception as exc:  # noqa: BLE001 - reported; the other deployment still runs
        logger.exception("served %s failed", name)
        out["error"] = f"{type(exc).__name__}: {exc}"[:800]
    finally:
        deployment.stop()
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def _shape(config: DeployConfig) -> str:
    topo = config.topology
    return (f"{topo.num_prefill}P{topo.num_decode}D" if topo.mode.value == "disaggregated"
            else f"colocated x{topo.num_colocated}")


def compare_greedy(reference: list[list[int]] | None, other: list[list[int]] | None) -> dict:
    """How many prompts got the same greedy tokens, and where the first difference is."""
    if not reference or not other or len(reference) != len(other):
        return {"identical": 0, "prompts": len(reference or []), "note": "missing tokens on one side"}
    same = sum(a == b for a, b in zip(reference, other, strict=True))
    out: dict = {"identical": same, "prompts": len(reference)}
    for i, (a, b) in enumerate(zip(reference, other, strict=True)):
        if a != b:
            at = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            out["first_mismatch"] = {"prompt": i, "token": at}
            break
    return out


def measure_served(base: DeployConfig | None = None, plan: ServedPlan | None = None,
                   on_part: Callable[[dict], None] | None = None) -> dict:
    """The served section: colocated, then 1P1D on one GPU, from `base` (default: the one-GPU config).
    `on_part` gets the section after each deployment, so a run stopped later keeps the earlier figures."""
    import ray

    from pd.deploy.launch import init_ray

    base = base if base is not None else load_deploy_config(ONE_GPU_CONFIG)
    plan = plan or ServedPlan()
    t0 = time.perf_counter()
    _release_this_process_gpu_memory()  # the workers plan their pools from the GPU's whole memory
    started_ray = not ray.is_initialized()
    if started_ray:
        init_ray(None, None, 256)  # the object store carries nothing big here
    section: dict = {"device": base.topology.device, "model": base.model.name,
                     "model_shape": dict(base.model.architecture), "dtype": base.model.dtype,
                     "plan": dataclasses.asdict(plan), "ray_gpus": ray.cluster_resources().get("GPU", 0.0)}
    prompts = greedy_prompts(plan)
    greedy_dtype = plan.greedy_dtype or base.model.dtype
    try:
        for name, config in served_configs(base).items():
            section[name] = serve_one(name, config, plan, prompts)
            if on_part is not None:
                on_part(section)
        pair = {name: section[name] for name in ("colocated", "pd_one_gpu")}
        if greedy_dtype != base.model.dtype:
            section["greedy_served_dtype"] = _compare_pair(pair)  # for information: rounding may flip ties
            greedy_base = base.replace(model__dtype=greedy_dtype,
                                       scheduler__max_num_seqs=max(8, plan.greedy_prompts))
            pair = {name: serve_one(f"{name} {greedy_dtype}", config, plan, prompts, loads=False)
                    for name, config in served_configs(greedy_base).items()}
            section["greedy_runs"] = {name: {k: v for k, v in part.items() if k != "greedy_token_ids"}
                                      for name, part in pair.items()}
    finally:
        if started_ray:
            ray.shutdown()
    section["greedy"] = {"dtype": greedy_dtype, **_compare_pair(pair)}
    section["seconds"] = round(time.perf_counter() - t0, 1)
    return section


def _compare_pair(pair: dict[str, dict]) -> dict:
    return compare_greedy(pair["colocated"].get("greedy_token_ids"), pair["pd_one_gpu"].get("greedy_token_ids"))


def _release_this_process_gpu_memory() -> None:
    """Earlier gpu_check steps ran engines in this process: free what torch's allocator still caches."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


def served_ok(section: dict) -> bool:
    """Both deployments ran every load without a failed request, their pools ended all free, and
    1P1D gave colocated's greedy tokens for every prompt."""
    if "error" in section:
        return False
    for name in ("colocated", "pd_one_gpu"):
        part = section.get(name) or {}
        if "error" in part or not part.get("pools_all_free") or not part.get("runs"):
            return False
        if any(r["failed"] or not r["completed"] for r in part["runs"]):
            return False
    for part in (section.get("greedy_runs") or {}).values():
        if "error" in part or not part.get("pools_all_free"):
            return False
    greedy = section.get("greedy") or {}
    return greedy.get("prompts", 0) > 0 and greedy.get("identical") == greedy.get("prompts")


def render_served(section: dict) -> list[str]:
    """Markdown lines: one table row per (deployment, concurrency), then the greedy comparison."""
    if "error" in section:
        return ["## Served through Ray and the router", "", f"- error: {section['error']}"]
    plan = section.get("plan", {})
    lines = ["## Served through Ray and the router (colocated vs 1P1D on one GPU)", "",
             f"- model: {section.get('model')} {section.get('dtype')}, device {section.get('device')}, "
             f"Ray GPUs {section.get('ray_gpus', 0):g}; prompts {plan.get('input_len')} tokens, "
             f"{plan.get('output_len')} out, greedy, ignore_eos; total {section.get('seconds')} s",
             "", "| deployment | c | TTFT p50 ms | TPOT p50 ms | tokens/s | KV transfer p50 ms | requests |",
             "|---|---|---|---|---|---|---|"]
    for name, label in (("colocated", "colocated"), ("pd_one_gpu", "1P1D")):
        part = section.get(name) or {}
        share = part.get("gpus_per_worker")
        label = f"{label} ({share:g} GPU each)" if share is not None else label
        if "error" in part:
            lines.append(f"| {label} | | error: {part['error'][:300]} | | | | |")
        for r in part.get("runs", []):
            transfer = r.get("kv_transfer_p50_ms", "-")
            lines.append(f"| {label} | {r['concurrency']} | {r['ttft_p50_ms']} | {r['tpot_p50_ms']} | "
                         f"{r['output_tokens_per_s']} | {transfer} | {r['completed']} ok, {r['failed']} failed |")
    lines += ["", *_greedy_lines(section)]
    return lines + _pool_and_transfer_lines(section)


def _greedy_lines(section: dict) -> list[str]:
    greedy, plan = section.get("greedy") or {}, section.get("plan", {})
    verdict = "identical" if greedy.get("prompts") and greedy.get("identical") == greedy.get("prompts") else "DIFFER"
    mismatch = f"; first mismatch {greedy['first_mismatch']}" if "first_mismatch" in greedy else ""
    lines = [f"- greedy tokens ({greedy.get('dtype')}), 1P1D vs colocated: **{verdict}** ({greedy.get('identical', 0)}"
             f"/{greedy.get('prompts', 0)} prompts, {plan.get('greedy_tokens')} tokens each){mismatch}"]
    served = section.get("greedy_served_dtype")
    if served:
        lines.append(f"- for information, at the served {section.get('dtype')}: {served.get('identical', 0)}/"
                     f"{served.get('prompts', 0)} prompts identical (rounding differs between D's one-token "
                     "recompute and colocated's prefill)")
    for name, part in (section.get("greedy_runs") or {}).items():
        if "error" in part:
            lines.append(f"- greedy {greedy.get('dtype')} {name}: error: {part['error'][:300]}")
    return lines


def _pool_and_transfer_lines(section: dict) -> list[str]:
    lines: list[str] = []
    dtype = (section.get("greedy") or {}).get("dtype")
    parts = [(n, section.get(n) or {}) for n in ("colocated", "pd_one_gpu")]
    parts += [(f"{n} ({dtype})", p) for n, p in (section.get("greedy_runs") or {}).items()]
    for name, part in parts:
        if part and not part.get("pools_all_free", False) and "error" not in part:
            lines.append(f"- {name}: KV pools NOT all free after the run: {part.get('pool_audits')}")
        loads = [r["kv_load_mean_ms"] for r in part.get("runs", []) if "kv_load_mean_ms" in r]
        if loads:
            lines.append(f"- {name}: decode worker's mean KV load per request: "
                         + ", ".join(f"c={r['concurrency']} {r['kv_load_mean_ms']} ms"
                                     for r in part["runs"] if "kv_load_mean_ms" in r))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pd.tools.gpu_check.served", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ONE_GPU_CONFIG), help="the base deployment (its model and share)")
    parser.add_argument("--out", default=None, help="also write the section as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    section = measure_served(load_deploy_config(args.config))
    print("\n".join(render_served(section)), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(section, indent=2, sort_keys=True) + "\n")
    return 0 if served_ok(section) else 1


if __name__ == "__main__":
    sys.exit(main())
