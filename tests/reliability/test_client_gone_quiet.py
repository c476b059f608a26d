"""A client that goes away is not an error: with real 1P1D workers and router in this process
(real HTTP and ZMQ), streamed clients drop mid-stream; the workers abort the requests and free
their blocks, log it at INFO, and neither a worker, the router nor aiohttp logs an ERROR or a traceback for it
(before the fix, aiohttp logged `ClientConnectionResetError` tracebacks at ERROR for most such runs)."""
from __future__ import annotations

import logging
import random
import threading

import requests

from rel_deploy import LocalDeployment, local_config
from test_client_drops import drop_after

NUM_CLIENTS = 32


def test_dropped_streams_are_aborted_and_logged_without_error(caplog):
    rng = random.Random(29)
    caplog.set_level(logging.INFO)
    with LocalDeployment(local_config()) as dep:
        ok = requests.post(f"{dep.url}/v1/completions", timeout=30,
                           json={"prompt": "warm up " * 8, "max_tokens": 4, "temperature": 0})
        assert ok.status_code == 200
        bodies = [{"prompt": f"client {i} " + "lorem ipsum " * rng.randint(1, 6), "max_tokens": 120,
                   "temperature": 0, "ignore_eos": True, "stream": True} for i in range(NUM_CLIENTS)]
        for start in range(0, NUM_CLIENTS, 8):
            # one in four leaves at once, often before the router's own stream has begun
            threads = [threading.Thread(target=drop_after, args=(dep.url, body, rng.choice((0.0, 0.05, 0.2, 0.4))))
                       for body in bodies[start:start + 8]]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
        dep.wait_all_free(timeout_s=20)  # every dropped request was aborted and its blocks freed
        num_aborted = sum(dep.stats(wid)["num_aborted"] for wid in dep.workers)
    worker_logs = [r for r in caplog.records
                   if r.name.startswith(("pd.worker", "pd.router")) or r.name == "aiohttp.server"]
    gone = [r for r in worker_logs if r.name == "pd.worker.http_api" and "router went away" in r.getMessage()]
    assert num_aborted >= 1 and gone and all(r.levelno == logging.INFO and not r.exc_info for r in gone)
    loud = [(r.name, r.getMessage()) for r in worker_logs if r.levelno >= logging.ERROR or r.exc_info]
    assert not loud, loud[:5]
