"""No request takes a worker down, and a worker that goes down comes back (real Ray actors,
real router, HTTP and ZMQ; issue 23 finding 1, issue 25 finding 3):
- sampling values at the edge of the accepted ranges (the issue's `temperature: 1e-300`,
  `top_p: 1e-320`, ...) are served with tokens, and the workers stay healthy;
- a step that raises (fault point `engine.step`) fails only its request, with a clear error;
  the others get the tokens of an undisturbed run, and the worker stays in the rotation;
- an engine loop that dies anyway (fault point `engine.loop`) fails its request, the worker
  reports itself unhealthy and leaves the rotation, Ray restarts its actor, and the router
  re-admits it at its new address, while the other decode worker serves;
- a device fault (fault point `engine.device_oom`: what torch raises for CUDA out of memory) fails
  only the request of its step, with a 503 and Retry-After; the worker reports itself unhealthy, Ray
  restarts its process, the router re-admits it, and the requests queued behind it are served elsewhere;
- a SIGKILLed worker is serving again, its KV index EXACT, and no request fails meanwhile (about
  12 s on an idle 2-core machine, the issue asks for 30 s; the bound asserted here is looser,
  since how fast a process imports torch and builds an engine is the machine's business).
Each test ends with every pool all free.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import requests

from tests.helpers.e2e import complete, e2e_config, stream_events, wait_all_free

from pd.deploy.launch import Deployment
from pd.router.openai_api import MAX_NEW_TOKENS

RESTART_BOUND_S = 120.0  # kill -> serving again (Ray's restart, imports, engine build, re-admission)
DEVICE_FAULT_RESTART_S = 30.0  # a device fault -> re-admitted (the bound; about 5 s on an idle 2-core machine)
# restarted workers skip the fused C++ kernels: a build of them elsewhere on the machine (a source
# change) would hold their start for minutes, and they are not what these tests are about
TORCH_ONLY = {"model__attention_backend": "torch"}
BODY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
POISONED = [  # each passes validation; the first two are the issue's
    {"temperature": 1e-300}, {"top_p": 1e-320}, {"temperature": 1e-320, "top_p": 5e-324},
    {"temperature": 2.0, "top_p": 1e-320, "seed": -(1 << 63)},
    {"temperature": 1e-5, "top_k": MAX_NEW_TOKENS, "seed": (1 << 63) - 1},
    {"temperature": 0.0, "top_p": 5e-324, "top_k": 1},
]


def post(url: str, prompt: str, **body) -> requests.Response:
    return requests.post(f"{url}/v1/completions", json={"prompt": prompt, **BODY, **body}, timeout=120)


def workers(url: str) -> dict:
    """The router's view (no refresh: it reads what the health loop saw)."""
    resp = requests.get(f"{url}/pd/workers", timeout=30)
    resp.raise_for_status()
    return resp.json()


def worker_health(dep: Deployment, url: str) -> requests.Response:
    return requests.get(f"{url}/internal/health", headers={"Authorization": f"Bearer {dep.secret}"}, timeout=10)


def _answers_ok(dep: Deployment, url: str) -> bool:
    try:
        resp = worker_health(dep, url)
    except requests.ConnectionError:
        return False
    assert resp.status_code in (200, 503), resp.text
    return resp.status_code == 200


def wait_for(what: str, check, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f}s: {what}"
        time.sleep(0.1)


def test_poisoned_sampling_values_are_served(ray_instance, fault_record):
    with Deployment(e2e_config()) as dep:
        for fields in POISONED:
            resp = requests.post(f"{dep.url}/v1/completions", json={"prompt": "hello world", "max_tokens": 4, **fields},
                                 timeout=120)
            assert resp.status_code == 200, (fields, resp.text)
            assert 1 <= resp.json()["usage"]["completion_tokens"] <= 4
            events = stream_events(dep.url, "hello world", max_tokens=4, **fields)
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), (fields, events)
            assert any(c.get("token_ids") for e in events[:-1] for c in e.get("choices", [])), events
        for prompt in ("later requests", "are still served"):
            assert len(complete(dep.url, prompt)["choices"][0]["token_ids"]) == 12
        reports = wait_all_free(dep.url)
        assert all(r["healthy"] for r in reports.values()), reports
    fault_record(fault=f"{len(POISONED)} poisoned sampling values (temperature 1e-300, top_p 1e-320, ...)",
                 where="client -> P and D engines", user_saw=f"{2 * len(POISONED)}/{2 * len(POISONED)} answered 200 "
                 "with tokens (single and stream)", pdkv_did="greedy below temperature 1e-5; top_p keeps the top "
                 "token; finite check before the draw", pools="all free, every worker healthy")


def test_failing_step_fails_only_its_request(ray_instance, fault_record):
    # P's 3rd request and D's 2nd raise inside their engine step
    config = e2e_config(faults__prefill="engine.step:kill:after=2", faults__decode="engine.step:kill:after=1")
    prompts = [f"Request {i} tells of a fox and a dog, part {i}." for i in range(6)]
    with Deployment(config) as dep:
        results: list = [None] * len(prompts)

        def call(i: int) -> None:
            results[i] = post(dep.url, prompts[i])

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        failed = [r for r in results if r.status_code != 200]
        assert len(failed) == 2, [(r.status_code, r.text[:200]) for r in results]
        for r in failed:  # a clear error to that caller alone
            assert r.status_code == 500 and "engine.step failed" in r.json()["error"]["message"], r.text
        again = [post(dep.url, p) for p in prompts]  # the faults fired once: everything is served now
        assert all(r.status_code == 200 for r in again), [r.text for r in again]
        for first, second in zip(results, again, strict=True):
            if first.status_code == 200:  # the others were not disturbed
                assert first.json()["choices"][0]["token_ids"] == second.json()["choices"][0]["token_ids"]
        reports = wait_all_free(dep.url)
        assert all(r["healthy"] for r in reports.values()), reports
        num_errors = {wid: r["stats"].get("num_errors") for wid, r in reports.items()}
        assert num_errors == {"prefill-0": 1, "decode-0": 1}, num_errors
    fault_record(fault="an exception inside one engine step (P's 3rd request, D's 2nd), 6 concurrent requests",
                 where="P and D engine step", user_saw="those 2 got 500 'engine step failed for this request'; "
                 "4/4 others correct", pdkv_did="re-ran the step's chunks one by one, failed only the culprits, "
                 "evicted their unwritten blocks; workers stayed in the rotation", pools="all free")


def test_dead_engine_loop_restarts_the_worker(ray_instance, fault_record):
    # each D's engine loop dies at its 6th request (a fresh incarnation counts from 0 again)
    config = e2e_config(topology__num_decode=2, faults__decode="engine.loop:kill:after=5", **TORCH_ONLY)
    sticky = "A long system prompt that the prefix-aware router keeps on the decode worker caching it. " * 2
    with Deployment(config) as dep:
        before = workers(dep.url)
        pids = {wid: worker_health(dep, w["url"]).json()["pid"] for wid, w in before.items()}
        culprit = None
        for _ in range(12):  # the same prompt sticks to one D (its prefix hit) until that D's loop dies
            resp = post(dep.url, sticky)
            if resp.status_code != 200:
                culprit = resp
                break
        assert culprit is not None, "the fault never fired"
        assert culprit.status_code == 500 and "engine.loop failed" in culprit.json()["error"]["message"], culprit.text
        t0 = time.monotonic()
        down = {wid for wid, w in before.items() if wid.startswith("decode-") and not _answers_ok(dep, w["url"])}
        assert len(down) == 1, down  # it says so at once: 503 (or gone already, its process ended)
        victim = wait_for("the router took the dead worker out",
                          lambda: next((wid for wid, w in workers(dep.url).items() if not w["healthy"]), None), 30)
        assert victim in down
        meanwhile = [post(dep.url, f"Served meanwhile, number {i}.") for i in range(2)]
        assert all(r.status_code == 200 for r in meanwhile), [r.text for r in meanwhile]
        back = wait_for("the restarted worker re-admitted", lambda: (w := workers(dep.url)[victim])["healthy"]
                        and w["url"] != before[victim]["url"] and w, RESTART_BOUND_S)
        back_s = time.monotonic() - t0
        assert worker_health(dep, back["url"]).json()["pid"] != pids[victim]
        for i in range(3):  # prompts sharing no block: ties between the two D, rotated, so one lands on it
            assert post(dep.url, f"{i} after the restart, a prompt of its own.").status_code == 200
            reports = wait_all_free(dep.url)
            if reports[victim]["stats"]["num_steps"] > 0:
                break
        assert all(r["healthy"] for r in reports.values()), reports
        assert reports[victim]["stats"]["num_steps"] > 0, reports[victim]["stats"]  # it serves again
    fault_record(fault="D's engine step loop dies (1P2D)", where="D engine loop thread",
                 user_saw="the request in flight got 500 'engine stopped'; 2/2 sent meanwhile and every one "
                 "after were served", pdkv_did="worker answered 503 on health, router took it out, the process "
                 f"exited, Ray restarted the actor and the router re-admitted it at its new URL ({back_s:.1f}s)",
                 pools="all free, every worker healthy")


def test_device_fault_costs_its_step_and_one_restart(ray_instance, fault_record):
    # one request per step (max_num_seqs 1): the step that runs a D's 7th request runs out of device memory.
    # The other D takes at most 3 queued requests + 3 later ones: it never reaches its 7th.
    config = e2e_config(topology__num_decode=2, scheduler__max_num_seqs=1,
                        faults__decode="engine.device_oom:kill:after=6", **TORCH_ONLY)
    sticky = "A long system prompt that the prefix-aware router keeps on the decode worker caching it. " * 2
    with Deployment(config) as dep:
        before = workers(dep.url)
        pids = {wid: worker_health(dep, w["url"]).json()["pid"] for wid, w in before.items()}
        assert post(dep.url, sticky).status_code == 200
        # The router learns a D's cache from its KV events, a moment after the answer: until the prompt's
        # blocks are indexed on the D that took it, the next copy could go to the other D by load alone.
        wait_for("the sticky prompt indexed on one D", lambda: _indexed_decodes(dep.url, before) == 1, 30)
        for _ in range(5):  # the same prompt sticks to that D: it has taken 6 requests
            assert post(dep.url, sticky).status_code == 200
        assert _indexed_decodes(dep.url, before) == 1, workers(dep.url)
        results: list = [None] * 4

        def call(i: int) -> None:  # queued behind each other on a D: one step at a time
            results[i] = post(dep.url, f"{sticky} Question {i}?", max_tokens=24)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(results))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        t0 = time.monotonic()
        failed = [r for r in results if r.status_code != 200]
        assert len(failed) == 1, [(r.status_code, r.text[:300]) for r in results]  # the step's one request
        assert failed[0].status_code == 503 and failed[0].headers.get("Retry-After") == "1", failed[0].text
        assert failed[0].json()["error"]["code"] == "worker_device_fault", failed[0].text
        assert "OutOfMemoryError" in failed[0].json()["error"]["message"]
        restarts = dep.restarts.num_restarts
        wait_for("the faulted worker restarted and re-admitted", lambda: sum(restarts.values()) >= 1
                 and all(w["healthy"] for w in workers(dep.url).values()), DEVICE_FAULT_RESTART_S)
        back_s = time.monotonic() - t0
        assert sum(restarts.values()) == 1 and restarts["prefill-0"] == 0, restarts
        [victim] = [wid for wid, n in restarts.items() if n]
        assert worker_health(dep, workers(dep.url)[victim]["url"]).json()["pid"] != pids[victim]
        for i in range(3):  # served again, the restarted worker included
            assert post(dep.url, f"{i} after the restart, a prompt of its own.").status_code == 200
        reports = wait_all_free(dep.url)
        assert all(r["healthy"] for r in reports.values()), reports
    fault_record(fault="CUDA out of memory in a decode step (fault plan engine.device_oom), 1P2D, 4 requests "
                 "queued on that D", where="D engine step", user_saw="that step's 1 request: 503 "
                 "worker_device_fault, Retry-After: 1; 3/3 queued behind it answered 200 (served by the other D)",
                 pdkv_did=f"failed the step, freed its blocks, stopped the engine, worker unhealthy and its process "
                 f"exited; Ray restarted it and the router re-admitted it ({back_s:.1f}s)",
                 pools="all free, every worker healthy")


def _indexed_decodes(url: str, before: dict) -> int:
    """How many D workers the router's prefix index holds new entries for (since `before`)."""
    now = workers(url)
    return sum(1 for wid, w in now.items() if w["role"] == "decode"
               and w["kv_index"]["num_entries"] > before[wid]["kv_index"]["num_entries"])


def test_sigkilled_worker_serves_again_within_30s(ray_instance, fault_record):
    config = e2e_config(topology__num_decode=2, **TORCH_ONLY)
    with Deployment(config) as dep:
        before = workers(dep.url)
        victim = "decode-0"
        pid = worker_health(dep, before[victim]["url"]).json()["pid"]
        stop = threading.Event()
        outcomes: list[int] = []

        def traffic() -> None:  # a steady client: every request must succeed, before, during and after
            i = 0
            while not stop.is_set():
                # no shared first block: the prefix-aware router spreads them by load
                outcomes.append(post(dep.url, f"{i} steady traffic, one request of many.").status_code)
                i += 1

        client = threading.Thread(target=traffic, daemon=True)
        client.start()
        wait_for("traffic flowing", lambda: len(outcomes) >= 3, 60)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()

        last: list[dict] = []

        def serving_again():
            w = workers(dep.url)[victim]
            last[:] = [w]
            return (w["healthy"] and w["url"] != before[victim]["url"] and (w["kv_index"] or {}).get("state") == "exact"
                    and w["stats"].get("num_steps", 0) > 0 and w)

        try:
            wait_for(f"{victim} serving again, its index EXACT", serving_again, RESTART_BOUND_S)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last seen: {str(last)[:1500]}") from None
        finally:
            stop.set()
        back_s = time.monotonic() - t0
        stop.set()
        client.join(150)
        assert outcomes and all(code == 200 for code in outcomes), outcomes
        reports = wait_all_free(dep.url)
        assert all(r["healthy"] for r in reports.values()), reports
    fault_record(fault="D SIGKILLed under steady traffic (1P2D)", where="D worker (Ray actor)",
                 user_saw=f"{len(outcomes)}/{len(outcomes)} requests answered 200",
                 pdkv_did=f"Ray restarted the actor (max_restarts); the router re-admitted it at its new URL, "
                          f"index from a snapshot, serving again after {back_s:.1f}s", pools="all free")
