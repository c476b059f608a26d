"""2P2D on a `ray.cluster_utils.Cluster` with two simulated worker nodes.

Checks placement across nodes, greedy identity with a single in-process
engine, pool audits, and that a decode worker killed mid-stream fails only
its own requests (clear errors, no hang) while the deployment keeps serving.
"""
from __future__ import annotations

import functools
import json
import threading
import time

import pytest
import ray
import requests
from ray.cluster_utils import Cluster

from tests.helpers.e2e import (PROMPTS, complete, e2e_config, kill_actor, stream_events, wait_all_free,
                               worker_reports)
from kvcache.audit import assert_all_free
from pd.cluster.config import Mode
from pd.engine.engine import Engine
from pd.deploy.launch import Deployment
from pd.cluster.roles import Role
from pd.engine.sample.params import SamplingParams
from pd.engine.text.tokenizer import ByteTokenizer
from pd.worker.worker import WorkerSpec
from pd.worker.wiring import engine_config_for

NODE_ARGS = {"num_cpus": 1, "object_store_memory": 80 * 1024 * 1024}


@pytest.fixture(scope="module")
def cluster():
    # 2 CPUs in all: a head without CPUs (driver + router) and two 1-CPU "machines".
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                             "object_store_memory": 80 * 1024 * 1024})
    for _ in range(2):
        cluster.add_node(**NODE_ARGS)
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def deployment(cluster):
    config = e2e_config("local.yaml", topology__num_prefill=2, topology__num_decode=2)
    with Deployment(config) as dep:
        yield dep


@functools.cache
def _reference_tokens(prompt: str, max_tokens: int) -> list[int]:
    """Greedy tokens from one plain engine with the same model (colocated mode, no Ray, no HTTP)."""
    config = e2e_config("local.yaml", topology__mode=Mode.COLOCATED.value)
    engine = Engine(engine_config_for(WorkerSpec("ref", Role.BOTH, config, "r" * 32)))
    try:
        out = engine.generate_sync({"ref": ByteTokenizer().encode(prompt)},
                                   SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        assert_all_free(engine.kv_cache_manager)
        return out["ref"]
    finally:
        engine.shutdown()


def test_workers_spread_over_nodes(deployment):
    nodes = {w.endpoint.node_id for w in deployment.workers}
    assert len(nodes) == 2, nodes
    roles = sorted(w.endpoint.role.value for w in deployment.workers)
    assert roles == ["decode", "decode", "prefill", "prefill"]


def test_greedy_outputs_match_single_engine(deployment):
    results = {}

    def run(i: int, prompt: str) -> None:  # concurrent, so both P and both D workers get traffic
        results[i] = complete(deployment.url, prompt, max_tokens=16, ignore_eos=True)["choices"][0]["token_ids"]

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for i, prompt in enumerate(PROMPTS):
        assert results[i] == _reference_tokens(prompt, 16), prompt
    busy = [wid for wid, r in worker_reports(deployment.url).items() if r["stats"].get("num_steps", 0) > 0]
    assert len(busy) == 4, busy  # least-loaded routing used every worker


def test_pools_all_free_after_the_run(deployment):
    wait_all_free(deployment.url)


def test_decode_worker_killed_mid_stream(deployment):
    url = deployment.url
    outcomes: dict[int, list] = {}
    first_tokens = threading.Barrier(7, timeout=60)

    def run(i: int) -> None:
        body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 400, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}
        events, passed = [], False
        with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=60) as resp:
            for line in resp.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                events.append("[DONE]" if line == b"data: [DONE]" else json.loads(line[6:]))
                if not passed and len(events) >= 3:
                    passed = True
                    first_tokens.wait()
        outcomes[i] = events

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    first_tokens.wait()  # every stream is producing tokens
    kill_actor(next(w for w in deployment.workers if w.endpoint.worker_id == "decode-0").actor)
    started = time.monotonic()
    for t in threads:
        t.join(timeout=90)
    assert not any(t.is_alive() for t in threads), "a stream hung after its decode worker died"
    assert time.monotonic() - started < 60

    # The streams on decode-0 migrate to decode-1 (pd.router.recovery): every stream completes, no error event.
    assert len(outcomes) == 6
    for events in outcomes.values():
        assert not any(isinstance(x, dict) and "error" in x for x in events), events[-3:]
        assert events[-2]["usage"]["completion_tokens"] == 400 and events[-1] == "[DONE]"

    # The dead worker left the rotation; the others keep serving.
    reports = worker_reports(url)
    assert reports["decode-0"]["healthy"] is False
    assert all(r["healthy"] for wid, r in reports.items() if wid != "decode-0")
    for prompt in PROMPTS[:4]:
        events = stream_events(url, prompt, max_tokens=8)
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] >= 1
    wait_all_free(url)


def test_prefill_worker_killed_requests_move_to_the_other(deployment):
    """After decode-0's death above: kill prefill-1 too; requests keep succeeding on prefill-0 / decode-1
    (a request that picks the dead worker before it is noticed is retried, since nothing was produced yet)."""
    url = deployment.url
    kill_actor(next(w for w in deployment.workers if w.endpoint.worker_id == "prefill-1").actor)
    for prompt in PROMPTS:
        got = complete(url, prompt, max_tokens=16, ignore_eos=True)["choices"][0]["token_ids"]
        assert got == _reference_tokens(prompt, 16)
    deadline = time.monotonic() + 15  # found by a failed call, or by the health loop's polls
    while worker_reports(url)["prefill-1"]["healthy"] and time.monotonic() < deadline:
        time.sleep(0.2)
    reports = worker_reports(url)
    assert reports["prefill-1"]["healthy"] is False and reports["prefill-0"]["healthy"] is True
    health = requests.get(f"{url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "degraded", health.text  # still serving, short
    assert "prefill" in health.json()["short_roles"], health.text
    wait_all_free(url)
