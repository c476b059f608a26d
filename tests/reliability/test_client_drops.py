"""Clients that leave at random moments after sending, against the real router and real
1P1D workers (in-process, real HTTP and ZMQ): P's lease for each request must end at
once (`aborted` or `done`), never by expiry, and the pools end all free.

The dangerous window is between P's answer and the call to D: P has marked the prefill
finished (so closing its stream aborts nothing) and D has not heard of the request.
"""
from __future__ import annotations

import json
import random
import socket
import threading
import time
from urllib.parse import urlsplit

import requests

from rel_deploy import LocalDeployment, local_config

NUM_CLIENTS = 80
LEASE_S = 3.0  # short, so a leaked lease shows up as `expired` within the test


def drop_after(url: str, body: dict, delay_s: float) -> None:
    """Sends a completion request on a raw socket and closes it `delay_s` later, unread."""
    parts = urlsplit(url)
    data = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {parts.hostname}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=5) as sock:
        sock.sendall(head + data)
        time.sleep(delay_s)


def test_dropped_clients_leave_no_lease_to_expire(fault_record):
    rng = random.Random(13)
    config = local_config(transfer__lease_s=LEASE_S)
    with LocalDeployment(config) as dep:
        # Where the window lies on this box: one request's prefill hop and whole run.
        t0 = time.monotonic()
        ok = requests.post(f"{dep.url}/v1/completions", timeout=30,
                           json={"prompt": "warm up " * 8, "max_tokens": 8, "temperature": 0})
        assert ok.status_code == 200
        one_request_s = time.monotonic() - t0
        jobs = []
        for i in range(NUM_CLIENTS):
            body = {"prompt": f"client {i} " + "lorem ipsum dolor sit amet " * rng.randint(1, 6),
                    "max_tokens": rng.randint(4, 40), "temperature": 0, "ignore_eos": True,
                    "stream": bool(i % 2)}
            jobs.append((body, rng.uniform(0.0, 1.5 * one_request_s)))
        for start in range(0, NUM_CLIENTS, 8):  # 8 clients at a time, each dropping at its own moment
            threads = [threading.Thread(target=drop_after, args=(dep.url, body, delay))
                       for body, delay in jobs[start:start + 8]]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
        freed = dep.wait_all_free(timeout_s=LEASE_S + 15)
        time.sleep(0.5)  # any abort still on its way lands before the figures are read
        ended = dep.stats("prefill-0")["transfer"]["leases_ended"]
        after = requests.post(f"{dep.url}/v1/completions", timeout=30,
                              json={"prompt": "still serving", "max_tokens": 4, "temperature": 0})
        assert after.status_code == 200
        dep.wait_all_free()
    assert ended.get("expired", 0) == 0, ended
    assert set(ended) <= {"aborted", "done"}, ended
    fault_record(fault=f"{NUM_CLIENTS} clients dropped at random moments after sending", where="router -> P/D",
                 user_saw="(gone)", pdkv_did=f"router aborted P's lease; leases ended {ended}",
                 pools=f"all free ({freed:.1f}s, lease {LEASE_S}s)")
