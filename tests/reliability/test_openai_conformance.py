"""OpenAI conformance under failure, on an in-process deployment (real workers,
router, ZMQ and HTTP; no Ray): a bug in the router answers OpenAI error JSON
(never aiohttp's plain-text 500), a stream that breaks after it started ends
with an error event and `[DONE]` on both endpoints, usage chunks come only on
request, and a non-UTF-8 `Authorization` header is a 401."""
from __future__ import annotations

import json

import openai
import pytest
import requests

from rel_deploy import LocalDeployment, local_config

CHAT = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 48, "ignore_eos": True}
COMPLETION = {"prompt": "Tell me a story.", "max_tokens": 48, "ignore_eos": True}
BODIES = {"chat/completions": CHAT, "completions": COMPLETION}


def sse_events(url: str, path: str, body: dict, headers: dict | None = None) -> list:
    events = []
    with requests.post(f"{url}/v1/{path}", json=dict(body, stream=True), stream=True, timeout=30,
                       headers=headers) as resp:
        assert resp.status_code == 200, resp.text
        for line in resp.iter_lines():
            if line.startswith(b"data: "):
                events.append("[DONE]" if line == b"data: [DONE]" else json.loads(line[6:]))
    return events


@pytest.fixture(scope="module")
def vocab_mismatch():
    """A router whose tokenizer fails to decode (an injected bug: a mismatched vocabulary is refused
    at config time, and an unknown id shows as no text): an unexpected exception inside the router."""
    with LocalDeployment(local_config("colocated")) as dep:
        def broken_decode(token_ids, skip_special_tokens=True):
            raise ValueError("injected router bug: decode failed")

        dep.router.tokenizer.decode = broken_decode
        yield dep


@pytest.mark.parametrize("path", sorted(BODIES))
def test_router_bug_answers_openai_error_json(vocab_mismatch, path, fault_record):
    body = dict(BODIES[path], temperature=1.0, seed=3)
    resp = requests.post(f"{vocab_mismatch.url}/v1/{path}", json=body, timeout=30)
    assert resp.status_code == 500 and resp.headers["Content-Type"].startswith("application/json"), resp.text
    error = resp.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error" and "ValueError" in error["message"]
    events = sse_events(vocab_mismatch.url, path, body)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "internal_error", events[-3:]
    assert sum(1 for e in events if isinstance(e, dict) and "error" in e) == 1
    freed = vocab_mismatch.wait_all_free()  # the router closed the worker stream: the request was aborted
    assert requests.get(f"{vocab_mismatch.url}/health", timeout=10).status_code == 200
    fault_record(fault=f"router bug while serving /v1/{path} (undecodable token id)", where="router",
                 user_saw="HTTP 500 OpenAI error JSON; streamed: an error event and [DONE]",
                 pdkv_did="logged the traceback; closed the worker stream", pools=f"all free ({freed:.1f}s)")


@pytest.mark.parametrize("path", sorted(BODIES))
def test_worker_stalled_mid_stream_gets_error_event_and_done(path, fault_record):
    # D stops for 6 s after its 4th token; the router's stall limit is 3 s
    config = local_config(faults={"decode": "worker.decode_token:stall:6:after=3"}, router__request_timeout_s=3.0)
    with LocalDeployment(config) as dep:
        events = sse_events(dep.url, path, dict(BODIES[path], temperature=0))
        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert error["type"] == "server_error" and error["code"] == "worker_timeout", error
        if path == "chat/completions":
            assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        content = [e for e in events[:-2] if e["choices"]]
        assert 1 <= len(content) < 48  # some tokens, then the error: never a silent truncation
        freed = dep.wait_all_free(timeout_s=20)
    fault_record(fault=f"D stalls mid-stream past the router's limit (/v1/{path})", where="D worker",
                 user_saw=f"{len(content)} chunks, then an error event (worker_timeout) and [DONE]",
                 pdkv_did="router closed the D stream; D aborted", pools=f"all free ({freed:.1f}s)")


def test_usage_chunk_only_when_asked():
    with LocalDeployment(local_config("colocated")) as dep:
        for path, body in BODIES.items():
            body = dict(body, max_tokens=6, temperature=0)
            plain = sse_events(dep.url, path, body)
            assert plain[-1] == "[DONE]" and all(e["choices"] and "usage" not in e for e in plain[:-1])
            asked = sse_events(dep.url, path, dict(body, stream_options={"include_usage": True}))
            usage = asked[-2]
            assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
            # the same prompt ran just before: its full blocks come from the prefix cache, the last token never
            cached = usage["usage"]["prompt_tokens_details"]["cached_tokens"]
            block_size = dep.config.cache.block_size
            assert cached == (usage["usage"]["prompt_tokens"] - 1) // block_size * block_size > 0
            assert all(e["choices"] and e["usage"] is None for e in asked[:-2])
            text = "".join(e["choices"][0].get("text") or e["choices"][0].get("delta", {}).get("content") or ""
                           for e in asked[:-2])
            plain_text = "".join(e["choices"][0].get("text") or e["choices"][0].get("delta", {}).get("content") or ""
                                 for e in plain[:-1])
            assert text == plain_text
        dep.wait_all_free()


def test_authorization_header_that_is_not_utf8_is_a_401():
    key = "router-api-key-0123456789"
    with LocalDeployment(local_config("colocated", router__api_key=key)) as dep:
        for header in (b"Bearer \xff\xfe", b"\xc3\x28", "Bearer cl\u00e9".encode("latin-1")):
            resp = requests.post(f"{dep.url}/v1/completions", json=COMPLETION, headers={"Authorization": header},
                                 timeout=10)
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key", resp.text
        good = openai.OpenAI(base_url=f"{dep.url}/v1", api_key=key, max_retries=0, timeout=30)
        reply = good.chat.completions.create(model="pdkv-tiny", messages=CHAT["messages"], max_tokens=4)
        assert reply.usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{dep.url}/v1", api_key="wrong", max_retries=0).models.list()
        dep.wait_all_free()
