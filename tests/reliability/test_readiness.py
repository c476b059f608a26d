"""The router serves only once a worker of each needed role has answered a health probe.

Real workers and the real router in this process over loopback HTTP: the decode worker runs,
the prefill worker's address has nothing listening yet. `/health` is 503 `starting` and names
the prefill worker and why; `wait_ready` gives up naming it too. Once a real prefill worker
listens there, the router is ready, serves a P/D request, and both pools end all free.
"""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import requests

from pd.cluster.roles import Role, WorkerEndpoint
from pd.router.readiness import NotReady
from pd.router.server import Router
from pd.worker.worker import Worker, WorkerSpec
from rel_deploy import SECRET, local_config

HTTP_TIMEOUT_S = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Loop:
    """A private event loop on its own thread (the router and the workers run on it)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="readiness-test", daemon=True)
        self._thread.start()

    def run(self, coro, timeout_s: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def _health(url: str) -> tuple[int, dict, requests.structures.CaseInsensitiveDict]:
    resp = requests.get(f"{url}/health", timeout=HTTP_TIMEOUT_S)
    return resp.status_code, resp.json(), resp.headers


def test_starting_until_each_role_answered_then_serving():
    config = local_config()
    loop = _Loop()
    prefill_port = _free_port()  # nothing listens here until the prefill worker starts below
    prefill_url = f"http://127.0.0.1:{prefill_port}"
    decode = Worker(WorkerSpec("decode-0", Role.DECODE, config, SECRET))
    prefill = Worker(WorkerSpec("prefill-0", Role.PREFILL, config, SECRET))
    workers = [decode]
    router = None
    try:
        endpoints = [WorkerEndpoint("prefill-0", Role.PREFILL, prefill_url),
                     WorkerEndpoint("decode-0", Role.DECODE, loop.run(decode.start()))]
        router = Router(config, endpoints, SECRET)
        url = loop.run(router.start())

        status, body, headers = _health(url)
        assert status == 503 and body["status"] == "starting", body
        assert body["missing_roles"] == ["prefill"] and headers["Retry-After"] == "1"
        assert "no prefill worker has answered a health probe yet" in body["reason"], body
        assert f"prefill-0 at {prefill_url}" in body["reason"] and "decode-0" not in body["reason"], body
        with pytest.raises(NotReady, match="prefill-0"):
            loop.run(router.wait_ready(1.0))

        workers.append(prefill)
        assert loop.run(prefill.start(prefill_port)) == prefill_url
        t0 = time.monotonic()
        loop.run(router.wait_ready(30.0))  # the health loop's probes reach it now
        ready_s = time.monotonic() - t0
        status, body, _ = _health(url)
        assert status == 200 and body["status"] in ("ok", "degraded"), body  # degraded: P not re-admitted yet

        deadline = time.monotonic() + HTTP_TIMEOUT_S
        while _health(url)[1]["status"] != "ok":  # P back in the rotation after its good probes
            assert time.monotonic() < deadline, _health(url)
            time.sleep(0.1)
        resp = requests.post(f"{url}/v1/completions", timeout=HTTP_TIMEOUT_S,
                             json={"prompt": "ready at last", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 4
        assert ready_s < 10.0, ready_s  # probes of a worker out of the rotation are paced at readmit_interval_s

        deadline = time.monotonic() + HTTP_TIMEOUT_S
        while True:
            audits = {w.spec.worker_id: w.stats(audit=True)["audit"] for w in workers}
            if all(a["all_free"] and a["consistent"] for a in audits.values()):
                break
            assert time.monotonic() < deadline, audits
            time.sleep(0.05)
    finally:
        if router is not None:
            loop.run(router.stop())
        for worker in workers:
            loop.run(worker.stop())
        loop.close()
