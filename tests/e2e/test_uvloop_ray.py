"""A Ray deployment served on uvloop end to end: the router's event loop is a uvloop loop (the
event loop policy), and so is each worker actor's (Ray's async actors run on uvloop wherever it
is installed; RAY_USE_UVLOOP=1 says so explicitly). Requests are answered, streamed and not, the
pool audit covers 2 of 2 workers and is clean; once a worker is gone for good, the audit reaches
1 of 2, names it, and is not clean.
"""
from __future__ import annotations

import asyncio
import gc
import os
import time

import pytest
import ray
import requests
import uvloop

from pd.deploy.launch import Deployment
from tests.helpers.e2e import PROMPTS, complete, e2e_config, ray_init_kwargs, stream_events


@pytest.fixture(scope="module")
def deployment():
    saved_env, saved_policy = os.environ.get("RAY_USE_UVLOOP"), asyncio.get_event_loop_policy()
    os.environ["RAY_USE_UVLOOP"] = "1"  # the local Ray instance's worker processes inherit it
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())  # the router's loop (Deployment.start) comes from it
    ray.init(**ray_init_kwargs())
    dep = Deployment(e2e_config("local.yaml"))
    try:
        dep.start()
        yield dep
    finally:
        dep.stop()
        ray.shutdown()
        asyncio.set_event_loop_policy(saved_policy)
        if saved_env is None:
            os.environ.pop("RAY_USE_UVLOOP", None)
        else:
            os.environ["RAY_USE_UVLOOP"] = saved_env


def test_router_and_workers_run_on_uvloop(deployment):
    def running_loops(actor_self) -> list[str]:
        """Runs inside a worker actor (`__ray_call__`, on a thread of its own; a local function, so Ray
        ships it by value): the classes of the event loops running in that process."""
        return [f"{type(o).__module__}.{type(o).__name__}" for o in gc.get_objects()
                if isinstance(o, asyncio.AbstractEventLoop) and o.is_running()]

    assert isinstance(deployment._loop, uvloop.Loop)
    for worker in deployment.workers:
        loops = ray.get(worker.actor.__ray_call__.remote(running_loops), timeout=60)
        assert loops and all(name.startswith("uvloop") for name in loops), (worker.endpoint.worker_id, loops)


def test_served_on_uvloop_and_audited_2_of_2(deployment):
    url = deployment.url
    for prompt in PROMPTS:
        whole = complete(url, prompt, max_tokens=8, ignore_eos=True)["choices"][0]
        assert whole["finish_reason"] == "length" and len(whole["token_ids"]) == 8
        events = stream_events(url, prompt, max_tokens=8, ignore_eos=True)
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events[-3:]
        streamed = [t for e in events[:-1] for c in e.get("choices", []) for t in c.get("token_ids") or []]
        assert streamed == whole["token_ids"], prompt  # greedy: streamed as not
    report = deployment.audit_pools()
    assert report.clean, report.lines()
    assert report.lines() == ["KV pools after the run: all free (2 of 2 workers audited)"]
    assert all(a["consistent"] for a in report.audits.values()), report.audits


def _wait_until_refused(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            requests.get(f"{url}/internal/health", timeout=1.0)
        except requests.RequestException:
            return
        time.sleep(0.1)
    raise AssertionError(f"{url} still answers {timeout_s:.0f} s after ray.kill")


def test_audit_of_fewer_workers_than_deployed_is_not_clean(deployment):
    prefill = next(w for w in deployment.workers if w.endpoint.worker_id == "prefill-0")
    ray.kill(prefill.actor, no_restart=True)
    _wait_until_refused(prefill.endpoint.url)  # ray.kill returns before the process is gone
    report = deployment.audit_pools(timeout_s=30.0)  # returns once the router took P out of the rotation
    assert not report.clean and list(report.audits) == ["decode-0"], report.lines()
    lines = report.lines()
    assert lines[0] == "KV pools after the run: NOT verified (1 of 2 workers audited)", lines
    assert lines[1].startswith("  prefill-0: unreachable: "), lines
