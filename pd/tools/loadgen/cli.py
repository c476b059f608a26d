"""Load generator for an OpenAI-compatible server: `python -m pd.loadgen --base-url ...`.

It speaks `vllm bench serve`'s language: the same flag names on the subset
below, and a flat result JSON with vLLM's key names (`median_ttft_ms`,
`p99_itl_ms`, `request_throughput`, ...), so one command line runs either tool.
pdkv adds the workers' KV transfer figures (`pdkv_kv_*`, scraped from
`/metrics` before and after) and how many inter-token gaps fell under 1 ms.

Shared with vLLM: --base-url (or --host/--port), --endpoint, --backend
openai|openai-chat, --model, --tokenizer, --dataset-name, --dataset-path,
--random-input-len, --random-output-len, --random-range-ratio,
--random-prefix-len, --prefix-repetition-*, --sharegpt-output-len,
--input-len/--output-len, --num-prompts, --request-rate, --burstiness,
--max-concurrency, --goodput ttft:500 tpot:50, --percentile-metrics,
--metric-percentiles, --num-warmups, --ignore-eos, --temperature, --seed,
--save-result, --save-detailed, --result-dir, --result-filename, --label,
--disable-tqdm. The API key comes from OPENAI_API_KEY, as in vLLM.
pdkv only: --api-key, --admin-key, --plot FILE, --timeout, --dataset-name custom|multi_turn,
--multi-turn-num-turns.

Arrivals: gaps ~ Gamma(shape=burstiness, scale=1/(rate*burstiness)); burstiness
1 is Poisson; rate `inf` sends all at once; `--max-concurrency` caps requests in flight.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from datetime import datetime
from pathlib import Path

import aiohttp

from pd.tools.loadgen.client import BACKENDS, RequestOptions, first_model, scrape_metrics, send_request
from pd.tools.loadgen.data import DATASET_NAMES, SampleRequest, load_tokenizer, make_dataset, render_history
from pd.tools.ttft_breakdown import format_stages, ttft_breakdown
from pd.tools.loadgen.report import (METRICS, RequestRecord, compute_metrics, format_report, kv_figures,
                                     transfer_figures)

DETAILED_KEYS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")


def arrival_delays(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Cumulative send times (s) for `num` requests."""
    if rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


class _Conversations:
    """`multi_turn`: each conversation's history, and turn k waiting for turn k-1's answer."""

    def __init__(self) -> None:
        self.history: dict[int, list[dict]] = {}
        self.done: dict[tuple[int, int], asyncio.Event] = {}

    def event(self, conversation: int, turn: int) -> asyncio.Event:
        return self.done.setdefault((conversation, turn), asyncio.Event())

    async def before(self, sample: SampleRequest, chat: bool) -> tuple[str, list[dict] | None]:
        if sample.conversation is None:
            return sample.prompt, None
        if sample.turn:
            await self.event(sample.conversation, sample.turn - 1).wait()
        messages = self.history.setdefault(sample.conversation, []) + [{"role": "user", "content": sample.prompt}]
        return (sample.prompt, messages) if chat else (render_history(messages), None)

    def after(self, sample: SampleRequest, record: RequestRecord) -> None:
        if sample.conversation is None:
            return
        self.history[sample.conversation] += [{"role": "user", "content": sample.prompt},
                                              {"role": "assistant", "content": record.generated_text}]
        self.event(sample.conversation, sample.turn).set()


async def run(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    tok = load_tokenizer(args.tokenizer)
    dataset = make_dataset(args, tok)
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    # x-pdkv-timing: a pdkv router adds its TTFT breakdown to each answer (other servers ignore the header)
    timing = {"x-pdkv-timing": "1"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=timing) as session:
        model = args.model or await first_model(session, base_url, args.api_key)
        opts = RequestOptions(api_url=base_url + args.endpoint, backend=args.backend, model=model,
                              api_key=args.api_key, temperature=args.temperature, ignore_eos=args.ignore_eos,
                              timeout_s=args.timeout)
        limit = asyncio.Semaphore(args.max_concurrency or len(dataset))
        if args.num_warmups:
            first = dataset[0]
            warm = await asyncio.gather(*(_limited(limit, send_request(session, opts, first.prompt, first.prompt_len,
                                                                       first.expected_output_len))
                                          for _ in range(args.num_warmups)))
            print(f"warm-up: {sum(r.success for r in warm)}/{len(warm)} requests completed", file=sys.stderr)
        before = await scrape_metrics(session, base_url, args.admin_key or args.api_key)
        delays = arrival_delays(len(dataset), args.request_rate, args.burstiness, args.seed)
        conversations = _Conversations()
        bar = tqdm(total=len(dataset), desc="requests", disable=args.disable_tqdm, file=sys.stderr)
        start = time.perf_counter()

        async def one(i: int) -> RequestRecord:
            sample = dataset[i]
            await asyncio.sleep(max(0.0, start + delays[i] - time.perf_counter()))
            prompt, messages = await conversations.before(sample, args.backend == "openai-chat")
            async with limit:
                record = await send_request(session, opts, prompt, sample.prompt_len, sample.expected_output_len,
                                            messages=messages, t0=start)
            conversations.after(sample, record)
            bar.update(1)
            return record

        records = await asyncio.gather(*(one(i) for i in range(len(dataset))))
        duration = time.perf_counter() - start
        bar.close()
        after = await scrape_metrics(session, base_url, args.admin_key or args.api_key)
    metrics = compute_metrics(records, duration, args.goodput, args.percentile_metrics, args.metric_percentiles)
    result = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": args.backend,
              "backend": args.backend, "label": args.label, "model_id": model, "tokenizer_id": tok.name,
              "num_prompts": args.num_prompts,
              "request_rate": args.request_rate if args.request_rate < float("inf") else "inf",
              "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, **metrics}
    if after:
        result.update(kv_figures(transfer_figures(before, after)))
    result.update(_detail(records))
    result["pdkv_ttft_breakdown"] = ttft_breakdown([r.server_timing for r in records if r.server_timing])
    print(format_report(result, args.percentile_metrics, args.metric_percentiles))
    if result["pdkv_ttft_breakdown"]:
        b = result["pdkv_ttft_breakdown"]
        print(f"TTFT breakdown (the router's pdkv_timing, p50 per stage over {b['num_requests']} requests): "
              f"{format_stages(b)}; server TTFT p50 {1e3 * (b['server_ttft_p50_s'] or 0):.1f} ms")
    if args.plot:
        from pd.tools.loadgen.plot import write_plots

        write_plots(records, args.plot)
        print(f"plot written to {args.plot}")
    if args.save_result:
        path = _result_path(args, model, result["date"])
        saved = result if args.save_detailed else {k: v for k, v in result.items() if k not in DETAILED_KEYS}
        path.write_text(json.dumps(saved))
        print(f"result written to {path}")
    return result


async def _limited(limit: asyncio.Semaphore, coro):
    async with limit:
        return await coro


def _detail(records: list[RequestRecord]) -> dict:
    return {"input_lens": [r.prompt_len for r in records], "output_lens": [r.output_tokens for r in records],
            "start_times": [r.start_time for r in records], "ttfts": [r.ttft_s for r in records],
            "itls": [r.itl_s for r in records], "generated_texts": [r.generated_text for r in records],
            "errors": [r.error for r in records]}


def _result_path(args: argparse.Namespace, model: str, date: str) -> Path:
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    name = args.result_filename or \
        f"{args.label or args.backend}-{args.request_rate}qps{concurrency}-{model.split('/')[-1]}-{date}.json"
    path = Path(args.result_dir or ".") / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _goodput(pairs: list[str]) -> dict[str, float]:
    out = {}
    for item in pairs:
        key, sep, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not sep:
            raise argparse.ArgumentTypeError(f"--goodput: expected KEY:MS with KEY in ttft, tpot, e2el, got {item!r}")
        try:
            out[key] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--goodput: {item!r}: {value!r} is not a number of ms") from None
        if out[key] < 0:
            raise argparse.ArgumentTypeError(f"--goodput: {item!r}: the SLO must be >= 0 ms")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pd.loadgen", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default=None, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--host", default="127.0.0.1", help="without --base-url")
    p.add_argument("--port", type=int, default=8000, help="without --base-url")
    p.add_argument("--endpoint", default=None, help="API path (default: the backend's)")
    p.add_argument("--backend", choices=sorted(BACKENDS), default="openai")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    p.add_argument("--admin-key", default=os.environ.get("PDKV_ADMIN_KEY"),
                   help="pdkv: a router's admin key, for the worker refresh before each metrics scrape "
                        "(/pd/workers?refresh=1) and a protected /metrics (default: $PDKV_ADMIN_KEY, else the API key)")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer directory (tokenizer.json); default: byte tokenizer")
    p.add_argument("--dataset-name", choices=DATASET_NAMES, default="random")
    p.add_argument("--dataset-path", default=None, help="sharegpt: a ShareGPT JSON file; custom: a JSONL file")
    p.add_argument("--disable-shuffle", action="store_true", help="sharegpt: keep the file's order")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=None, help="sets --random-input-len")
    p.add_argument("--output-len", type=int, default=None, help="sets every dataset's output length")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in [L(1-r), L(1+r)]")
    p.add_argument("--random-prefix-len", type=int, default=0, help="random: tokens shared by every prompt")
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    p.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    p.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    p.add_argument("--prefix-repetition-output-len", type=int, default=128)
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    p.add_argument("--multi-turn-num-turns", type=int, default=3, help="multi_turn: turns per conversation")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, or inf")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl", help=f"comma-separated, of {','.join(METRICS)}")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    p.add_argument("--num-warmups", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="always on for --dataset-name random, as in vLLM")
    p.add_argument("--temperature", type=float, default=None, help="default: the server's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default=None)
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--save-detailed", action="store_true", help="with per-request ttfts, itls, ...")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--plot", default=None, help="PNG: latency distributions (log axes) and token timelines")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.burstiness <= 0 or args.request_rate <= 0:
        p.error("--num-prompts, --burstiness and --request-rate must be positive")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if not 0.0 <= args.random_range_ratio < 1.0:
        p.error("--random-range-ratio must be in [0, 1)")
    try:
        args.goodput = _goodput(args.goodput) if args.goodput else {}
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    args.percentile_metrics = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
    unknown = [m for m in args.percentile_metrics if m not in METRICS]
    if unknown:
        p.error(f"--percentile-metrics: unknown {unknown}; use {','.join(METRICS)}")
    try:
        args.metric_percentiles = tuple(float(q) for q in args.metric_percentiles.split(","))
    except ValueError:
        p.error(f"--metric-percentiles: expected numbers like 50,90,99, got {args.metric_percentiles!r}")
    if not all(0 < q < 100 for q in args.metric_percentiles):
        p.error("--metric-percentiles: each must be in (0, 100)")
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.prefix_repetition_output_len = args.sharegpt_output_len = args.output_len
    if args.dataset_name == "random":
        args.ignore_eos = True
    args.endpoint = args.endpoint or BACKENDS[args.backend]
    if args.base_url:
        args.base_url = args.base_url.rstrip("/")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = asyncio.run(run(args))
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0 if result["completed"] > 0 else 1
