"""One streamed request to an OpenAI-compatible server, timed per chunk.

Backends as `vllm bench serve` names them: `openai` (`/v1/completions`,
`prompt`) and `openai-chat` (`/v1/chat/completions`, `messages`). A chunk that
carries a choice counts as one token event (the first one gives TTFT, each
later one an ITL gap); on the chat backend a role-only opening delta does not.
Output tokens come from the final usage chunk when the server sends one.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import aiohttp

from pd.tools.loadgen.report import RequestRecord
from pd.tools.sse_stream import SSEStream

BACKENDS = {"openai": "/v1/completions", "vllm": "/v1/completions", "openai-chat": "/v1/chat/completions"}


@dataclasses.dataclass(frozen=True)
class RequestOptions:
    """What every request of a run shares."""

    api_url: str
    backend: str
    model: str
    api_key: str | None = None
    temperature: float | None = None
    ignore_eos: bool = False
    timeout_s: float = 600.0

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def request_body(opts: RequestOptions, prompt: str | None, messages: list[dict] | None, max_tokens: int) -> dict:
    body: dict = {"model": opts.model, "stream": True, "stream_options": {"include_usage": True},
                  "max_tokens": max_tokens}
    if opts.backend == "openai-chat":
        body["messages"] = messages if messages is not None else [{"role": "user", "content": prompt}]
        body["max_completion_tokens"] = max_tokens
    else:
        body["prompt"] = prompt
    if opts.temperature is not None:
        body["temperature"] = opts.temperature
    if opts.ignore_eos:
        body["ignore_eos"] = True
    return body


def _chunk_text(backend: str, choice: dict) -> str | None:
    """The text a choice carries, or None when it is no token event (a chat role-only delta)."""
    if backend != "openai-chat":
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    if "content" not in delta or (delta.get("role") and not delta.get("content")
                                  and choice.get("finish_reason") is None):
        return None
    return delta.get("content") or ""


async def send_request(session: aiohttp.ClientSession, opts: RequestOptions, prompt: str, prompt_len: int,
                       max_tokens: int, messages: list[dict] | None = None, t0: float = 0.0) -> RequestRecord:
    """Sends one request and times its chunks; never raises for a failed request (it is recorded)."""
    record = RequestRecord(prompt_len=prompt_len, expected_output_len=max_tokens)
    body = request_body(opts, prompt, messages, max_tokens)
    start = last = time.perf_counter()
    record.start_time = start - t0
    pieces: list[str] = []
    timeout = aiohttp.ClientTimeout(total=opts.timeout_s, sock_connect=10)
    try:
        async with session.post(opts.api_url, json=body, headers=opts.headers(), timeout=timeout) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return record
            async for chunk in SSEStream(resp.content):
                now = time.perf_counter()
                if "error" in chunk:
                    record.error = str((chunk["error"] or {}).get("message"))[:200]
                    return record
                if chunk.get("usage"):
                    record.prompt_len = chunk["usage"].get("prompt_tokens") or record.prompt_len
                    record.output_tokens = chunk["usage"].get("completion_tokens") or 0
                if isinstance(chunk.get("pdkv_timing"), dict):
                    record.server_timing = chunk["pdkv_timing"]
                choices = chunk.get("choices") or []
                text = _chunk_text(opts.backend, choices[0]) if choices else None
                if text is None:
                    continue
                pieces.append(text)
                if not record.chunk_times:
                    record.ttft_s = now - start
                else:
                    record.itl_s.append(now - last)
                record.chunk_times.append(now - t0)
                last = now
        record.latency_s = last - start
        record.generated_text = "".join(pieces)
        if record.output_tokens == 0:
            record.output_tokens = len(record.chunk_times)  # no usage chunk: one token per chunk
        record.success = bool(record.chunk_times)
        if not record.success:
            record.error = "no output"
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:200]
    return record


async def first_model(session: aiohttp.ClientSession, base_url: str, api_key: str | None) -> str:
    """The first model the server lists at /v1/models (what vLLM does without --model)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with session.get(f"{base_url}/v1/models", headers=headers,
                               timeout=aiohttp.ClientTimeout(total=30)) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{base_url}/v1/models answered HTTP {resp.status}: {(await resp.text())[:200]}")
            data = (await resp.json()).get("data") or []
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise RuntimeError(f"cannot list models at {base_url}/v1/models: {type(exc).__name__}: {exc}") from None
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return data[0]["id"]


async def scrape_metrics(session: aiohttp.ClientSession, base_url: str, api_key: str | None = None) -> str:
    """The server's Prometheus text ('' when it has none).

    A pdkv router serves worker figures from its last poll of the workers; asking it to poll
    now (`/pd/workers?refresh=1`) makes the scrape current. Other servers answer that with a
    404, which is fine: their /metrics is live.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with session.get(f"{base_url}/pd/workers", params={"refresh": "1"}, headers=headers,
                               timeout=aiohttp.ClientTimeout(total=10)) as resp:
            await resp.read()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        pass
    try:
        async with session.get(f"{base_url}/metrics", headers=headers, timeout=aiohttp.ClientTimeout(total=10)) as resp:
            return await resp.text() if resp.status == 200 else ""
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return ""
