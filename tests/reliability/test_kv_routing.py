"""Routing by where the KV is: real workers (engine, ZMQ connector, KV event PUB, HTTP),
the real router with its KV index fed over real ZMQ SUB sockets, on loopback.

Checks that the index is each worker's cache (same hashes, none missing or extra), that
predicted and actual hits agree on every request, that a lost batch, a restarted worker
and forged or garbage batches are handled, and that every pool ends all free."""
from __future__ import annotations

import hashlib
import hmac
import os
import time

import msgpack
import pytest
import requests
import zmq

from kv_route_deploy import KVDeployment
from rel_deploy import SECRET, local_config
from pd.cluster.kv_wire import TOPIC, EventBatch, encode_batch, event_key
from pd.router.kv_index import HashingMismatch, _agreed_hit

TIMEOUT_S = 30
SYSTEM = [f"You are the assistant of tenant {t}; answer briefly and politely, citing the manual. " * 2
          for t in "ABC"]


def _config(mode: str = "disaggregated"):
    # 0.25 MB: about 32 blocks per worker, so the run evicts (BlockRemoved) as well as stores
    return local_config(mode, cache__kv_memory_mb=0.25)


def _assert_index_is_cache(dep: KVDeployment) -> None:
    dep.wait_exact()
    for wid in dep.workers:
        assert dep.index.hashes(wid) == dep.cached_hashes(wid), wid


def _conversation_run(dep: KVDeployment, turns: int = 3) -> list[tuple[int, int | None]]:
    """Multi-tenant, multi-turn: (actual P hit, predicted P hit) per request."""
    pairs = []
    history = {t: s for t, s in enumerate(SYSTEM)}
    for turn in range(turns):
        for tenant in history:
            history[tenant] += f" user turn {turn}: what about item {tenant * 10 + turn}?"
            out = dep.complete(history[tenant])
            rid = out["id"] + "-0"
            pairs.append((out["usage"]["prompt_tokens_details"]["cached_tokens"],
                          dep.router.pool.last_predicted[(rid, "prefill")]))
            history[tenant] += " " + out["choices"][0]["text"].encode("utf-8", "replace").decode("utf-8")
            dep.wait_exact()  # the next choice sees this request's blocks
    return pairs


def test_index_matches_caches_and_predicted_hits_equal_actual():
    with KVDeployment(_config()) as dep:
        pairs = _conversation_run(dep)
        assert all(p is not None for _, p in pairs)
        assert [a for a, _ in pairs] == [p for _, p in pairs]
        assert sum(a for a, _ in pairs) > 0  # the run had prefix hits to predict
        _assert_index_is_cache(dep)
        assert dep.counter("pdkv_prefix_hit_mispredictions_total") == 0  # P and D alike
        assert dep.counter("pdkv_prefix_hit_tokens_actual_total", role="decode") == \
            dep.counter("pdkv_prefix_hit_tokens_predicted_total", role="decode")
        assert dep.counter("pdkv_kv_event_batches_total", outcome="applied") > 0
        assert any(any(ev[0] == "removed" for _, evs in w.kv_events._history for ev in evs)
                   for w in dep.workers.values()), "the run should evict under cache pressure"
        body = requests.get(dep.url + "/pd/workers", timeout=TIMEOUT_S).json()
        for wid, entry in body.items():
            assert entry["kv_index"]["state"] == "exact"
            assert entry["kv_index"]["num_entries"] == sum(len(h) for h in dep.cached_hashes(wid).values())
        dep.wait_all_free()


def test_lost_batch_is_detected_and_healed_by_replay():
    with KVDeployment(_config(), num_prefill=1, num_decode=1) as dep:
        publisher = dep.workers["prefill-0"].kv_events
        void = zmq.Context.instance().socket(zmq.PUB)  # bound nowhere: what it sends is lost
        with publisher._lock:
            publisher._sock, real = void, publisher._sock
        dep.complete(SYSTEM[0] + " first")
        with publisher._lock:
            publisher._sock = real
        void.close(linger=0)
        # nothing follows the lost batch yet: the next heartbeat (or poll) shows the worker's seq ahead
        deadline = time.monotonic() + 10
        while dep.counter("pdkv_kv_index_resyncs_total", kind="replay") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        _assert_index_is_cache(dep)
        assert dep.counter("pdkv_kv_index_resyncs_total", kind="replay") == 1
        with publisher._lock:
            publisher._sock, real = zmq.Context.instance().socket(zmq.PUB), publisher._sock
        dep.complete(SYSTEM[1] + " second")
        with publisher._lock:
            publisher._sock.close(linger=0)
            publisher._sock = real
        dep.complete(SYSTEM[2] + " third")  # its batch arrives after a hole: a gap
        _assert_index_is_cache(dep)
        assert dep.counter("pdkv_kv_event_batches_total", outcome="gap") >= 1
        assert dep.counter("pdkv_kv_index_resyncs_total", kind="replay") == 2
        dep.wait_all_free()


def test_restarted_worker_is_resynchronised():
    with KVDeployment(_config(), num_prefill=1, num_decode=1) as dep:
        dep.complete(SYSTEM[0] + " before")
        dep.wait_exact()
        old_engine = dep.index.describe("prefill-0")["engine_id"]
        assert dep.index.hashes("prefill-0")
        dep.restart("prefill-0")
        deadline = time.monotonic() + 10
        while dep.index.describe("prefill-0")["engine_id"] == old_engine and time.monotonic() < deadline:
            time.sleep(0.05)
        _assert_index_is_cache(dep)
        assert dep.index.hashes("prefill-0") == {}  # a fresh worker holds nothing
        out = dep.complete(SYSTEM[0] + " after")
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        dep.complete(SYSTEM[0] + " again")
        _assert_index_is_cache(dep)
        dep.wait_all_free()


def test_forged_and_garbage_batches_are_dropped_and_counted():
    with KVDeployment(_config(), num_prefill=1, num_decode=1) as dep:
        dep.complete(SYSTEM[0] + " seed the cache")
        _assert_index_is_cache(dep)
        before = dep.index.describe("prefill-0")
        publisher = dep.workers["prefill-0"].kv_events
        forged = EventBatch(publisher.engine_id, "prefill-0", publisher.seq + 1, [["cleared", -1, []]])
        bad_payload = msgpack.packb({"v": 1, "engine_id": publisher.engine_id, "worker_id": "prefill-0",
                                     "seq": "x", "events": 7})
        good_key = event_key(SECRET)
        frames = [
            encode_batch(event_key("another-deployment-secret-0123"), forged),  # wrong secret
            [TOPIC, b"\xc1garbage", hmac.new(good_key, b"\xc1garbage", hashlib.sha256).digest()],
            [TOPIC, bad_payload, hmac.new(good_key, bad_payload, hashlib.sha256).digest()],
            [TOPIC, os.urandom(64)],
            encode_batch(good_key, EventBatch(publisher.engine_id, "decode-0", 1, [["cleared", -1, []]])),
        ]
        with publisher._lock:
            for f in frames:
                publisher._sock.send_multipart(f)
        deadline = time.monotonic() + 10
        while dep.counter("pdkv_kv_event_batches_total", outcome="wrong_worker") < 1 and \
                time.monotonic() < deadline:
            time.sleep(0.02)
        assert dep.counter("pdkv_kv_event_batches_total", outcome="bad_mac") == 1
        assert dep.counter("pdkv_kv_event_batches_total", outcome="malformed") == 3
        assert dep.index.describe("prefill-0") == before  # untouched, still EXACT
        dep.complete(SYSTEM[0] + " and still routed")
        _assert_index_is_cache(dep)
        dep.wait_all_free()


def test_colocated_routes_a_shared_prefix_to_the_worker_that_holds_it():
    with KVDeployment(_config("colocated"), num_prefill=2) as dep:
        first = dep.complete(SYSTEM[1] + " one")
        dep.wait_exact()
        holder = [w for w in dep.workers if dep.index.hashes(w)]
        assert len(holder) == 1
        out = dep.complete(SYSTEM[1] + " two")
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert dep.counter("pdkv_route_decisions_total", role="both", mode="exact") == 2
        _assert_index_is_cache(dep)
        dep.wait_all_free()


def test_hashing_mismatch_is_refused_at_start_up(monkeypatch):
    monkeypatch.setenv("PDKV_HASH_SEED", "a-seed-only-the-workers-have")
    dep = KVDeployment(_config(), num_prefill=1, num_decode=1)
    from pd.router import server


    class _RouterWithoutSeed(server.Router):
        def __init__(self, *args, **kwargs):
            monkeypatch.delenv("PDKV_HASH_SEED")  # the router derives the seed from the secret
            super().__init__(*args, **kwargs)

    monkeypatch.setattr("kv_route_deploy.Router", _RouterWithoutSeed)
    with pytest.raises(HashingMismatch, match="seed_digest"):
        dep.__enter__()
    dep.__exit__(None, None, None)


def test_hybrid_hit_counts_only_where_every_group_agrees():
    hashes = [bytes([i]) * 32 for i in range(8)]
    groups = [{"kind": "full_attention"}, {"kind": "sliding_window", "sliding_window": 33}]
    full, window = set(hashes[:6]), {hashes[2], hashes[3], hashes[4]}
    # full attention holds 6 blocks; the window (needs 2 blocks back-to-back) agrees up to block 5
    assert _agreed_hit({0: full, 1: window}, groups, hashes, 8, 16) == 5
    assert _agreed_hit({0: full, 1: set()}, groups, hashes, 8, 16) == 0
    assert _agreed_hit({0: full, 1: window}, [groups[0]], hashes, 8, 16) == 6
