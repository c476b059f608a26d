"""One-shot GPU check: `python -m pd.tools.gpu_check [--out gpu_check_report.md]`.

In one run of under 5 minutes on one GPU it
1. runs the `gpu` tests (`pytest -m gpu tests/gpu tests/connectors/test_cuda.py`):
   two-process GPU->GPU byte-exact transfers and 1P1D-vs-colocated greedy tokens;
2. measures the connector's GB/s, CUDA pool -> CUDA pool through the ZMQ
   connector (tcp and same-host shared memory), beside a plain pinned-memory
   copy baseline (one device-to-host and one host-to-device copy of the same
   bytes), plus the staging gather of scattered pages;
3. measures the engine's prefill and decode tokens/s on the GPU at the
   documented model size `CHECK_MODEL` (Qwen2.5-0.5B-like shape, ~0.42B
   parameters: 24 layers, hidden 896, 14 query / 2 KV heads of 64, SwiGLU
   4864, vocab 32000, bfloat16, random weights, block size 16).

It writes a short markdown report to --out and the same figures as JSON
beside it (`.json`), and prints the markdown. Exit status: 0 when the tests
pass and every measurement ran, 1 otherwise, 2 when CUDA is not available
(nothing is measured; the message says why).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from pd.engine.config import EngineConfig
from pd.engine.model.config import ModelConfig

CHECK_MODEL = ModelConfig(vocab_size=32000, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                          num_kv_heads=2, head_dim=64, max_position_embeddings=4096, dtype="bfloat16",
                          bos_token_id=1, eos_token_id=2)
CHECK_MODEL_DOC = ("Qwen2.5-0.5B-like shape, ~0.42B params (24 layers, hidden 896, 14 q / 2 KV heads of 64, "
                   "SwiGLU 4864, vocab 32000), bfloat16, random weights, block size 16")
PAGE_BYTES = 2 * 1024 * 1024  # one block of a Llama-3-8B-sized KV page (32 layers x K,V x 8 heads x 128 x 16 x bf16)
PAGES_PER_LOAD = 256  # 512 MiB per load
TEST_TIMEOUT_S = 200
REPO = Path(__file__).resolve().parents[1]


def cuda_missing_reason() -> str | None:
    if torch.cuda.is_available():
        return None
    return (f"pd.tools.gpu_check needs a CUDA GPU: torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}). Run it on a GPU machine.")


# ---------------------------------------------------------------------- 1. gpu tests
def run_gpu_tests(timeout_s: float = TEST_TIMEOUT_S) -> dict:
    paths = [p for p in ("tests/gpu", "tests/connectors/test_cuda.py") if (REPO / p).exists()]
    if not paths:
        return {"ok": False, "summary": "tests not found next to the package (run from a source checkout)"}
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
           f"--timeout={int(timeout_s)}", *paths]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s + 30)
    except subprocess.TimeoutExpired:
        return {"ok": False, "summary": f"pytest did not finish within {timeout_s + 30:.0f} s",
                "seconds": timeout_s + 30}
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    summary = lines[-1].strip("= ") if lines else "no output"
    failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    # on a GPU machine nothing may skip: a skip would hide the very path this check is for
    ok = proc.returncode == 0 and "passed" in summary and "skipped" not in summary
    return {"ok": ok, "returncode": proc.returncode, "summary": summary, "failed": failed[:20],
            "seconds": round(time.perf_counter() - t0, 1), "command": " ".join(cmd[1:])}


# ---------------------------------------------------------------------- 2. transfer GB/s
def _timed_copy(dst: torch.Tensor, src: torch.Tensor, reps: int) -> float:
    """Median GB/s of dst.copy_(src) (synchronised around each copy)."""
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    gbps = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        gbps.append(src.numel() * src.element_size() / (time.perf_counter() - t0) / 1e9)
    return statistics.median(gbps)


def measure_pinned_baseline(nbytes: int, reps: int = 5) -> dict:
    dev = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2h = _timed_copy(host, dev, reps)
    h2d = _timed_copy(dev, host, reps)
    return {"d2h_gbps": round(d2h, 2), "h2d_gbps": round(h2d, 2),
            "d2h_then_h2d_gbps": round(1.0 / (1.0 / d2h + 1.0 / h2d), 2), "bytes": nbytes}


def measure_staging_gather(num_blocks: int, reps: int = 5) -> dict:
    """GB/s of the connector's D2H staging copy for scattered vs contiguous block ids."""
    from connectors.zmq.cuda_staging import CudaStaging
    from pd.engine.kv.page_pool import PagePool

    pool = PagePool(num_blocks, PAGE_BYTES, device="cuda")
    staging = CudaStaging(pool)
    n = staging.rows_per_half
    out = {"pages_per_copy": n}
    scattered = random.Random(0).sample(range(1, num_blocks), n)
    for name, ids in (("contiguous", list(range(1, n + 1))), ("scattered", scattered)):
        staging.copy_to_host(ids)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            staging.copy_to_host(ids)
            times.append(time.perf_counter() - t0)
        out[f"{name}_d2h_gbps"] = round(n * PAGE_BYTES / statistics.median(times) / 1e9, 2)
    return out


def measure_connector(path: str, reps: int = 3) -> dict:
    """GB/s of whole loads (PAGES_PER_LOAD pages) CUDA pool -> CUDA pool through the connector."""
    from connectors.zmq.consumer import Consumer
    from connectors.zmq.consumer_config import ConsumerConfig, DataPath
    from connectors.zmq.loads import RemoteAddr
    from pd.engine.kv.page_pool import PagePool
    from connectors.zmq.producer import Producer, ProducerConfig

    secret = os.urandom(24)
    num_blocks = PAGES_PER_LOAD + 1
    src_pool = PagePool(num_blocks, PAGE_BYTES, device="cuda")
    dst_pool = PagePool(num_blocks, PAGE_BYTES, device="cuda")
    src_pool.buffer.random_(0, 256)
    torch.cuda.synchronize()
    prod = Producer(ProducerConfig(engine_id="check-P", secret=secret, compat_hash="gpu-check"), src_pool)
    prod.start()
    cons = Consumer(ConsumerConfig(engine_id="check-D", secret=secret, compat_hash="gpu-check",
                                   data_path=DataPath(path), transfer_timeout_s=60.0), dst_pool)
    cons.start()
    ids = list(range(1, num_blocks))
    dst_ids = list(reversed(ids))  # every page lands somewhere else: no accidental identity copy
    gbps, ok = [], True
    try:
        for rep in range(reps + 1):  # the first load also pays the handshake: not counted
            rid = f"check-{rep}"
            prod.add_lease(rid, ids)
            t0 = time.perf_counter()
            job = cons.load(rid, RemoteAddr("check-P", "127.0.0.1", prod.port), rid, ids, dst_ids)
            if not job.done.wait(120) or job.result is None or not job.result.ok:
                ok = False
                break
            if rep:
                gbps.append(len(ids) * PAGE_BYTES / (time.perf_counter() - t0) / 1e9)
        torch.cuda.synchronize()
        exact = ok and torch.equal(dst_pool.buffer[dst_ids], src_pool.buffer[ids])
    finally:
        cons.shutdown()
        prod.shutdown()
    return {"gbps": round(statistics.median(gbps), 2) if gbps else None, "byte_exact": exact,
            "bytes_per_load": len(ids) * PAGE_BYTES, "loads": len(gbps)}


# ---------------------------------------------------------------------- 3. engine tokens/s
def measure_engine(model: ModelConfig = CHECK_MODEL, num_requests: int = 32, prompt_len: int = 512,
                   decode_steps: int = 64) -> dict:
    """Prefill tokens/s (prompts only) and decode tokens/s (steady batch of `num_requests`)."""
    from pd.engine.engine import Engine
    from pd.engine.sample.params import SamplingParams

    t_build = time.perf_counter()
    eng = Engine(EngineConfig(model=model, device="cuda", block_size=16, kv_cache_bytes=8 << 30,
                              max_num_batched_tokens=8192, max_num_seqs=256, enable_prefix_caching=False,
                              max_model_len=prompt_len + decode_steps + 8))
    build_s = time.perf_counter() - t_build
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(3, model.vocab_size) for _ in range(prompt_len)] for i in range(num_requests)}
    eng.generate_sync({"warmup": prompts["r0"][:64]}, SamplingParams(max_tokens=4, ignore_eos=True))
    params = SamplingParams(max_tokens=decode_steps + 1, ignore_eos=True)
    for rid, ids in prompts.items():
        eng.add_request(rid, ids, params)
    generated = {rid: 0 for rid in prompts}
    t0 = time.perf_counter()
    while sum(1 for n in generated.values() if n) < num_requests:  # prefill: until every prompt has its first token
        for out in eng.step():
            generated[out.request_id] += len(out.new_token_ids)
    t1 = time.perf_counter()
    first = sum(generated.values())
    while eng.has_unfinished_requests():
        for out in eng.step():
            generated[out.request_id] += len(out.new_token_ids)
    t2 = time.perf_counter()
    params_count = sum(p.numel() for p in eng.runner.model.parameters())
    return {"model": CHECK_MODEL_DOC if model == CHECK_MODEL else repr(model), "params": params_count,
            "num_requests": num_requests, "prompt_len": prompt_len, "decode_steps": decode_steps,
            "prefill_tokens_per_s": round(num_requests * prompt_len / (t1 - t0), 1),
            "decode_tokens_per_s": round((sum(generated.values()) - first) / (t2 - t1), 1),
            "build_s": round(build_s, 1)}


# ---------------------------------------------------------------------- report
def render_markdown(report: dict) -> str:
    dev, tests = report.get("device", {}), report.get("tests", {})
    lines = [f"# pdkv GPU check ({report.get('when', '?')})", "",
             f"- device: {dev.get('name', '?')} ({dev.get('memory_gib', '?')} GiB), torch {dev.get('torch', '?')}, "
             f"CUDA {dev.get('cuda', '?')}; total run {report.get('seconds', '?')} s",
             f"- gpu tests: **{'PASSED' if tests.get('ok') else 'FAILED'}** - {tests.get('summary', 'not run')}"]
    lines += [f"  - {f}" for f in tests.get("failed", [])]
    tr, base, gather = report.get("transfer", {}), report.get("baseline", {}), report.get("staging", {})
    lines += ["",
              f"## KV transfer, CUDA pool -> CUDA pool ({PAGES_PER_LOAD} pages of {PAGE_BYTES // 1024} KiB per load)",
              "",
              "| path | GB/s | byte-exact |", "|---|---|---|"]
    for path, r in tr.items():
        lines.append(f"| connector {path} | {r.get('gbps')} | {r.get('byte_exact')} |" if "error" not in r
                     else f"| connector {path} | error: {r['error']} | |")
    lines += [f"| pinned D2H copy (baseline) | {base.get('d2h_gbps')} | |",
              f"| pinned H2D copy (baseline) | {base.get('h2d_gbps')} | |",
              f"| pinned D2H then H2D (baseline for one hop through host) | {base.get('d2h_then_h2d_gbps')} | |",
              f"| staging gather D2H, contiguous ids | {gather.get('contiguous_d2h_gbps')} | |",
              f"| staging gather D2H, scattered ids | {gather.get('scattered_d2h_gbps')} | |"]
    eng = report.get("engine", {})
    lines += ["", "## Engine throughput on the GPU", "",
              f"- model: {eng.get('model', '?')} ({eng.get('params', '?')} parameters)",
              f"- {eng.get('num_requests')} requests x {eng.get('prompt_len')} prompt tokens, "
              f"{eng.get('decode_steps')} decode steps",
              f"- prefill: **{eng.get('prefill_tokens_per_s')} tokens/s**, "
              f"decode: **{eng.get('decode_tokens_per_s')} tokens/s**"]
    if "error" in eng:
        lines.append(f"- error: {eng['error']}")
    for key in ("baseline", "staging"):
        if "error" in report.get(key, {}):
            lines.append(f"- {key} error: {report[key]['error']}")
    return "\n".join(lines) + "\n"


def _guarded(fn, *args) -> dict:
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a failed measurement is reported, the rest still runs
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


def run_check(skip_tests: bool = False) -> dict:
    t0 = time.perf_counter()
    props = torch.cuda.get_device_properties(0)
    report: dict[str, object] = {"when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "device": {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                         "torch": torch.__version__, "cuda": torch.version.cuda, "count": torch.cuda.device_count()}}
    report["tests"] = {"ok": True, "summary": "skipped (--skip-tests)"} if skip_tests else run_gpu_tests()
    report["baseline"] = _guarded(measure_pinned_baseline, PAGES_PER_LOAD * PAGE_BYTES)
    report["staging"] = _guarded(measure_staging_gather, 2 * PAGES_PER_LOAD)
    report["transfer"] = {path: _guarded(measure_connector, path) for path in ("tcp", "shm")}
    report["engine"] = _guarded(measure_engine)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def report_ok(report: dict) -> bool:
    parts = [report["tests"], report["baseline"], report["staging"], report["engine"], *report["transfer"].values()]
    exact = all(r.get("byte_exact", True) for r in report["transfer"].values())
    return report["tests"].get("ok", False) and exact and not any("error" in p for p in parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pd.tools.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check_report.md", help="markdown report path (JSON goes beside it)")
    parser.add_argument("--skip-tests", action="store_true", help="measure only (do not run the gpu tests)")
    args = parser.parse_args(argv)
    reason = cuda_missing_reason()
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    report = run_check(args.skip_tests)
    text = render_markdown(report)
    out = Path(args.out)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    print(text, flush=True)
    print(f"report: {out} and {out.with_suffix('.json')}", flush=True)
    return 0 if report_ok(report) else 1


if __name__ == "__main__":
    sys.exit(main())
