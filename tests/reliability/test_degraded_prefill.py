"""Degrade, don't refuse (issue 23, finding 8), on real Ray actors over real HTTP and ZMQ (1P1D):
- the only prefill worker frozen (SIGSTOP) for about 6 s while 12 requests arrive: every one
  gets 200 with the tokens of an undisturbed run (its decode worker prefills it), `/health`
  says `degraded` meanwhile, and once the worker resumes (SIGCONT) it is back in the rotation
  within `num_readmit_probes` probes of `readmit_interval_s` plus the probe in flight;
- the prefill worker's process killed for good (`ray.kill`, no restart): requests are still
  served by the decode worker, `/health` is `degraded`; the decode worker killed too:
  `/health` is 503 `unavailable` and so are requests.
Both in the default mode (`always_disaggregate`) and in `planner` mode. Pools of the
surviving workers end all free.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import requests

from tests.helpers.e2e import e2e_config, kill_actor, wait_all_free
from test_ray_recovery import worker_pid

from pd.deploy.launch import Deployment
from pd.router.recovery import health_report
from pd.router.choice import Role, WorkerEndpoint, WorkerPool
from pd.router.worker_client import ClientTimeouts

PROMPTS = [f"Request {i}: the fox and the dog walk to the river, and then part {i} begins." for i in range(12)]
BODY = {"max_tokens": 10, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
NUM_READMIT_PROBES = 3
READMIT_INTERVAL_S = 0.25
STALL_S = 6.0
WAIT_S = 60.0  # bound of every wait-for-state loop (a loaded machine is slow, never this slow)


def _config(mode: str):
    # health_interval_s is the default (2 s): re-admission faster than that is the probes' pace,
    # not the poll's; a call waits on a frozen worker at most first_byte_timeout_s
    return e2e_config(router__health_interval_s=2.0, router__first_byte_timeout_s=2.0,
                      router__num_readmit_probes=NUM_READMIT_PROBES, router__readmit_interval_s=READMIT_INTERVAL_S,
                      router__planner={"mode": mode, "seed": 0}, router__report_route=True)


def _complete(url: str, prompt: str) -> requests.Response:
    return requests.post(f"{url}/v1/completions", json=dict(BODY, prompt=prompt), timeout=WAIT_S)


def _tokens(resp: requests.Response) -> list[int]:
    return resp.json()["choices"][0]["token_ids"]


def _health(url: str) -> tuple[int, dict]:
    resp = requests.get(f"{url}/health", timeout=WAIT_S)
    return resp.status_code, resp.json()


def _wait_health(url: str, status: str) -> dict:
    deadline = time.monotonic() + WAIT_S
    while True:
        code, body = _health(url)
        if body["status"] == status:
            return body
        assert time.monotonic() < deadline, f"/health never said {status}: {code} {body}"
        time.sleep(0.05)


def test_health_report_rule():
    pool = WorkerPool()
    pool.add(WorkerEndpoint("p0", Role.PREFILL, "http://p0"))
    pool.add(WorkerEndpoint("d0", Role.DECODE, "http://d0"))
    body, status = health_report(pool, colocated=False)
    assert (status, body["status"], body["missing_roles"]) == (200, "ok", [])
    pool.mark_dead("p0", "test")
    body, status = health_report(pool, colocated=False)
    assert (status, body["status"], body["missing_roles"]) == (200, "degraded", ["prefill"])
    assert "prefill locally" in body["reason"] and body["workers"] == {"p0": False, "d0": True}
    pool.mark_dead("d0", "test")
    body, status = health_report(pool, colocated=False)
    assert (status, body["status"], body["missing_roles"]) == (503, "unavailable", ["prefill", "decode"])
    both = WorkerPool()
    both.add(WorkerEndpoint("c0", Role.BOTH, "http://c0"))
    assert health_report(both, colocated=True)[0]["status"] == "ok"
    both.mark_dead("c0", "test")
    assert health_report(both, colocated=True)[1] == 503


@pytest.mark.parametrize("mode", ["always_disaggregate", "planner"])
def test_sole_prefill_worker_stalled_then_killed(ray_instance, mode, fault_record):
    config = _config(mode)
    with Deployment(config) as dep:
        want = {p: _tokens(r) for p in PROMPTS if (r := _complete(dep.url, p)).status_code == 200}
        assert len(want) == len(PROMPTS)  # the undisturbed run, greedy
        code, body = _health(dep.url)
        assert code == 200 and body["status"] == "ok", body
        p_pid = worker_pid(dep, "prefill-0")
        actors = {w.endpoint.worker_id: w.actor for w in dep.workers}

        # 1. the only P frozen while 12 requests arrive, one every half second
        results: dict[str, requests.Response | BaseException] = {}

        def call(prompt: str) -> None:
            try:
                results[prompt] = _complete(dep.url, prompt)
            except BaseException as exc:  # noqa: BLE001 - reported below
                results[prompt] = exc

        os.kill(p_pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        try:
            threads = []
            for prompt in PROMPTS:
                threads.append(threading.Thread(target=call, args=(prompt,), daemon=True))
                threads[-1].start()
                time.sleep(STALL_S / len(PROMPTS))
            degraded = _wait_health(dep.url, "degraded")  # P out of the rotation, D serving
            while time.monotonic() - t_stop < STALL_S:
                time.sleep(0.05)
        finally:
            t_cont = time.monotonic()
            os.kill(p_pid, signal.SIGCONT)
        assert degraded["missing_roles"] == ["prefill"] and degraded["workers"]["prefill-0"] is False
        # 2. back in the rotation: the first good probe is the one in flight (answered at once,
        # else it times out) or the next; then one every readmit_interval_s
        load = dep.router.pool.get("prefill-0")
        while not load.healthy:
            assert time.monotonic() - t_cont < WAIT_S, "prefill-0 never re-admitted"
            time.sleep(0.01)
        back_s = time.monotonic() - t_cont
        # (+2 s for the probes' round trips on a loaded machine, with an actor catching up on its
        # backlog: still below the 3 x 2 s that re-admission at the poll's pace would take)
        bound_s = NUM_READMIT_PROBES * READMIT_INTERVAL_S + ClientTimeouts().probe_s + 2.0
        assert back_s <= bound_s, (back_s, bound_s)
        for t in threads:
            t.join(WAIT_S)
        stalled_s = t_cont - t_stop
        for prompt in PROMPTS:
            got = results[prompt]
            assert isinstance(got, requests.Response), got
            assert got.status_code == 200, got.text
            assert _tokens(got) == want[prompt]
            route = got.json()["choices"][0]["pdkv_route"]  # prefilled by D: P could answer none of them
            assert route["decision"] == "local" and route["prefill_worker"] is None, route
            assert route["reason"] == "no_prefill" or mode == "planner", route  # the planner may pick local itself
        num_stall_ok = sum(1 for r in results.values() if isinstance(r, requests.Response) and r.status_code == 200)
        assert _wait_health(dep.url, "ok")["missing_roles"] == []
        wait_all_free(dep.url)

        # 3. P's process killed, for good (no restart by Ray): D still serves, /health degraded
        kill_actor(actors["prefill-0"])
        for prompt in PROMPTS[:4]:
            got = _complete(dep.url, prompt)
            assert got.status_code == 200 and _tokens(got) == want[prompt], got.text
        code, body = _health(dep.url)
        if body["status"] != "degraded":  # the kill is noticed by the health loop at the latest
            body = _wait_health(dep.url, "degraded")
        assert body["missing_roles"] == ["prefill"] and _health(dep.url)[0] == 200
        for prompt in PROMPTS[4:8]:  # P known dead: straight to D
            got = _complete(dep.url, prompt)
            assert got.status_code == 200 and _tokens(got) == want[prompt], got.text
            assert got.json()["choices"][0]["pdkv_route"]["reason"] == "no_prefill"
        wait_all_free(dep.url)  # the surviving D

        # 4. D killed too: nothing can serve
        kill_actor(actors["decode-0"])
        unavailable = _wait_health(dep.url, "unavailable")
        assert _health(dep.url)[0] == 503 and unavailable["missing_roles"] == ["prefill", "decode"]
        got = _complete(dep.url, PROMPTS[0])
        assert got.status_code == 503 and got.json()["error"]["code"] == "no_worker_available", got.text
    fault_record(fault=f"sole P frozen (SIGSTOP) {stalled_s:.1f}s during 12 requests, then killed ({mode})",
                 where="P worker (Ray actor)",
                 user_saw=f"{num_stall_ok}/{len(PROMPTS)} token-identical 200s during the stall, 8/8 with P dead; "
                          "/health degraded (200) meanwhile; 503 unavailable only with D gone too",
                 pdkv_did=f"D prefilled locally; P re-admitted {back_s:.2f}s after SIGCONT "
                          f"({NUM_READMIT_PROBES} probes every {READMIT_INTERVAL_S}s)",
                 pools="all free (surviving workers)")
