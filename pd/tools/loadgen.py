"""Load generator for the router's OpenAI API: `python -m pd.loadgen --url ...`.

Sends streamed `/v1/completions` requests drawn from a dataset (`random`,
`shared-prefix`, `jsonl:FILE`) on a Poisson / Gamma arrival process, shows a
progress bar, then prints latency percentiles, throughput, goodput and the
workers' KV transfer figures scraped from `/metrics`. Optionally writes the
full result as JSON and the latency distributions as a PNG.

Arrivals: gaps ~ Gamma(shape=burstiness, scale=1/(rate*burstiness)); burstiness
1 is Poisson, below 1 burstier, above 1 more regular; rate `inf` sends all at
once. `--max-concurrency` caps requests in flight.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import string
import sys
import time
from pathlib import Path

import aiohttp

from pd.tools.loadgen_report import RequestRecord, compute_metrics, format_report, transfer_figures, write_plots

_WORDS = [''.join(random.Random(i).choices(string.ascii_lowercase, k=1 + i % 7)) for i in range(512)]


def parse_range(text: str, name: str) -> tuple[int, int]:
    """`64` or `32:128` -> (lo, hi), inclusive."""
    try:
        lo, _, hi = text.partition(":")
        bounds = (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name}: expected N or LO:HI, got {text!r}") from None
    if bounds[0] < 1 or bounds[1] < bounds[0]:
        raise argparse.ArgumentTypeError(f"{name}: need 1 <= LO <= HI, got {text!r}")
    return bounds


def _text(rng: random.Random, num_chars: int) -> str:
    out, length = [], -1
    while length < num_chars:
        word = rng.choice(_WORDS)
        out.append(word)
        length += len(word) + 1
    return " ".join(out)[:num_chars]


def make_dataset(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(prompt text, output length) per request. With the byte-level tokenizer
    a prompt of N characters is N+1 tokens (BOS)."""
    rng = random.Random(args.seed)
    in_lo, in_hi = args.input_len
    out_lo, out_hi = args.output_len
    if args.dataset.startswith("jsonl:"):
        path = Path(args.dataset[len("jsonl:"):])
        rows = []
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            item = json.loads(line)
            if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
                raise ValueError(f"{path}:{lineno}: each line must be an object with a string 'prompt'")
            rows.append((item["prompt"], int(item.get("output_len") or item.get("max_tokens")
                                             or rng.randint(out_lo, out_hi))))
        if not rows:
            raise ValueError(f"{path}: no prompts")
        return [rows[i % len(rows)] for i in range(args.num_prompts)]
    if args.dataset == "random":
        return [(_text(rng, rng.randint(in_lo, in_hi) - 1), rng.randint(out_lo, out_hi))
                for _ in range(args.num_prompts)]
    if args.dataset == "shared-prefix":
        prefixes = [_text(rng, args.prefix_len) for _ in range(args.num_prefixes)]
        out = []
        for i in range(args.num_prompts):
            suffix_len = max(1, rng.randint(in_lo, in_hi) - 2 - args.prefix_len)  # BOS and the space
            out.append((prefixes[i % len(prefixes)] + " " + _text(rng, suffix_len), rng.randint(out_lo, out_hi)))
        return out
    raise ValueError(f"unknown dataset {args.dataset!r}; use random, shared-prefix or jsonl:FILE")


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


async def send_one(session: aiohttp.ClientSession, url: str, model: str | None, prompt: str, max_tokens: int,
                   args: argparse.Namespace) -> RequestRecord:
    record = RequestRecord(prompt_len=len(prompt.encode()) + 1, expected_output_len=max_tokens)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos, "seed": args.seed}
    if model:
        body["model"] = model
    start = last = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return record
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = str(chunk["error"].get("message"))[:200]
                    return record
                now = time.perf_counter()
                if chunk.get("usage"):
                    record.prompt_len = chunk["usage"]["prompt_tokens"]
                    record.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):  # one chunk per token event
                    if record.ttft_s == 0.0:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last = now
            record.latency_s = last - start
            record.success = record.ttft_s > 0.0 or record.output_tokens > 0
            if not record.success:
                record.error = "no output"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:200]
    return record


async def _scrape(session: aiohttp.ClientSession, url: str) -> str:
    try:
        async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            return await resp.text() if resp.status == 200 else ""
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return ""


async def run(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    dataset = make_dataset(args)
    delays = arrival_delays(len(dataset), args.request_rate, args.burstiness, args.seed)
    limit = asyncio.Semaphore(args.max_concurrency or len(dataset))
    timeout = aiohttp.ClientTimeout(total=args.timeout, sock_connect=10)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        before = await _scrape(session, args.url)
        bar = tqdm(total=len(dataset), desc="requests", disable=args.no_progress, file=sys.stderr)
        start = time.perf_counter()

        async def one(i: int) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + delays[i] - time.perf_counter()))
            async with limit:
                record = await send_one(session, args.url, args.model, dataset[i][0], dataset[i][1], args)
            bar.update(1)
            return record

        records = await asyncio.gather(*(one(i) for i in range(len(dataset))))
        duration = time.perf_counter() - start
        bar.close()
        after = await _scrape(session, args.url)
    metrics = compute_metrics(records, duration, args.goodput or {})
    transfer = transfer_figures(before, after) if after else {}
    print(format_report(metrics, transfer))
    result = {"args": {k: (str(v) if isinstance(v, float) and v == float("inf") else v)
                       for k, v in vars(args).items()},
              "metrics": metrics, "workers": transfer,
              "requests": [r.__dict__ for r in records]}
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(result, indent=1))
        print(f"result written to {args.result_json}")
    if args.plot:
        write_plots(records, args.plot)
        print(f"plot written to {args.plot}")
    return result


def _goodput(text: str) -> dict[str, float]:
    out = {}
    for item in text.split():
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2el"):
            raise argparse.ArgumentTypeError(f"--goodput: unknown SLO {key!r} (use ttft, tpot, e2el)")
        out[key] = float(value)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pd.loadgen", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="router base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the server's)")
    p.add_argument("--dataset", default="random", help="random | shared-prefix | jsonl:FILE")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, or inf")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--input-len", type=lambda s: parse_range(s, "--input-len"), default=(128, 128))
    p.add_argument("--output-len", type=lambda s: parse_range(s, "--output-len"), default=(32, 32))
    p.add_argument("--prefix-len", type=int, default=None, help="shared-prefix: characters shared")
    p.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", type=_goodput, default=None, help='SLOs in ms, e.g. "ttft:500 tpot:50"')
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--result-json", default=None)
    p.add_argument("--plot", default=None, help="PNG of the latency distributions")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.burstiness <= 0 or args.request_rate <= 0:
        p.error("--num-prompts, --burstiness and --request-rate must be positive")
    if args.prefix_len is None:
        args.prefix_len = max(1, args.input_len[0] // 2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    return 0 if result["metrics"]["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
