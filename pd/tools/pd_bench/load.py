"""The workload of `pd.tools.pd_bench`: interactive chat streams beside long documents.

One slice of the mixed load, on one deployment, for `slice_s` seconds:
- `chat`: `num_chat_clients` closed-loop clients, each sending a short chat prompt (a
  numbered variant of one of pd.tools.vs_hf's questions, distinct across the run) and
  streaming a `chat_tokens`-token answer (greedy, EOS ignored), then the next;
- `doc`: one long document every `doc_interval_s` (open loop: it arrives on time whatever
  the deployment is doing), `doc_min_tokens`..`doc_max_tokens` token ids fresh each (no
  prefix is shared), answering `doc_tokens` tokens.
Requests under way when the slice ends are waited for. The `idle` class is one document of
`idle_tokens` at a time on an otherwise idle deployment (what the transfer adds to TTFT).

Each request's TTFT (client side, to its first token), TPOT ((last - first token) / (tokens -
1)) and, for documents, the router's `pdkv_timing` stages (asked for with `x-pdkv-timing: 1`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import aiohttp

from pd.tools.loadgen.client import RequestOptions, send_request
from pd.tools.sse_stream import SSEStream
from pd.tools.vs_hf import QUESTIONS

VOCAB_LOW, VOCAB_HIGH = 200, 49000  # SmolLM2's ordinary tokens (its specials are the first few ids)
REQUEST_TIMEOUT_S = 600.0


@dataclasses.dataclass(frozen=True)
class Workload:
    model: str
    slice_s: float = 20.0
    num_chat_clients: int = 2
    chat_tokens: int = 128
    doc_interval_s: float = 10.0
    doc_min_tokens: int = 1024
    doc_max_tokens: int = 2048
    doc_tokens: int = 32
    idle_tokens: int = 2000


@dataclasses.dataclass(frozen=True)
class Record:
    kind: str  # chat, doc or idle
    num_prompt_tokens: int
    ttft_s: float
    tpot_s: float | None
    num_output_tokens: int
    token_ids: tuple[int, ...] = ()
    timing: dict | None = None  # the router's pdkv_timing (documents only)


class Serials:
    """Prompt numbers, shared by every deployment of a run: deployment k's i-th request of a kind
    gets the same prompt as every other deployment's i-th (so all serve the same workload)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.counts: dict[tuple[str, str], int] = {}

    def take(self, deployment: str, kind: str) -> int:
        n = self.counts.get((deployment, kind), 0)
        self.counts[(deployment, kind)] = n + 1
        return n


def chat_prompt(serial: int) -> str:
    """The `serial`-th chat prompt: its number, then one of the questions (no two prompts alike)."""
    return f"Request {serial}. {QUESTIONS[serial % len(QUESTIONS)]}"


def document(seed: int, serial: int, low: int, high: int) -> list[int]:
    rng = random.Random(f"{seed}-doc-{serial}")
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(low, high))]


async def _chat(session: aiohttp.ClientSession, url: str, load: Workload, serial: int) -> Record:
    opts = RequestOptions(api_url=f"{url}/v1/chat/completions", backend="openai-chat", model=load.model,
                          temperature=0.0, ignore_eos=True, timeout_s=REQUEST_TIMEOUT_S)
    prompt = chat_prompt(serial)
    rec = await send_request(session, opts, prompt, 0, load.chat_tokens, messages=[{"role": "user", "content": prompt}])
    if not rec.success or rec.ttft_s is None:
        raise RuntimeError(f"{url}: chat request {serial} failed: {rec.error}")
    tpot = (rec.latency_s - rec.ttft_s) / (rec.output_tokens - 1) if rec.output_tokens > 1 else None
    return Record("chat", rec.prompt_len, rec.ttft_s, tpot, rec.output_tokens)


async def complete_ids(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int,
                       kind: str) -> Record:
    """One streamed completion of token ids, with the router's timing stages."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    token_ids: list[int] = []
    timing = None
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S, sock_connect=10)
    async with session.post(f"{url}/v1/completions", json=body, headers={"x-pdkv-timing": "1"},
                            timeout=timeout) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:200]}")
        async for chunk in SSEStream(resp.content):
            if "error" in chunk:
                raise RuntimeError(f"{url}: {chunk['error']}")
            if isinstance(chunk.get("pdkv_timing"), dict):
                timing = chunk["pdkv_timing"]
            for choice in chunk.get("choices") or []:
                if choice.get("token_ids"):
                    last = time.perf_counter()
                    first = first or last
                    token_ids += choice["token_ids"]
    if first is None or last is None:
        raise RuntimeError(f"{url}: the stream carried no token")
    n = len(token_ids)
    return Record(kind, len(prompt), first - t0, (last - first) / (n - 1) if n > 1 else None, n,
                  tuple(token_ids), timing)


async def run_slice(url: str, name: str, load: Workload, serials: Serials) -> list[Record]:
    """One slice of the mixed load on the deployment at `url` (its name keys the prompt numbers)."""
    records: list[Record] = []
    end = time.perf_counter() + load.slice_s
    async with aiohttp.ClientSession() as session:
        async def chat_client() -> None:
            while time.perf_counter() < end:
                records.append(await _chat(session, url, load, serials.take(name, "chat")))

        async def docs() -> None:
            pending = []
            start = time.perf_counter()
            i = 0
            while start + i * load.doc_interval_s < end:
                await asyncio.sleep(max(0.0, start + i * load.doc_interval_s - time.perf_counter()))
                prompt = document(serials.seed, serials.take(name, "doc"), load.doc_min_tokens, load.doc_max_tokens)
                pending.append(asyncio.ensure_future(complete_ids(session, url, load.model, prompt, load.doc_tokens,
                                                                  "doc")))
                i += 1
            records.extend(await asyncio.gather(*pending))

        await asyncio.gather(docs(), *(chat_client() for _ in range(load.num_chat_clients)))
    return records


async def run_idle(url: str, name: str, load: Workload, serials: Serials, num_docs: int) -> list[Record]:
    """`num_docs` documents of `idle_tokens` tokens, one at a time, on an otherwise idle deployment."""
    records = []
    async with aiohttp.ClientSession() as session:
        for _ in range(num_docs):
            prompt = document(serials.seed + 1, serials.take(name, "idle"), load.idle_tokens, load.idle_tokens)
            records.append(await complete_ids(session, url, load.model, prompt, 2, "idle"))
    return records
