"""The KV event stream as an attacker on the host sees it: real workers (engine, CURVE XPUB,
ZAP gate, HTTP) and the real router's SUB over loopback.

- a SUB without the deployment secret (plain, or CURVE with keys of another secret, or with a
  guessed client key) completes no handshake and receives nothing, while the router, holding
  the secret, still gets every batch and its index stays each worker's cache;
- 100 subscribers that hold the secret but never read cost the worker a bounded amount of
  memory (at most `max_subscribers` are admitted, each owed at most `SEND_HWM` batches plus
  its kernel buffer), and good requests are served meanwhile;
- lost trailing batches are noticed by the next heartbeat, not the next poll."""
from __future__ import annotations

import subprocess
import sys
import socket
import time

import pytest
import zmq

from kv_route_deploy import KVDeployment
from rel_deploy import SECRET, local_config
from kvcache.events import BlockRemoved, BlockStored
from pd.cluster.kv_wire import (TOPIC, BatchError, EventBatch, curve_keys, decode_batch, encode_batch,
                                encode_heartbeat, event_key)
from pd.worker import kv_events

TIMEOUT_S = 30
PROMPT = "You are the assistant of tenant A; answer briefly and politely, citing the manual. " * 2
NUM_IDLE_SUBSCRIBERS = 100
INJECTED_HASHES = 500  # per injected batch: about 17 KB of payload
NUM_INJECTED_PAIRS = 1500  # per phase: 3000 batches, about 50 MB of payloads

# Subscribers that hold the secret and never read (in their own process, so their receive
# queues are not in the worker's RSS): each keeps one message and a 4 KB kernel buffer.
IDLE_SUBSCRIBERS = r"""
import sys, time, zmq
from pd.cluster.kv_wire import TOPIC, curve_keys
endpoint, secret, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
keys = curve_keys(secret)
ctx = zmq.Context()
socks = []
for _ in range(n):
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.RCVHWM, 1)
    s.setsockopt(zmq.RCVBUF, 4096)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    s.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    s.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
    s.setsockopt(zmq.SUBSCRIBE, TOPIC)
    s.connect(endpoint)
    socks.append(s)
print("ready", flush=True)
sys.stdin.read()
"""


def _config(**overrides):
    return local_config("disaggregated", cache__kv_memory_mb=0.25, **overrides)


def _assert_index_is_cache(dep: KVDeployment) -> None:
    dep.wait_exact()
    for wid in dep.workers:
        assert dep.index.copies(wid) == dep.cached_copies(wid), wid


def _sub(ctx: zmq.Context, endpoint: str, keys=None, client_pair=None) -> zmq.Socket:
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        public, secret = client_pair or (keys.client_public, keys.client_secret)
        s.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
        s.setsockopt(zmq.CURVE_PUBLICKEY, public)
        s.setsockopt(zmq.CURVE_SECRETKEY, secret)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(endpoint)
    return s


def _drain(sock: zmq.Socket, wait_ms: int) -> list[list[bytes]]:
    out = []
    while sock.poll(wait_ms):
        out.append(sock.recv_multipart())
        wait_ms = 0
    return out


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_subscribers_without_the_secret_receive_nothing():
    with KVDeployment(_config(), num_prefill=1, num_decode=1) as dep:
        publisher = dep.workers["prefill-0"].kv_events
        ctx = zmq.Context()
        try:
            good = _sub(ctx, publisher.endpoint, curve_keys(SECRET))
            intruders = {
                "plain": _sub(ctx, publisher.endpoint),
                "other secret": _sub(ctx, publisher.endpoint, curve_keys("another-deployment-secret-0123")),
                "guessed client key": _sub(ctx, publisher.endpoint, curve_keys(SECRET), zmq.curve_keypair()),
            }
            # the router, holding the secret, follows every batch of these requests
            seq0 = dep.index.describe("prefill-0")["seq"]
            for i in range(3):
                dep.complete(PROMPT + f" turn {i}")
            dep.wait_exact()
            assert dep.index.describe("prefill-0")["seq"] > seq0
            for name, sock in intruders.items():
                assert _drain(sock, 1000) == [], f"a subscriber with {name} received the stream"
            # so does any subscriber with the secret: batches and heartbeats, all verified
            deadline = time.monotonic() + TIMEOUT_S
            seen: list = []
            attempt = 0
            while not any(not b.heartbeat and b.events for b in seen):
                assert time.monotonic() < deadline, "the subscriber with the secret received no batch"
                attempt += 1  # a new prompt each time: a repeated one is a prefix hit, which stores nothing
                dep.complete(PROMPT + f" fresh turn {attempt}")
                seen += [decode_batch(event_key(SECRET), f) for f in _drain(good, 1000)]
            assert any(b.heartbeat for b in seen + [decode_batch(event_key(SECRET), f) for f in _drain(good, 2000)])
            assert publisher.info()["num_refused_subscribers"] >= 1  # the guessed key reached ZAP: refused
            _assert_index_is_cache(dep)
        finally:
            ctx.destroy(linger=0)
        dep.wait_all_free()


def _inject(dep: KVDeployment, num_pairs: int) -> None:
    """Stores then removes hashes no block holds, in large batches through the worker's real
    publisher: the index ends as it began. Paced so that the router itself never lags."""
    publisher = dep.workers["prefill-0"].kv_events
    fake = [bytes([7]) * 31 + bytes([i % 256]) for i in range(INJECTED_HASHES)]
    chunk = kv_events.SEND_HWM // 4
    for start in range(0, num_pairs, chunk):
        for _ in range(min(chunk, num_pairs - start)):
            publisher.publish([BlockStored(block_hashes=fake, parent_block_hash=None, token_ids=[], block_size=16,
                                           group_idx=0)])
            publisher.publish([BlockRemoved(block_hashes=fake, group_idx=0)])
        dep.wait_exact(timeout_s=TIMEOUT_S)


def test_idle_subscribers_cost_the_worker_a_bounded_amount():
    with KVDeployment(_config(), num_prefill=1, num_decode=1) as dep:
        publisher = dep.workers["prefill-0"].kv_events
        dep.complete(PROMPT + " warm up")
        _inject(dep, NUM_INJECTED_PAIRS // 4)  # the allocator's steady state
        rss0 = _rss_bytes()
        _inject(dep, NUM_INJECTED_PAIRS)  # control: the same traffic, no idle subscribers
        control_growth = _rss_bytes() - rss0
        idle = subprocess.Popen([sys.executable, "-c", IDLE_SUBSCRIBERS, publisher.endpoint, SECRET,
                                 str(NUM_IDLE_SUBSCRIBERS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert idle.stdout is not None and idle.stdout.readline().strip() == "ready"
            max_subscribers = kv_events.DEFAULT_MAX_SUBSCRIBERS
            deadline = time.monotonic() + 20
            while publisher.info().get("num_subscribers", 0) < max_subscribers and time.monotonic() < deadline:
                time.sleep(0.05)
            rss1 = _rss_bytes()
            _inject(dep, NUM_INJECTED_PAIRS)
            outs = [dep.complete(PROMPT + f" served while idle subscribers wait {i}") for i in range(3)]
            growth = _rss_bytes() - rss1
            batch_bytes = max(len(f) for f in _injected_frames())
            owed = max_subscribers * (kv_events.SEND_HWM * batch_bytes + kv_events.SEND_BUFFER_BYTES)
            slack = 16 * 2**20  # allocator noise beyond the control run
            assert growth <= max(control_growth, 0) + owed + slack, (
                f"worker RSS grew {growth / 2**20:.1f} MiB with {NUM_IDLE_SUBSCRIBERS} idle subscribers "
                f"(control {control_growth / 2**20:.1f} MiB, owed at most {owed / 2**20:.1f} MiB)")
            info = publisher.info()
            assert info["num_subscribers"] <= max_subscribers
            assert info["num_refused_subscribers"] >= NUM_IDLE_SUBSCRIBERS - max_subscribers
            assert all(o["choices"][0]["text"] is not None for o in outs)
            _assert_index_is_cache(dep)
        finally:
            idle.stdin.close()  # type: ignore[union-attr]
            idle.wait(timeout=TIMEOUT_S)
        dep.wait_all_free()


def _injected_frames() -> list[bytes]:
    fake = [bytes([7]) * 32] * INJECTED_HASHES
    return encode_batch(event_key(SECRET), EventBatch("e" * 32, "prefill-0", 2**31, [["stored", 0, fake]]))


def test_lost_trailing_batches_show_within_a_heartbeat():
    # polls every 60 s: only the heartbeat can reveal the loss within the wait below
    with KVDeployment(_config(router__health_interval_s=60.0), num_prefill=1, num_decode=1) as dep:
        publisher = dep.workers["prefill-0"].kv_events
        void = zmq.Context.instance().socket(zmq.PUB)  # bound nowhere: what it sends is lost
        with publisher._lock:
            publisher._sock, real = void, publisher._sock
        dep.complete(PROMPT + " lost")
        with publisher._lock:
            publisher._sock = real
            lost_seq = publisher.seq
        void.close(linger=0)
        deadline = time.monotonic() + 15  # a quarter of the poll interval
        while dep.counter("pdkv_kv_index_resyncs_total", kind="replay") < 1:
            assert time.monotonic() < deadline, f"index still behind: {dep.index.describe('prefill-0')}"
            time.sleep(0.05)
        assert dep.counter("pdkv_kv_event_batches_total", outcome="gap") >= 1
        assert dep.index.describe("prefill-0")["seq"] >= lost_seq
        _assert_index_is_cache(dep)
        dep.wait_all_free()


def test_heartbeats_are_signed_and_shaped():
    key = event_key(SECRET)
    hb = decode_batch(key, encode_heartbeat(key, "engine-1", "prefill-0", 0))
    assert (hb.heartbeat, hb.seq, hb.events) == (True, 0, [])
    with pytest.raises(BatchError) as info:
        decode_batch(event_key("another-deployment-secret-0123"), encode_heartbeat(key, "e", "w", 3))
    assert info.value.reason == "bad_mac"
    frames = encode_heartbeat(key, "e", "w", -1)
    with pytest.raises(BatchError):
        decode_batch(key, frames)
    assert frames[0] == TOPIC


def test_connections_to_the_stream_are_capped_before_any_handshake():
    """A stranger's TCP connections each hold an fd for up to the handshake timeout: past
    MAX_CONNECTIONS the newest are shut at once (connectors.zmq.control.side_guard), so however many a peer
    opens, the publisher holds a bounded number."""
    from pd.worker.kv_events import HANDSHAKE_TIMEOUT_MS, MAX_CONNECTIONS, KVEventPublisher

    publisher = KVEventPublisher("w-cap", "e-cap", "cap-secret-0123456789abcdef", "127.0.0.1")
    port = int(publisher.endpoint.rsplit(":", 1)[1])
    socks: list[socket.socket] = []
    try:
        socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(MAX_CONNECTIONS + 40)]
        # (before the handshake timeout, which would close them all anyway: the cap acts at once)
        deadline, shut = time.monotonic() + HANDSHAKE_TIMEOUT_MS / 1000 - 1.5, set()
        while time.monotonic() < deadline and len(shut) < 40:
            for i, s in enumerate(socks):
                if i in shut:
                    continue
                s.settimeout(0.01)
                try:
                    while s.recv(1 << 16):  # the server's greeting bytes, then the end once it is shut
                        pass
                    shut.add(i)
                except TimeoutError:
                    pass
                except ConnectionResetError:
                    shut.add(i)
            time.sleep(0.2)
        num_shut = len(shut)
        assert num_shut >= 40, f"{num_shut} of {len(socks)} connections shut (cap {MAX_CONNECTIONS})"
    finally:
        for s in socks:
            s.close()
        publisher.close()
