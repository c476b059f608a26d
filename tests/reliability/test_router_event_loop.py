"""Large request bodies are parsed, validated, templated and tokenized off the router's event loop.

16 chat bodies of about 0.9 MB (29,000 messages each) arrive at once. A probe
coroutine on the router's own event loop measures the loop's lag (how late a
short sleep wakes up) while they are processed; `/health` and a small
completion are timed beside them. Each body ends in a 400 (its prompt is far
longer than the context), after the whole pipeline ran for it.

The rule asserted does not depend on the machine's speed: the loop is never
blocked for the processing time of a body. That time is measured in the same
run (one body alone, end to end); the loop's longest stall and `/health`'s
slowest answer under the load must stay below it. With the work on
the loop, as before, each body stalls it for its whole processing time (and
`/health` waits behind all 16). The figures (issue: `/health` under 50 ms, a
small request under 100 ms over its normal latency) are logged and recorded.
"""
from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time

import aiohttp

from rel_deploy import LocalDeployment, local_config

logger = logging.getLogger(__name__)

NUM_BODIES = 16
NUM_MESSAGES = 29_000
SMALL = {"prompt": "a small request", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def big_chat_body() -> bytes:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}] * NUM_MESSAGES, "max_tokens": 4}).encode()
    assert 0.8e6 < len(body) < 1 << 20, len(body)  # under the default router.max_body_bytes (1 MiB)
    return body


class LoopProbe:
    """Runs on the router's loop: records how late each 5 ms sleep wakes up."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self.running = True

    async def run(self) -> None:
        while self.running:
            start = time.perf_counter()
            await asyncio.sleep(0.005)
            self.lags.append(time.perf_counter() - start - 0.005)


async def _timed(session: aiohttp.ClientSession, method: str, url: str, **kwargs) -> tuple[float, int, str]:
    start = time.perf_counter()
    async with session.request(method, url, **kwargs) as resp:
        text = await resp.text()
        return time.perf_counter() - start, resp.status, text


async def _measure(url: str, body: bytes, probe: LoopProbe | None = None, dep: LocalDeployment | None = None) -> dict:
    """The figures; the loop's own lag only with `probe` and `dep` (a router in this process)."""
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        for _ in range(2):  # warm up: connections, the model's first steps
            await _timed(session, "POST", f"{url}/v1/completions", json=SMALL)
        health_base = [(await _timed(session, "GET", f"{url}/health"))[0] for _ in range(20)]
        small_base = [(await _timed(session, "POST", f"{url}/v1/completions", json=SMALL))[0] for _ in range(5)]
        singles = [await _timed(session, "POST", f"{url}/v1/chat/completions", data=body, headers=headers)
                   for _ in range(3)]  # (a median: one sample moves with whatever else the machine runs)
        for _, status, text in singles:
            assert status == 400 and "context length" in json.loads(text)["error"]["message"], text[:300]
        one_body = statistics.median(s[0] for s in singles)

        task = None
        if probe is not None and dep is not None:
            task = asyncio.run_coroutine_threadsafe(probe.run(), dep._loop)  # noqa: SLF001 - the router's loop
            await asyncio.sleep(0.2)
            base_lag = max(probe.lags)
            probe.lags.clear()
        bodies = [asyncio.create_task(_timed(session, "POST", f"{url}/v1/chat/completions", data=body,
                                             headers=headers)) for _ in range(NUM_BODIES)]
        health_load: list[float] = []
        small_load: list[float] = []
        await asyncio.sleep(0.05)  # the bodies are on their way
        while not all(b.done() for b in bodies):
            health_load.append((await _timed(session, "GET", f"{url}/health"))[0])
            if len(health_load) % 5 == 0:
                latency, status, text = await _timed(session, "POST", f"{url}/v1/completions", json=SMALL)
                assert status == 200, text
                small_load.append(latency)
            await asyncio.sleep(0.01)
        results = await asyncio.gather(*bodies)
        if task is not None and probe is not None:
            probe.running = False
            task.result(10)
    assert all(status == 400 for _, status, _ in results), [(s, t[:200]) for _, s, t in results]
    lags = {"base_lag_s": base_lag, "max_lag_s": max(probe.lags)} if task is not None and probe is not None else {}
    return {"one_body_s": one_body, "all_bodies_s": max(r[0] for r in results), **lags,
            "health_base_s": statistics.median(health_base),
            "health_load_p50_s": statistics.median(health_load), "health_load_max_s": max(health_load),
            "small_base_s": statistics.median(small_base),
            "small_load_max_s": max(small_load) if small_load else None, "num_health": len(health_load)}


def test_large_chat_bodies_leave_the_event_loop_free(fault_record):
    body = big_chat_body()
    with LocalDeployment(local_config()) as dep:
        figures = asyncio.run(_measure(dep.url, body, LoopProbe(), dep))
        dep.wait_all_free()
    logger.warning("event loop under %d concurrent %.2f MB chat bodies: %s", NUM_BODIES, len(body) / 1e6,
                   {k: round(v * 1e3, 1) if isinstance(v, float) else v for k, v in figures.items()})
    one_body = figures["one_body_s"]
    # The rule: no stall as long as one body's processing. With the work on the loop, the loop stalls for
    # several bodies in a row (measured: 14 s, against 1.6 s for one body); off it, what is left are GC
    # pauses (measured: 0.17 s, against 0.5-0.8 s for one body on the same loaded machine).
    # (twice one body's time: GC pauses grow with the 16 bodies alive at once, one body's time does not;
    # the bug is a stall of all 16 bodies)
    assert figures["max_lag_s"] < 2 * one_body, figures
    assert figures["health_load_max_s"] < figures["health_base_s"] + 2 * one_body, figures
    assert figures["num_health"] >= 5, figures  # /health was answered all along, not only at the end
    ms = {k: f"{v * 1e3:.0f} ms" for k, v in figures.items() if isinstance(v, float)}
    fault_record(fault=f"{NUM_BODIES} concurrent {len(body) / 1e6:.1f} MB chat bodies ({NUM_MESSAGES} messages)",
                 where="router", user_saw=f"/health {ms['health_base_s']} alone, p50 {ms['health_load_p50_s']} "
                                          f"max {ms['health_load_max_s']} under load; a small completion "
                                          f"{ms['small_base_s']} alone, max {ms.get('small_load_max_s')} under load",
                 pdkv_did=f"parsed on a thread pool: event loop's longest stall {ms['max_lag_s']} "
                          f"(one body takes {ms['one_body_s']}); every body a 400", pools="all free")


if __name__ == "__main__":  # figures against a running router: python tests/reliability/test_router_event_loop.py URL
    import sys

    found = asyncio.run(_measure(sys.argv[1].rstrip("/"), big_chat_body()))
    print({k: f"{v * 1e3:.1f} ms" if isinstance(v, float) else v for k, v in found.items()})
