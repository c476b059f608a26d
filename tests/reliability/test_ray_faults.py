"""Worker processes killed at named points of the request lifecycle, end to end
through real Ray actors and real HTTP (one Ray instance for the module).

The kill comes from the worker's own fault plan (`faults.<role>` in the deploy
config, see pd.worker.faults): the process ends with os._exit, as in a crash.
Each test asserts what the client sees (a clear error within a bounded time,
or a correct answer) and that every surviving pool ends all free.
"""
from __future__ import annotations

import json
import time

import requests

from tests.helpers.e2e import e2e_config, wait_all_free, worker_reports

from pd.deploy.launch import Deployment

PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps."
BOUND_S = 40.0  # every failure must reach the client well within this


def post(url: str, **body) -> tuple[requests.Response, float]:
    t0 = time.monotonic()
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **body}
    resp = requests.post(f"{url}/v1/completions", json=body, timeout=BOUND_S)
    return resp, time.monotonic() - t0


def test_prefill_worker_killed_after_prefill_before_answering(ray_instance, fault_record):
    config = e2e_config(faults={"prefill": "worker.prefill_done:kill"}, router__report_route=True)
    with Deployment(config) as dep:
        resp, seconds = post(dep.url, return_token_ids=True)
        assert resp.status_code == 200, resp.text  # degrade, don't refuse: D prefilled it itself
        route = resp.json()["choices"][0]["pdkv_route"]
        assert route["decision"] == "local" and route["reason"] == "no_prefill" and route["prefill_worker"] is None
        assert seconds < BOUND_S
        again, _ = post(dep.url, return_token_ids=True)  # the dead worker left the rotation: straight to D
        assert again.status_code == 200 and again.json()["choices"][0]["pdkv_route"]["reason"] == "no_prefill"
        assert again.json()["choices"][0]["token_ids"] == resp.json()["choices"][0]["token_ids"]
        assert worker_reports(dep.url)["prefill-0"]["healthy"] is False
        assert requests.get(f"{dep.url}/health", timeout=10).json()["status"] == "degraded"
        wait_all_free(dep.url)
    fault_record(fault="P process killed after prefill, before answering", where="P worker (Ray actor)",
                 user_saw=f"HTTP 200 in {seconds:.1f}s (prefilled on D); then 200 at once, /health degraded",
                 pdkv_did="router probed P, took it out of rotation, prefilled on D", pools="all free (surviving D)")


def test_decode_worker_killed_mid_transfer(ray_instance, fault_record):
    # D pulls through its own FaultLink; the PULL frame kills D's process mid-transfer.
    config = e2e_config(faults={"decode": "data.pull:kill"}, topology__num_decode=1)
    with Deployment(config) as dep:
        resp, seconds = post(dep.url)
        assert resp.status_code in (502, 503), resp.text
        assert "decode" in resp.json()["error"]["message"]
        assert seconds < BOUND_S
        # D produced nothing: the router aborts P's lease at once (else it would expire after lease_s)
        t0 = time.monotonic()
        wait_all_free(dep.url, timeout_s=config.transfer.lease_s + 15)
        freed = time.monotonic() - t0
        assert worker_reports(dep.url)["prefill-0"]["stats"]["transfer"]["leases_expired"] == 0
        assert worker_reports(dep.url)["decode-0"]["healthy"] is False
    fault_record(fault="D process killed mid-transfer (on its PULL)", where="D worker (Ray actor)",
                 user_saw=f"HTTP {resp.status_code} naming the decode worker in {seconds:.1f}s",
                 pdkv_did="router aborted P's lease (none expired)", pools=f"P all free ({freed:.1f}s, lease 5s)")


def test_decode_worker_killed_mid_stream(ray_instance, fault_record):
    config = e2e_config(faults={"decode": "worker.decode_token:kill:after=3"})
    with Deployment(config) as dep:
        t0 = time.monotonic()
        events = []
        with requests.post(f"{dep.url}/v1/completions", stream=True, timeout=BOUND_S,
                           json={"prompt": PROMPT, "max_tokens": 50, "temperature": 0, "stream": True,
                                 "ignore_eos": True}) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith(b"data: "):
                    events.append("[DONE]" if line == b"data: [DONE]" else json.loads(line[6:]))
        seconds = time.monotonic() - t0
        assert events[-1] == "[DONE]"
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and "decode" in errors[0]["error"]["message"]  # never a silent truncation
        num_tokens = sum(1 for e in events if isinstance(e, dict) and e.get("choices"))
        assert 1 <= num_tokens < 50
        wait_all_free(dep.url)  # P's lease ended by D's DONE before the kill
    fault_record(fault="D process killed mid decode stream (after 3 tokens)", where="D worker (Ray actor)",
                 user_saw=f"{num_tokens} tokens, then an SSE error event and [DONE] in {seconds:.1f}s",
                 pdkv_did="router turned the broken stream into an error (no silent truncation)",
                 pools="all free (surviving P)")
