"""Malformed requests against the router's HTTP API while good requests go on.

Every malformed request must get a 4xx OpenAI-style error (never a 5xx, never
a hang), good requests must keep getting the reference tokens, the router
must stay healthy and every pool ends all free."""
from __future__ import annotations

import asyncio
import collections
import json
import random

import aiohttp
import pytest
import requests

from rel_deploy import LocalDeployment, local_config

GOOD = {"prompt": "Fuzz, but politely. ", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True}
FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "stream",
          "stream_options", "n", "best_of", "echo", "logprobs", "model", "kv_transfer_params", "ignore_eos"]
WEIRD = [None, True, False, -1, 0, 1, 2 ** 31, -(2 ** 63), 1e308, -0.0, 3.5, "", "x", "\u0000", "\udcff" * 0 + "é",
         [], [1], [-1], [[1, 2]], [[]], ["a", 1], [300], [2 ** 40], {}, {"include_usage": "yes"}, "a" * 5000]


def malformed(rng: random.Random) -> tuple[str, str, bytes, dict]:
    """(method, path, body, headers) of a request the router must refuse with a 4xx."""
    kind = rng.randrange(7)
    headers = {"Content-Type": "application/json"}
    if kind == 0:  # not JSON / not UTF-8
        return "POST", "/v1/completions", rng.choice([rng.randbytes(40), b"{", b"\xff\xfe{}", b""]), headers
    if kind == 1:  # deeply nested JSON
        depth = rng.choice([100, 5000, 50000])
        return "POST", "/v1/completions", b"[" * depth + b"]" * depth, headers
    if kind == 2:  # not an object
        return "POST", "/v1/completions", json.dumps(rng.choice([[], 1, "s", None, [GOOD]])).encode(), headers
    if kind == 3:  # unknown route / method
        return rng.choice([("GET", "/v1/completions"), ("POST", "/v1/chat/nothing"), ("DELETE", "/v1/models"),
                           ("POST", "/../etc/passwd")]) + (b"{}", headers)
    body = dict(GOOD)
    for _ in range(rng.randrange(1, 4)):  # some fields set to values of the wrong type or range
        body[rng.choice(FIELDS)] = rng.choice(WEIRD)
    body["prompt"] = rng.choice([body["prompt"], None, [], [-5], [[999]], ""]) if kind == 4 else body["prompt"]
    body["max_tokens"] = rng.choice([0, -3, "8", 1.5, None]) if kind == 5 else body.get("max_tokens")
    if kind == 6:
        body["n"] = rng.choice([0, 2, -1, "1"])
    return "POST", "/v1/completions", json.dumps(body).encode(), headers


async def _good_loop(session, url, want, stop: asyncio.Event, counts):
    while not stop.is_set():
        async with session.post(f"{url}/v1/completions", json=GOOD) as resp:
            body = await resp.json()
            assert resp.status == 200, body
            assert body["choices"][0]["token_ids"] == want
            counts["good"] += 1


async def _fuzz(url: str, num_requests: int, want: list[int], seed: int) -> collections.Counter:
    rng = random.Random(seed)
    counts: collections.Counter = collections.Counter()
    stop = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        good = [asyncio.create_task(_good_loop(session, url, want, stop, counts)) for _ in range(2)]
        sem = asyncio.Semaphore(16)

        async def one(i):
            method, path, body, headers = malformed(rng)
            async with sem, session.request(method, url + path, data=body, headers=headers) as resp:
                text = await resp.text()
                # 200 only when the mutation happened to keep the request valid
                assert resp.status < 500, (resp.status, body[:200], text[:300])
                counts[resp.status] += 1
                if resp.status != 200 and path.startswith("/v1/"):
                    assert "error" in json.loads(text), text[:200]

        await asyncio.gather(*(one(i) for i in range(num_requests)))
        stop.set()
        await asyncio.gather(*good)
    return counts


def fuzz_http(num_requests: int, fault_record) -> None:
    with LocalDeployment(local_config()) as dep:
        want = requests.post(f"{dep.url}/v1/completions", json=GOOD, timeout=30).json()["choices"][0]["token_ids"]
        counts = asyncio.run(_fuzz(dep.url, num_requests, want, seed=num_requests))
        assert counts["good"] >= 2
        health = requests.get(f"{dep.url}/health", timeout=10)
        assert health.status_code == 200
        dep.wait_all_free()
    statuses = {k: v for k, v in sorted(counts.items(), key=str) if k != "good"}
    fault_record(fault=f"fuzzed HTTP API: {num_requests} malformed requests", where="router",
                 user_saw=f"HTTP statuses {statuses} (200 only where a mutation left the request valid); "
                          f"{counts['good']} concurrent good requests correct",
                 pdkv_did="no 5xx, no hang; router healthy", pools="all free")


def test_fuzz_http_short(fault_record):
    fuzz_http(400, fault_record)


@pytest.mark.slow
def test_fuzz_http_long(fault_record):
    fuzz_http(10_000, fault_record)
