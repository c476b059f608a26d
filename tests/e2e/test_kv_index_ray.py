"""The router's KV index on a real Ray deployment (2P2D actors, real HTTP, real ZMQ CURVE PUB/SUB):
after a shared-prefix run with duplicate copies (greedy twins), the index holds exactly each
worker's cached hashes, copy for copy, and the predicted hit agreed with the worker's reported
hit on every request (P and D)."""
from __future__ import annotations

import collections
import time

import pytest
import requests

from tests.helpers.e2e import HTTP_TIMEOUT_S, SHARED, complete, e2e_config, wait_all_free
from pd.deploy.launch import Deployment


@pytest.fixture(scope="module")
def deployment(ray_instance):
    config = e2e_config("local.yaml", topology__num_prefill=2, topology__num_decode=2, cache__kv_memory_mb=0.5)
    with Deployment(config) as dep:
        yield dep


def _snapshots(dep: Deployment) -> dict[str, dict]:
    """Each worker's own cache, as its replay endpoint's snapshot (taken between steps)."""
    headers = {"Authorization": f"Bearer {dep.secret}"}
    out = {}
    for w in dep.workers:
        r = requests.get(f"{w.endpoint.url}/internal/kv_events", headers=headers, timeout=HTTP_TIMEOUT_S)
        r.raise_for_status()
        out[w.endpoint.worker_id] = r.json()["snapshot"]
    return out


def _wait_caught_up(dep: Deployment, timeout_s: float = 15.0) -> dict[str, dict]:
    index = dep.router.kv_index
    deadline = time.monotonic() + timeout_s
    while True:
        snaps = _snapshots(dep)
        described = {wid: index.describe(wid) for wid in snaps}
        if all(d["state"] == "exact" and d["seq"] == snaps[wid]["seq"] for wid, d in described.items()):
            return snaps
        if time.monotonic() > deadline:
            pytest.fail(f"index not caught up: {described} vs {[(w, s['seq']) for w, s in snaps.items()]}")
        time.sleep(0.05)


def _counter(dep: Deployment, name: str, **labels) -> float:
    return sum(s.value for m in dep.router.metrics.registry.collect() for s in m.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_index_is_every_workers_cache_and_predictions_hold(deployment):
    dep = deployment
    _wait_caught_up(dep)
    cached = []
    for i in range(6):
        out = complete(dep.url, SHARED * 3 + f"tenant {i % 3} turn {i}", max_tokens=4)
        cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
        _wait_caught_up(dep)  # the next choice sees this request's blocks
    assert sum(cached) > 0
    for _ in range(2):  # greedy twins: D decodes the same tokens into other blocks (two copies)
        out = complete(dep.url, SHARED * 3 + "twins", max_tokens=40, ignore_eos=True)
        cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
        _wait_caught_up(dep)
    snaps = _wait_caught_up(dep)
    num_duplicated = 0
    for wid, snap in snaps.items():  # a snapshot lists a hash once per copy
        theirs = {int(g): dict(collections.Counter(bytes.fromhex(h) for h in hs))
                  for g, hs in snap["groups"].items() if hs}
        assert dep.router.kv_index.hashes(wid) == {g: set(hs) for g, hs in theirs.items()}, wid
        assert dep.router.kv_index.copies(wid) == theirs, wid
        num_duplicated += sum(n > 1 for hs in theirs.values() for n in hs.values())
    assert num_duplicated > 0
    assert _counter(dep, "pdkv_prefix_hit_mispredictions_total") == 0
    for role in ("prefill", "decode"):
        assert _counter(dep, "pdkv_prefix_hit_tokens_predicted_total", role=role) == \
            _counter(dep, "pdkv_prefix_hit_tokens_actual_total", role=role)
    assert _counter(dep, "pdkv_prefix_hit_tokens_actual_total", role="prefill") == sum(cached)
    wait_all_free(dep.url)
