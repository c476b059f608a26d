"""The serving path on uvloop: real P/D workers and the real router in this process, every
one of them on a uvloop event loop, over loopback HTTP (tests/e2e/test_uvloop_ray.py does the
same with Ray actors). Their greedy answers are the ones the same deployment gives on asyncio's
own loop, streamed and not, and every pool ends all free, audited worker by worker.
"""
from __future__ import annotations

import asyncio
import json

import pytest
import requests
import uvloop

from pd.deploy.pool_audit import audit_once
from rel_deploy import LocalDeployment, local_config

HTTP_TIMEOUT_S = 60
PROMPTS = ["The quick brown fox jumps over the lazy dog while the cat sleeps.", "short",
           "A prompt long enough for a few blocks of sixteen tokens, shared by nobody else here. " * 2]


def _complete(url: str, prompt: str) -> list[int]:
    resp = requests.post(f"{url}/v1/completions", timeout=HTTP_TIMEOUT_S,
                         json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                               "return_token_ids": True})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    return choice["token_ids"]


def _stream(url: str, prompt: str) -> list[int]:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "stream": True}
    token_ids: list[int] = []
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=HTTP_TIMEOUT_S) as resp:
        assert resp.status_code == 200, resp.text
        lines = [line[6:] for line in resp.iter_lines() if line.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]", lines[-3:]
    for data in lines[:-1]:
        event = json.loads(data)
        assert "error" not in event, event
        token_ids += event["choices"][0].get("token_ids") or []
    return token_ids


def _serve(loop_kind: str) -> tuple[list[list[int]], list[str]]:
    """Answers (non-streamed, then streamed) and the pool audit's lines, the whole deployment on `loop_kind`."""
    policy = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy() if loop_kind == "uvloop" else asyncio.DefaultEventLoopPolicy())
    try:
        dep = LocalDeployment(local_config())  # its loop (router and workers) comes from the policy
    finally:
        asyncio.set_event_loop_policy(policy)
    assert isinstance(dep._loop, uvloop.Loop) == (loop_kind == "uvloop")
    with dep:
        answers = [_complete(dep.url, p) for p in PROMPTS] + [_stream(dep.url, p) for p in PROMPTS]
        dep.wait_all_free()
        assert dep.router is not None
        report = dep.run(audit_once(dep.router))
        assert report.clean, report.lines()
        return answers, report.lines()


@pytest.fixture(scope="module")
def on_asyncio() -> list[list[int]]:
    return _serve("asyncio")[0]


def test_pd_serves_on_uvloop_as_on_asyncio(on_asyncio):
    answers, audit_lines = _serve("uvloop")
    assert all(len(a) == 8 for a in answers), answers
    assert answers == on_asyncio  # greedy, seeded weights: the loop changes nothing in what is said
    assert answers[:len(PROMPTS)] == answers[len(PROMPTS):]  # streamed as not
    assert audit_lines == ["KV pools after the run: all free (2 of 2 workers audited)"]
