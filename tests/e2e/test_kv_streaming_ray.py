"""1P1D with KV streaming (`transfer.streaming: chunk` and `layer`) on a local Ray instance, over real
HTTP and ZMQ.

The router sends each request to P and D at once; P publishes the blocks of every prefill step
(layer: slice by slice of layers, as its forward runs them) and D pulls them as they come. Outputs must equal the colocated deployment's token for token
(greedy and seeded), the parts must really be several, and every pool ends all free.
"""
from __future__ import annotations

import re
import time

import pytest
import requests

from pd.deploy.launch import Deployment
from tests.helpers.e2e import PROMPTS, complete, e2e_config, stream_events, wait_all_free, worker_reports

LONG = [PROMPTS[4] * 2, PROMPTS[2] * 3, PROMPTS[0] + PROMPTS[4]]  # 150-300 byte tokens: several 16-token parts


@pytest.fixture(scope="module")
def colocated(ray_instance):
    with Deployment(e2e_config("local-colocated.yaml")) as dep:
        yield dep.url


@pytest.fixture(scope="module", params=["chunk", "layer"])
def streamed(ray_instance, request):
    config = e2e_config("local.yaml", transfer__streaming=request.param, transfer__stream_chunk_tokens=16)
    with Deployment(config) as dep:
        deadline = time.monotonic() + 30  # the router learns P's stream source from its first stats poll
        while not any("kv_stream" in r["stats"] for r in worker_reports(dep.url).values() if r["role"] == "prefill"):
            assert time.monotonic() < deadline, "the prefill worker never reported its stream source"
            time.sleep(0.2)
        yield dep.url


def _transfer(url: str, role: str) -> dict:
    return next(r["stats"]["transfer"] for r in worker_reports(url).values() if r["role"] == role)


def test_streamed_outputs_match_colocated(streamed, colocated):
    parts_before = _transfer(streamed, "decode").get("stream_parts_received", 0)
    for prompt in LONG:
        want = complete(colocated, prompt, max_tokens=12, ignore_eos=True)["choices"][0]
        got = complete(streamed, prompt, max_tokens=12, ignore_eos=True)["choices"][0]
        assert got["token_ids"] == want["token_ids"], prompt
        assert got["text"] == want["text"]
    for seed in (7, 8):
        want = complete(colocated, LONG[0], temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True)
        got = complete(streamed, LONG[0], temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True)
        assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    d, p = _transfer(streamed, "decode"), _transfer(streamed, "prefill")
    assert d["stream_parts_received"] - parts_before > 2 * (len(LONG) + 2)  # several parts per request
    assert p["stream_parts_published"] >= d["stream_parts_received"] and d["failures_total"] == 0
    metrics = requests.get(streamed + "/metrics", timeout=10).text  # the router exports both counts
    for name in ("pdkv_kv_stream_parts_published_total", "pdkv_kv_stream_parts_received_total"):
        values = [float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", metrics, re.M)]
        assert values and max(values) > 0, name
    wait_all_free(streamed)


def test_streamed_sse_and_client_leaving_mid_stream(streamed, colocated):
    events = stream_events(streamed, LONG[1], max_tokens=8, ignore_eos=True)
    want = complete(colocated, LONG[1], max_tokens=8, ignore_eos=True)["choices"][0]["token_ids"]
    assert [t for e in events[:-2] for t in e["choices"][0].get("token_ids") or []] == want
    import requests  # the client leaves after the first chunk: both legs end, both pools free

    body = {"prompt": LONG[2] * 2, "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
    with requests.post(f"{streamed}/v1/completions", json=body, stream=True, timeout=60) as resp:
        assert resp.status_code == 200
        next(resp.iter_lines())
    wait_all_free(streamed)


@pytest.fixture(scope="module")
def failing_p(ray_instance):
    """Streaming, with every request's prefill step on P failing (`engine.step:kill`)."""
    config = e2e_config("local.yaml", transfer__streaming="chunk", transfer__stream_chunk_tokens=16,
                        faults__prefill="engine.step:kill")
    with Deployment(config) as dep:
        deadline = time.monotonic() + 30
        while not any("kv_stream" in r["stats"] for r in worker_reports(dep.url).values() if r["role"] == "prefill"):
            assert time.monotonic() < deadline, "the prefill worker never reported its stream source"
            time.sleep(0.2)
        yield dep.url


def test_p_failing_mid_stream_starts_no_second_d_leg(failing_p, colocated):
    """P's answer fails: D is told, recomputes under its policy, and the client sees colocated's tokens."""
    want = complete(colocated, LONG[0], max_tokens=8, ignore_eos=True)["choices"][0]["token_ids"]
    got = complete(failing_p, LONG[0], max_tokens=8, ignore_eos=True)["choices"][0]["token_ids"]
    assert got == want
    d = _transfer(failing_p, "decode")
    # one D leg (one load), told by P that its prefill failed; D recomputed the prompt itself
    assert d["failures"] == {"peer_gone": 1} and d["loads_ok"] == 0 and d.get("stream_parts_received", 0) == 0
    wait_all_free(failing_p)
