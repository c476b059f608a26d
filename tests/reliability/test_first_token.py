"""P's first token straight to the client (`router.first_token_from_prefill`, pd.router.first_token), on an
in-process 1P1D deployment (real workers, ZMQ connector, router, loopback HTTP): the same tokens as D's
first token gives, the request that P's token ends never reaches D, and every KV block is free after."""
from __future__ import annotations

import json

import pytest
import requests

from rel_deploy import LocalDeployment, local_config

PROMPTS = ["one two three", "the quick brown fox jumps over the lazy dog " * 3, "x", "a b c d e f g h i j k l m n o p"]


@pytest.fixture(scope="module")
def dep():
    with LocalDeployment(local_config(router__report_route=True)) as d:
        yield d


def _complete(url: str, prompt: str, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "return_token_ids": True, "ignore_eos": True,
            **extra}
    resp = requests.post(f"{url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _stream(url: str, prompt: str, **extra) -> list[dict]:
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "return_token_ids": True, "ignore_eos": True,
            "stream": True, **extra}
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=30) as resp:
        assert resp.status_code == 200, resp.text
        return [json.loads(line[6:]) for line in resp.iter_lines()
                if line.startswith(b"data: ") and line != b"data: [DONE]"]


def test_greedy_tokens_are_those_of_ds_first_token(dep):
    """A seeded request keeps D's first token (the path before this switch): greedy, both give the same ids."""
    for prompt in PROMPTS:
        forwarded = _complete(dep.url, prompt)
        d_first = _complete(dep.url, prompt, seed=11)
        assert forwarded["choices"][0]["token_ids"] == d_first["choices"][0]["token_ids"], prompt
        assert len(forwarded["choices"][0]["token_ids"]) == 6
        assert forwarded["usage"]["completion_tokens"] == 6
        assert forwarded["choices"][0]["finish_reason"] == "length"
        assert forwarded["choices"][0]["pdkv_route"]["decode_worker"] == "decode-0"  # D made the other five
        chunks = _stream(dep.url, prompt)
        assert [t for c in chunks for t in c["choices"][0].get("token_ids") or [] if c["choices"]] == \
            forwarded["choices"][0]["token_ids"]
    dep.wait_all_free()


def test_one_token_is_answered_by_p_alone(dep):
    out = _complete(dep.url, "only one", max_tokens=1)
    assert len(out["choices"][0]["token_ids"]) == 1 and out["choices"][0]["finish_reason"] == "length"
    assert out["choices"][0]["pdkv_route"]["prefill_worker"] == "prefill-0" and out["choices"][0]["pdkv_route"]["decode_worker"] is None
    assert out["choices"][0]["token_ids"] == _complete(dep.url, "only one", max_tokens=1, seed=2)["choices"][0][
        "token_ids"]
    dep.wait_all_free()  # P's blocks, kept for a D that never came, were let go (the lease abort)


def test_a_stop_token_first_ends_the_request_on_p(dep):
    first = _complete(dep.url, "stop at once")["choices"][0]["token_ids"][0]
    out = _complete(dep.url, "stop at once", stop_token_ids=[first])
    assert out["choices"][0]["token_ids"] == [first] and out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["pdkv_route"]["decode_worker"] is None
    d_first = _complete(dep.url, "stop at once", stop_token_ids=[first], seed=5)
    assert d_first["choices"][0]["token_ids"] == [first] and d_first["choices"][0]["finish_reason"] == "stop"
    streamed = _stream(dep.url, "stop at once", stop_token_ids=[first])
    assert [c["choices"][0]["finish_reason"] for c in streamed if c["choices"]][-1] == "stop"
    dep.wait_all_free()


def test_the_switch_off_keeps_ds_first_token():
    with LocalDeployment(local_config(router__report_route=True, router__first_token_from_prefill=False)) as d:
        timed = requests.post(f"{d.url}/v1/completions", json={"prompt": "one two three", "max_tokens": 1},
                              headers={"x-pdkv-timing": "1"}, timeout=30).json()
        assert "decode_compute_s" in timed["pdkv_timing"]["stages"]  # D's step gave the first token
        assert timed["choices"][0]["pdkv_route"]["decode_worker"] == "decode-0"
        d.wait_all_free()
