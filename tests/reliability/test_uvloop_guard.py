"""The connection guard on uvloop, over real sockets.

uvloop's `TCPTransport` subclasses no asyncio class; Ray's async actors run on uvloop wherever
it is installed, so a guard that insisted on `asyncio.Transport` reset every connection to a
worker. Here a guarded aiohttp server answers, and its timeouts and caps act (graceful close,
abort, eviction: every transport method the guard uses), on uvloop and on asyncio's own loop.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp
import pytest
import uvloop
from aiohttp import web

from pd.cluster.http_guard import ConnectionGuard, GuardedSite, GuardLimits

TIMEOUTS = GuardLimits(header_timeout_s=0.5, body_timeout_s=2.0, keepalive_timeout_s=0.5)
CAPS = GuardLimits(header_timeout_s=60.0, keepalive_timeout_s=60.0, max_connections=64, max_connections_per_peer=2)
WAIT_S = 15.0  # a loaded box: how long a close may take past its timeout


async def _ping(request: web.Request) -> web.Response:
    return web.json_response({"loop": type(asyncio.get_running_loop()).__module__})


async def _echo(request: web.Request) -> web.Response:
    return web.json_response(await request.json())


async def _serve(guard: ConnectionGuard) -> tuple[web.AppRunner, int]:
    app = web.Application(middlewares=[guard.middleware])
    app.add_routes([web.get("/ping", _ping), web.post("/echo", _echo)])
    runner = web.AppRunner(app, access_log=None, **guard.runner_options())
    await runner.setup()
    site = GuardedSite(runner, guard, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[-1][1]


async def _closed_by_server(reader: asyncio.StreamReader) -> bool:
    """True once the server closed (or reset) the connection; False if it stayed open for WAIT_S."""
    try:
        while await asyncio.wait_for(reader.read(4096), WAIT_S):
            pass
    except asyncio.TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


async def _wait_for(cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def _timeouts(figures: dict[str, int]) -> None:
    """Requests answered; an idle connection closed gracefully, a trickled head aborted."""
    guard = ConnectionGuard(TIMEOUTS, "uvloop-test-timeouts")
    runner, port = await _serve(guard)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as http:
            async with http.get(f"{url}/ping") as resp:
                assert resp.status == 200
                figures["served_on_uvloop"] = int((await resp.json())["loop"].startswith("uvloop"))
            async with http.post(f"{url}/echo", json={"n": 7}) as resp:  # a body: read by the guard's middleware
                assert resp.status == 200 and await resp.json() == {"n": 7}
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await _closed_by_server(reader)  # idle: closed after the keep-alive timeout
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /ping HTTP/1.1\r\n")
        await writer.drain()
        assert await _closed_by_server(reader)  # a head that never ends: aborted after the header timeout
        writer.close()
        await _wait_for(lambda: guard.figures()["open"] == 0)
        figures.update({k: v for k, v in guard.figures().items() if k in ("idle_closed", "header_timeouts")})
        figures["accepted"] += guard.figures()["accepted"]
        figures["refused"] += guard.figures()["refused"]
    finally:
        await runner.cleanup()
        await guard.stop()


async def _caps(figures: dict[str, int]) -> None:
    """Past the per-peer cap (2) the least recently used idle connection is evicted, the new one served."""
    guard = ConnectionGuard(CAPS, "uvloop-test-caps")
    runner, port = await _serve(guard)
    try:
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        await _wait_for(lambda: guard.figures()["open"] == 2)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /ping HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), WAIT_S)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        writer.close()
        assert await _closed_by_server(held[0][0])  # the oldest idle one went
        for _, held_writer in held:
            held_writer.close()
        await _wait_for(lambda: guard.figures()["open"] == 0)
        figures["evicted"] = guard.figures()["evicted"]
        figures["accepted"] += guard.figures()["accepted"]
        figures["refused"] += guard.figures()["refused"]
    finally:
        await runner.cleanup()
        await guard.stop()


async def _scenario() -> dict[str, int]:
    figures = {"accepted": 0, "refused": 0}
    await _timeouts(figures)
    await _caps(figures)
    return figures


@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_guard_serves_and_enforces_on_any_loop(loop_kind):
    figures = uvloop.run(_scenario()) if loop_kind == "uvloop" else asyncio.run(_scenario())
    assert figures["served_on_uvloop"] == (loop_kind == "uvloop")
    assert figures["refused"] == 0
    assert figures["accepted"] >= 6  # the client's (one kept-alive connection or two), idle, trickle, 3 capped
    assert figures["idle_closed"] >= 1 and figures["header_timeouts"] >= 1 and figures["evicted"] >= 1, figures
