"""An unauthenticated client costs the router and the worker HTTP API a bounded number of
connections, each for a bounded time (issue 23, finding 2).

A real P/D deployment in this process (real workers, real router, loopback HTTP) with short
timeouts; junk clients on real sockets (`pd.tools.junk_connections`). Checked: idle and
header-trickling connections close within their timeouts (never before), a trickled body gets
408, past the caps the least recently used idle connections go first (per peer address and in
total) while a good request and a running stream pass, and pools end all free.
"""
from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests

from pd.cluster.http_guard import GuardLimits
from pd.tools.junk_connections import HTTP_TRICKLE, JunkHolder
from rel_deploy import LocalDeployment, local_config

TIMEOUTS = {"header_timeout_s": 2.0, "body_timeout_s": 2.0, "keepalive_timeout_s": 1.5}
SLACK_S = 15.0  # a loaded CI box: how late a close may come past its timeout + one guard tick + one client round


def _deployment(**connections) -> LocalDeployment:
    return LocalDeployment(local_config(router__connections=connections))


@pytest.fixture(scope="module")
def timed():
    with _deployment(**TIMEOUTS, worker_keepalive_timeout_s=20.0) as dep:
        yield dep


@pytest.fixture(scope="module")
def capped():
    with _deployment(header_timeout_s=120.0, keepalive_timeout_s=120.0, max_connections=120,
                     max_connections_per_peer=50) as dep:
        yield dep


def _good_completion(url: str, max_tokens: int = 4) -> dict:
    r = requests.post(f"{url}/v1/completions", json={"prompt": "hello world", "max_tokens": max_tokens,
                                                     "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.1)


def _holders(host: str, port: int, n: int, **kw) -> list[JunkHolder]:
    stop = threading.Event()
    holders = [JunkHolder(host, port, n, stop, payload=HTTP_TRICKLE, kinds=kind, reopen=False, **kw)
               for kind in ("idle", "trickle")]
    for h in holders:
        h.start()
    for h in holders:
        assert h.opened.wait(120)
    return holders


def _worker_port(dep: LocalDeployment, wid: str) -> int:
    return int(dep.workers[wid].url.rsplit(":", 1)[1])


@pytest.mark.parametrize("target", ["router", "prefill-0"])
def test_idle_and_header_trickling_connections_close_within_their_timeouts(timed, target, fault_record):
    limits = GuardLimits.from_section(timed.config.router.connections, worker=target != "router")
    port = int(timed.url.rsplit(":", 1)[1]) if target == "router" else _worker_port(timed, target)
    n = 250
    holders = _holders("127.0.0.1", port, n)
    idle, trickle = holders
    try:
        assert idle.num_open == n and trickle.num_open == n
        answers = [_good_completion(timed.url) for _ in range(3)]  # served while the junk is open
        assert all(a["choices"][0]["finish_reason"] == "length" for a in answers)
        longest = max(limits.keepalive_timeout_s, limits.header_timeout_s) + SLACK_S
        _wait(lambda: idle.num_closed_by_peer == n and trickle.num_closed_by_peer == n, longest + 10,
              f"all {2 * n} junk connections closed by the server")
    finally:
        for h in holders:
            h.stop.set()
            h.join(10)
    idle_s = [t for kind, t in idle.closed_after_s]
    trickle_s = [t for kind, t in trickle.closed_after_s]
    # never before the timeout; each within it plus one guard tick, one client round and the slack
    assert min(idle_s) >= limits.keepalive_timeout_s - 0.05, min(idle_s)
    assert max(idle_s) <= limits.keepalive_timeout_s + SLACK_S, max(idle_s)
    assert min(trickle_s) >= limits.header_timeout_s - 0.05, min(trickle_s)
    assert max(trickle_s) <= limits.header_timeout_s + SLACK_S, max(trickle_s)
    _good_completion(timed.url)
    timed.wait_all_free()
    fault_record(fault=f"{n} idle + {n} header-trickling connections", where=target,
                 user_saw="4/4 good requests served",
                 pdkv_did=f"closed idle after {min(idle_s):.1f}-{max(idle_s):.1f} s, "
                          f"trickling after {min(trickle_s):.1f}-{max(trickle_s):.1f} s", pools="all free")


def test_trickled_body_gets_408_and_its_connection_closes(timed):
    port = int(timed.url.rsplit(":", 1)[1])
    body = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: pdkv\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body[:3])
        t0 = time.monotonic()
        answer = b""
        while True:  # a byte every 0.5 s would outlast any deadline without one
            try:
                s.settimeout(0.5)
                chunk = s.recv(65536)
            except TimeoutError:
                if time.monotonic() - t0 > TIMEOUTS["body_timeout_s"] + SLACK_S:
                    raise AssertionError("no answer to a trickled body") from None
                if len(body) > 4:
                    s.send(b" ")  # whitespace inside the body: never completes it
                continue
            except ConnectionResetError:
                break
            if not chunk:
                break
            answer += chunk
        elapsed = time.monotonic() - t0
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:300]
    assert json.loads(payload[payload.index(b"{"):payload.rindex(b"}") + 1])["error"]["code"] == "408"
    assert TIMEOUTS["body_timeout_s"] - 0.05 <= elapsed <= TIMEOUTS["body_timeout_s"] + SLACK_S
    assert timed.router.conn_guard.counts["body_timeouts"] >= 1
    timed.wait_all_free()


def test_a_body_on_an_open_route_is_never_read(timed):
    """GET /health with a large announced body, trickled: answered 400 at once (not held as a busy
    request for the body timeout, which no cap could evict), and the connection closes."""
    port = int(timed.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: pdkv\r\nContent-Length: 1000000\r\n\r\nxyz")
        s.settimeout(TIMEOUTS["body_timeout_s"] + SLACK_S)
        t0 = time.monotonic()
        answer = s.recv(65536)
        elapsed = time.monotonic() - t0
    assert answer.startswith(b"HTTP/1.1 400"), answer[:300]
    assert elapsed < TIMEOUTS["body_timeout_s"], elapsed  # (the guard never waited for the body)


def test_a_peer_that_never_reads_its_answers_is_cut(timed):
    """Pipelined requests whose answers are never read: the guard drops the connection at its keep-alive
    (or write) timeout and aborts it. A graceful close would wait for the unsent answers forever,
    keeping the fd open outside the caps; an abort resets the peer, so its next send fails."""
    port = int(timed.url.rsplit(":", 1)[1])
    counts = timed.router.conn_guard.counts
    closed_before = counts["idle_closed"] + counts["write_timeouts"]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        request = b"GET /openapi.json HTTP/1.1\r\nHost: pdkv\r\n\r\n"
        s.settimeout(0.5)
        with contextlib.suppress(OSError):
            for _ in range(2000):  # far more answer bytes than both kernel buffers hold
                s.sendall(request)
        _wait(lambda: counts["idle_closed"] + counts["write_timeouts"] > closed_before,
              TIMEOUTS["body_timeout_s"] + SLACK_S, "the guard dropped the connection whose peer never reads")
        deadline, reset = time.monotonic() + SLACK_S, False
        while not reset and time.monotonic() < deadline:
            try:
                s.send(b"x")
                time.sleep(0.1)
            except (ConnectionResetError, BrokenPipeError):
                reset = True
            except TimeoutError:
                time.sleep(0.1)
        assert reset, "the server still holds the connection (a close waiting on unsent bytes)"


def test_past_the_caps_the_least_recently_used_idle_go_first(capped, fault_record):
    section = capped.config.router.connections
    port = int(capped.url.rsplit(":", 1)[1])
    per_peer, total = section.peer_cap, section.max_connections
    assert (per_peer, total) == (50, 120)  # far below the fd limit: the guard keeps them as configured
    # a stream in progress is never cut by the caps
    stream = requests.post(f"{capped.url}/v1/completions", stream=True, timeout=60,
                           json={"prompt": "a running stream", "max_tokens": 48, "ignore_eos": True, "stream": True})
    assert stream.status_code == 200
    lines = stream.iter_lines()
    first = next(line for line in lines if line)
    assert first.startswith(b"data: {")
    stop = threading.Event()
    peers = [JunkHolder("127.0.0.1", port, 80, stop, kinds="idle", reopen=False, source_host=f"127.0.0.{k}")
             for k in (2, 3, 4)]
    try:
        for h in peers:  # one peer after the other: the order the caps see them in
            h.start()
            assert h.opened.wait(120)
            _wait(lambda h=h: h.num_closed_by_peer >= 80 - per_peer, 30, "the peer's oldest connections evicted")
        # each peer was cut to its cap; then the total cap took the globally oldest (peer .2's)
        _wait(lambda: sum(h.num_open for h in peers) <= total - 1, 30, "at most the total cap held")
        assert all(h.num_open <= per_peer for h in peers), [h.num_open for h in peers]
        assert peers[2].num_open == per_peer and peers[0].num_open < per_peer
        figures = capped.router.conn_guard.figures()
        assert figures["open"] <= total and figures["evicted"] >= 3 * (80 - per_peer)
        answer = _good_completion(capped.url)  # a new connection: it closes an idle one to get in
        assert answer["usage"]["completion_tokens"] == 4
        rest = b"\n".join(line for line in lines if line)
        assert rest.rstrip().endswith(b"data: [DONE]") and b'"error"' not in rest
    finally:
        stop.set()
        for h in peers:
            if h.ident is not None:
                h.join(10)
        stream.close()
    capped.wait_all_free()
    fault_record(fault=f"3 peers x 80 idle connections (caps {per_peer}/peer, {total} total)", where="router",
                 user_saw="good request and running stream served", pdkv_did=f"evicted {figures['evicted']} least "
                 f"recently used idle connections, never above {total} open", pools="all free")


HOLDER = """
import json, resource, sys, threading
from pd.tools.junk_connections import HTTP_TRICKLE, JunkHolder
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
h = JunkHolder("127.0.0.1", int(sys.argv[1]), int(sys.argv[2]), payload=HTTP_TRICKLE)
h.start()
h.opened.wait(600)
print(json.dumps({"opened": h.num_opened}), flush=True)
sys.stdin.readline()
h.stop.set()
h.join(30)
print(json.dumps({"opened": h.num_opened, "closed_by_peer": h.num_closed_by_peer, "max_open": h.max_open}), flush=True)
"""


def _latencies(url: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.monotonic()
        _good_completion(url)
        out.append(time.monotonic() - t0)
    return sorted(out)


@pytest.mark.slow
def test_20000_junk_connections_leave_good_requests_served(fault_record):
    """Two processes hold 10,000 junk connections each (a quarter idle, the rest trickling
    headers; each one closed is opened again): the router keeps under its cap and its fds,
    and good requests are served meanwhile."""
    with LocalDeployment(local_config()) as dep:
        guard = dep.router.conn_guard
        port = int(dep.url.rsplit(":", 1)[1])
        before = _latencies(dep.url, 10)
        holders = [subprocess.Popen([sys.executable, "-c", HOLDER, str(port), "10000"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True) for _ in range(2)]
        try:
            for h in holders:
                assert json.loads(h.stdout.readline())["opened"] >= 1
            during = _latencies(dep.url, 10)
            figures = guard.figures()
            num_fds = len(os.listdir("/proc/self/fd"))
        finally:
            results = []
            for h in holders:
                h.stdin.write("\n")
                h.stdin.flush()
                results.append(json.loads(h.stdout.readline()))
                h.wait(60)
        assert figures["open"] <= guard.max_connections
        assert num_fds < resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert sum(r["opened"] for r in results) >= 20_000
        dep.wait_all_free()
    fault_record(fault="20,000 junk connections (2 processes, a quarter idle, the rest trickling headers, "
                       "reopened when closed)", where="router",
                 user_saw=f"10/10 good requests, median {during[5] * 1000:.0f} ms (before: {before[5] * 1000:.0f} ms)",
                 pdkv_did=f"at most {guard.max_connections} open, {figures['evicted']} evicted, "
                          f"{figures['header_timeouts']} header timeouts, {num_fds} fds", pools="all free")
