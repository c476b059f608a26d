"""`pd.tools.sse_stream.SSEStream` against a real aiohttp server on a loopback port."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from pd.tools.sse_stream import SSEStream


async def _read(body: bytes) -> tuple[list[dict], bool]:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(0, len(body), 7):  # in small pieces: lines must be reassembled
            await resp.write(body[i:i + 7])
        return resp

    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async with session.get(f"http://127.0.0.1:{port}/") as resp:
                stream = SSEStream(resp.content)
                return [event async for event in stream], stream.done
    finally:
        await runner.cleanup()


def _events(*objs: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objs)


def test_events_until_done_and_nothing_after():
    body = b": a comment\n\n" + _events({"a": 1}, {"b": [2, 3]}) + b"data: [DONE]\n\n" + _events({"late": 1})
    events, done = asyncio.run(_read(body))
    assert events == [{"a": 1}, {"b": [2, 3]}]
    assert done


def test_a_cut_stream_is_not_done():
    events, done = asyncio.run(_read(_events({"a": 1})))
    assert events == [{"a": 1}] and not done


def test_data_without_space_is_read():
    events, done = asyncio.run(_read(b'data:{"x": 1}\n\ndata:[DONE]\n\n'))
    assert events == [{"x": 1}] and done


def test_garbage_payload_raises():
    with pytest.raises(json.JSONDecodeError):
        asyncio.run(_read(b"data: {not json\n\n"))
