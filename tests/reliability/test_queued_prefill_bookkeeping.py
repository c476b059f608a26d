"""The router's queued prefill tokens (`WorkerLoad.num_queued_tokens`, what `prefix_aware` weighs
against a predicted hit) on real 2P2D workers over HTTP: a request's prompt tokens count on a worker
from dispatch until that worker has computed the prompt, then leave, once; client aborts, failed
prefills and failed decodes leave nothing behind (the count, the in-flight count and the leases
all return to 0)."""
from __future__ import annotations

import threading
import time

import requests

from kv_route_deploy import KVDeployment
from rel_deploy import local_config

SYSTEM = "You are the support assistant of a small shop; answer in one line. " * 3
TIMEOUT_S = 60.0


def _stream(url: str, prompt: str, max_tokens: int, abort: bool) -> str:
    """One streamed completion; with `abort` the client goes away after the first chunk. How it ended:
    "aborted", "error" (an error event in the stream, or a status other than 200) or "ok"."""
    with requests.post(f"{url}/v1/completions", stream=True, timeout=TIMEOUT_S,
                       json={"model": "pdkv-tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                             "ignore_eos": True}) as r:
        if r.status_code != 200:
            return "error"
        for line in r.iter_lines():
            if abort and line.startswith(b"data:"):
                return "aborted"
            if line.startswith(b"data:") and b'"error"' in line:
                return "error"
        return "ok"


def _settled(dep: KVDeployment) -> dict:
    pool = dep.router.pool
    return {"queued": {w.endpoint.worker_id: w.num_queued_tokens for w in pool.all()},
            "in_flight": {w.endpoint.worker_id: w.num_in_flight for w in pool.all()}, "leases": pool.num_leases()}


def _wait_zero(dep: KVDeployment) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        s = _settled(dep)
        if not any(s["queued"].values()) and not any(s["in_flight"].values()) and s["leases"] == 0:
            return
        assert time.monotonic() < deadline, f"the router's bookkeeping did not return to 0: {s}"
        time.sleep(0.05)


def test_queued_prefill_tokens_return_to_zero_after_sends_aborts_and_failures():
    # each P fails its 3rd and 4th engine steps' requests; each D stalls 1.5 s after its 2nd token once
    config = local_config(faults={"prefill": "engine.step:kill:after=2:times=2",
                                  "decode": "worker.decode_token:delay:1.5:after=2:times=1"})
    with KVDeployment(config, num_prefill=2, num_decode=2) as dep:
        statuses: list[str] = []
        seen_decoding: list[dict] = []

        def client(i: int) -> None:
            prompt = SYSTEM + f"\nuser {i}: where is my order number {i * 7919}?\nassistant:"
            statuses.append(_stream(dep.url, prompt, 12, abort=i % 3 == 1))

        def watch() -> None:  # a D that is decoding (in flight) has no prompt tokens left queued
            deadline = time.monotonic() + TIMEOUT_S
            while time.monotonic() < deadline and not seen_decoding:
                for w in dep.router.pool.all():
                    if w.endpoint.role.value == "decode" and w.num_in_flight and not w.num_queued_tokens:
                        seen_decoding.append({"worker": w.endpoint.worker_id, "in_flight": w.num_in_flight})
                time.sleep(0.01)

        watcher = threading.Thread(target=watch)
        watcher.start()
        for wave in range(3):
            threads = [threading.Thread(target=client, args=(wave * 6 + i,)) for i in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(TIMEOUT_S)
        watcher.join(TIMEOUT_S)
        assert len(statuses) == 18
        assert statuses.count("aborted") == 6 and statuses.count("error") >= 2, statuses  # P failed some prefills
        assert statuses.count("ok") >= 6, statuses
        assert dep.counter("pdkv_route_decisions_total") > 0
        assert seen_decoding, "no D was seen decoding with its prompt tokens taken off"
        _wait_zero(dep)
        dep.wait_exact()
        dep.wait_all_free()
