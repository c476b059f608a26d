"""`/health` reports degraded capacity (issue 49, finding 7): with workers lost but every role still
served it answers 200 `degraded`, naming the roles short and how many workers of each are up of
how many; `ok` only with every worker in the rotation; 503 only when nothing can serve."""
from __future__ import annotations

import time

import requests

from pd.router.choice import Role, WorkerEndpoint, WorkerPool
from pd.router.recovery import health_report
from rel_deploy import LocalDeployment, local_config


def test_two_of_four_dead_is_degraded_with_the_shortfall():
    pool = WorkerPool()
    for wid, role in (("p0", Role.PREFILL), ("p1", Role.PREFILL), ("d0", Role.DECODE), ("d1", Role.DECODE)):
        pool.add(WorkerEndpoint(wid, role, f"http://{wid}"))
    body, status = health_report(pool, colocated=False)
    assert (status, body["status"], body["short_roles"], body["workers_up"]) == (200, "ok", [], 4), body
    pool.mark_dead("p1", "test")
    pool.mark_dead("d1", "test")
    body, status = health_report(pool, colocated=False)
    assert (status, body["status"], body["missing_roles"]) == (200, "degraded", []), body
    assert body["short_roles"] == ["prefill", "decode"] and (body["workers_up"], body["workers_expected"]) == (2, 4)
    assert body["capacity"] == {"prefill": {"up": 1, "expected": 2}, "decode": {"up": 1, "expected": 2}}
    assert "2 of 4 workers" in body["reason"] and "prefill 1 of 2" in body["reason"], body
    pool.mark_dead("p0", "test")  # no prefill at all: still serving, decode prefills locally
    body, status = health_report(pool, colocated=False)
    assert (status, body["status"], body["missing_roles"]) == (200, "degraded", ["prefill"]), body
    assert "prefill locally" in body["reason"] and "1 of 4 workers" in body["reason"], body
    pool.mark_dead("d0", "test")
    assert health_report(pool, colocated=False)[1] == 503
    both = WorkerPool()
    for wid in ("c0", "c1"):
        both.add(WorkerEndpoint(wid, Role.BOTH, f"http://{wid}"))
    both.mark_dead("c1", "test")
    body, status = health_report(both, colocated=True)
    assert (status, body["status"], body["capacity"]) == (200, "degraded", {"both": {"up": 1, "expected": 2}}), body


def test_a_stopped_decode_worker_makes_health_degraded_over_http():
    config = local_config(topology__num_decode=2)
    with LocalDeployment(config) as dep:
        assert requests.get(f"{dep.url}/health", timeout=10).json()["status"] == "ok"
        dep.run(dep.workers["decode-1"].stop())
        deadline = time.monotonic() + 30
        while True:
            resp = requests.get(f"{dep.url}/health", timeout=10)
            body = resp.json()
            if body["status"] != "ok" or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert resp.status_code == 200 and body["status"] == "degraded", body
        assert body["short_roles"] == ["decode"] and body["capacity"]["decode"] == {"up": 1, "expected": 2}, body
        served = requests.post(f"{dep.url}/v1/completions", timeout=30,
                               json={"prompt": "still serving", "max_tokens": 4, "temperature": 0})
        assert served.status_code == 200, served.text
        dep.workers.pop("decode-1")  # stopped already: the context exit must not stop it twice
        dep.wait_all_free()
