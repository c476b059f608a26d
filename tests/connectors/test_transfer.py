"""Two real processes over loopback: a producer peer and a consumer peer, each with
its own PagePool, kvcache manager and ZmqConnector (see tests/helpers/peer_proc.py)."""
from __future__ import annotations

import time

import pytest
import zmq

from tests.helpers.kvpeer import BLOCK_SIZE, SECRET, PeerProc
from connectors.zmq.control import framing, wire
from connectors.zmq.consumer.consumer import Consumer, RemoteAddr
from connectors.zmq.consumer.consumer_config import ConsumerConfig
from connectors.zmq.control.handshake import CompatInfo
from pd.engine.kv.page_pool import PagePool
from connectors.zmq.control.wire import MsgType

BS = BLOCK_SIZE


def prompt(n_tokens: int, start: int = 100) -> list[int]:
    return list(range(start, start + n_tokens))


def transfer(producer, consumer, rid: str, tokens: list[int], seed: int = 0, free: bool = True):
    p = producer.call("prefill", request_id=rid, prompt=tokens, seed=seed)
    assert p["delay"] and p["params"]["do_remote_prefill"]
    d = consumer.call("decode", request_id=rid, prompt=tokens, params=p["params"])
    r = consumer.call("wait_load", request_id=rid, free=free)
    return p, d, r


def audit_both(producer, consumer, rid: str | None = None):
    if rid is not None:
        assert producer.call("wait_sent", request_id=rid, timeout_s=10)["done"], "producer never released its lease"
    producer.call("audit", reset_prefix_cache=True)
    consumer.call("audit", reset_prefix_cache=True)


def test_pages_land_byte_exact(producer, consumer):
    producer.call("filler", num_tokens=5 * BS)  # shifts the producer's block ids
    tokens = prompt(6 * BS + 5)
    before = consumer.call("stats")["stats"]["blocks_recv"]
    p, d, r = transfer(producer, consumer, "exact", tokens, seed=1)
    assert r["done"] and r["invalid"] == []
    assert d["num_local"] == 0 and d["num_external"] == len(tokens) and d["async"]
    assert d["block_ids"] != p["block_ids"]  # different ids on each side...
    assert r["digests"] == p["digests"]  # ...same bytes at every position of every group
    assert consumer.call("stats")["stats"]["blocks_recv"] - before == 2 * 7
    audit_both(producer, consumer, "exact")


def test_prefix_hit_transfers_only_suffix(producer, consumer):
    shared = prompt(4 * BS, start=1000)
    first = shared + prompt(BS, start=5000)
    _, _, r = transfer(producer, consumer, "pfx-a", first, seed=2)
    assert r["done"] and not r["invalid"]
    second = shared + prompt(3 * BS + 2, start=7000)
    before = consumer.call("stats")["stats"]["blocks_recv"]
    p, d, r = transfer(producer, consumer, "pfx-b", second, seed=3)
    assert d["num_local"] == 4 * BS and d["num_external"] == len(second) - 4 * BS
    assert r["done"] and not r["invalid"]
    assert consumer.call("stats")["stats"]["blocks_recv"] - before == 2 * 4  # only the 4 suffix blocks per group
    for g in range(2):
        assert r["digests"][g][4:] == p["digests"][g][4:]
    producer.call("wait_sent", request_id="pfx-a")
    audit_both(producer, consumer, "pfx-b")


def test_sliding_window_groups_are_clipped():
    window = 2 * BS
    p = PeerProc(engine_id="prefill-swa", role="kv_producer", groups=[{}, {"window": window}])
    c = PeerProc(engine_id="decode-swa", role="kv_consumer", groups=[{}, {"window": window}])
    try:
        tokens = prompt(8 * BS + 3)
        pre, d, r = transfer(p, c, "swa", tokens, seed=4)
        sent = pre["params"]["remote_block_ids"]
        assert len(sent[0]) == 9 and len(sent[1]) <= -(-window // BS) + 1
        assert r["done"] and not r["invalid"]
        swa_dst = [i for i, b in enumerate(d["block_ids"][1]) if b]
        assert len(swa_dst) < 9  # the consumer only holds the window...
        assert c.call("stats")["stats"]["blocks_recv"] == 9 + len(swa_dst)  # ...and only that moved
        assert r["digests"][0] == pre["digests"][0]
        assert [r["digests"][1][i] for i in swa_dst] == [pre["digests"][1][i] for i in swa_dst]
        audit_both(p, c, "swa")
    finally:
        p.close()
        c.close()


def test_lease_expiry_frees_producer_blocks_and_later_pull_is_refused(producer, consumer):
    producer.call("set_lease", lease_s=0.5)
    try:
        tokens = prompt(3 * BS)
        pre = producer.call("prefill", request_id="expire", prompt=tokens, seed=5)
        assert producer.call("wait_sent", request_id="expire", timeout_s=5)["done"]
        assert producer.call("stats")["stats"]["leases_expired"] >= 1
        producer.call("audit")
        # The decode side arrives too late: it must find out, not read freed pages.
        consumer.call("decode", request_id="expire", prompt=tokens, params=pre["params"])
        r = consumer.call("wait_load", request_id="expire")
        assert r["done"] and len(r["invalid"]) == 2 * 3
        consumer.call("audit")
    finally:
        producer.call("set_lease", lease_s=30.0)


def test_heartbeats_keep_a_waiting_request_lease(producer, consumer):
    producer.call("set_lease", lease_s=0.6)
    try:
        tokens = prompt(2 * BS)
        pre = producer.call("prefill", request_id="hb", prompt=tokens, seed=6)
        consumer.call("enqueue", request_id="hb", prompt=tokens, params=pre["params"])
        consumer.call("idle", seconds=1.5)  # heartbeats every 0.2 s, lease 0.6 s
        assert "hb" in producer.call("stats")["held"]
        consumer.call("decode", request_id="hb", prompt=tokens, params=pre["params"])
        r = consumer.call("wait_load", request_id="hb")
        assert r["done"] and not r["invalid"] and r["digests"] == pre["digests"]
        audit_both(producer, consumer, "hb")
    finally:
        producer.call("set_lease", lease_s=30.0)


def test_corrupted_page_is_detected(producer, consumer):
    tokens = prompt(4 * BS)
    pre = producer.call("prefill", request_id="bad", prompt=tokens, seed=7)
    victim_pos = 2
    producer.call("corrupt", request_id="bad", block_id=pre["block_ids"][1][victim_pos])
    d = consumer.call("decode", request_id="bad", prompt=tokens, params=pre["params"])
    r = consumer.call("wait_load", request_id="bad")
    assert r["done"] and r["invalid"] == [d["block_ids"][1][victim_pos]]
    assert consumer.call("stats")["stats"]["failures"].get("checksum") == 1
    audit_both(producer, consumer, "bad")


def test_producer_killed_consumer_reports_failure_in_time(consumer):
    p = PeerProc(engine_id="prefill-doomed", role="kv_producer")
    try:
        tokens = prompt(3 * BS)
        pre = p.call("prefill", request_id="gone", prompt=tokens, seed=8)
    finally:
        p.kill()
    d = consumer.call("decode", request_id="gone", prompt=tokens, params=pre["params"])
    r = consumer.call("wait_load", request_id="gone")
    assert r["done"] and r["seconds"] < 2.0 + 2.0  # handshake timeout is 2 s
    assert sorted(r["invalid"]) == sorted(b for g in d["block_ids"] for b in g)
    consumer.call("audit")


def test_consumer_killed_mid_transfer_producer_frees_within_lease():
    big = dict(head_size=4096, num_blocks=80)  # 512 KiB pages: a 32 MiB transfer
    p = PeerProc(engine_id="prefill-big", role="kv_producer", lease_s=1.0, **big)
    c = PeerProc(engine_id="decode-big", role="kv_consumer", data_path="tcp", **big)
    try:
        tokens = prompt(32 * BS)
        pre = p.call("prefill", request_id="orphan", prompt=tokens, seed=9)
        c.call("decode", request_id="orphan", prompt=tokens, params=pre["params"])
        c.kill()
        assert p.call("wait_sent", request_id="orphan", timeout_s=5)["done"]
        p.call("audit")
    finally:
        c.close()
        p.close()


def test_refused_peers_and_garbage_while_good_traffic_goes_on(producer, consumer):
    compat_ok = producer_compat()
    pool = PagePool(8, 16 * 1024)
    remote = RemoteAddr(producer.engine_id, "127.0.0.1", producer.port)
    pre = producer.call("prefill", request_id="guarded", prompt=prompt(2 * BS), seed=10)
    src = pre["params"]["remote_block_ids"][0]
    cases = {
        "auth": ConsumerConfig(engine_id="intruder", secret=b"wrong-secret-wrong-secret", compat_hash=compat_ok),
        "compat_hash": ConsumerConfig(engine_id="mismatch", secret=SECRET.encode(), compat_hash="0" * 64),
    }
    garbage_sent = _send_garbage(producer)
    for reason, cfg in cases.items():
        cons = Consumer(cfg, pool)
        cons.start()
        try:
            job = cons.load("x", remote, "guarded", src, [1, 2])
            assert job.done.wait(10)
            assert not job.result.ok and job.result.cause.value == "handshake_refused"
            # refused for this reason and no other (the count itself: once seen at 2 at load average 18)
            refused = cons.metrics.snapshot()["handshakes_refused"]
            assert set(refused) == {reason} and refused[reason] >= 1, refused
        finally:
            cons.shutdown()
    wrong_engine = Consumer(ConsumerConfig(engine_id="lost", secret=SECRET.encode(), compat_hash=compat_ok), pool)
    wrong_engine.start()
    try:
        job = wrong_engine.load("y", RemoteAddr("someone-else", "127.0.0.1", producer.port), "guarded", src, [1, 2])
        assert job.done.wait(10) and job.result.cause.value == "handshake_refused"
    finally:
        wrong_engine.shutdown()
    # Good traffic still flows, and the producer counted what it refused.
    d = consumer.call("decode", request_id="guarded", prompt=prompt(2 * BS), params=pre["params"])
    r = consumer.call("wait_load", request_id="guarded")
    assert r["done"] and not r["invalid"] and r["digests"] == pre["digests"] and d["async"]
    stats = producer.call("stats")["stats"]
    assert stats["handshakes_refused"].get("auth", 0) >= 1
    assert stats["handshakes_refused"].get("compat_hash", 0) >= 1
    assert stats["handshakes_refused"].get("engine_id", 0) >= 1
    assert stats["handshakes_refused"].get("session", 0) >= 1
    assert stats["malformed_frames"] >= garbage_sent
    audit_both(producer, consumer, "guarded")


def producer_compat() -> str:
    from kvcache import FullAttentionSpec, KVCacheGroupSpec

    specs = [FullAttentionSpec(block_size=BS, num_kv_heads=h, head_size=64, dtype="float32") for h in (1, 2)]
    groups = [KVCacheGroupSpec(layer_names=(f"g{i}.l0",), spec=s) for i, s in enumerate(specs)]
    return CompatInfo.from_groups("tiny", groups, max(s.page_size_bytes for s in specs)).hash()


def _send_garbage(producer) -> int:
    """Malformed side-channel frames and a data stream without a session; returns how many
    malformed side-channel frames were sent."""
    import socket

    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 10_000)  # close() still delivers what is queued (bounded); 0 could drop it
    dealer.connect(f"tcp://127.0.0.1:{producer.port}")
    frames = [
        b"\x00\xffnot msgpack at all",
        b"\x93\x01\x02\x03",  # a msgpack list, not a map
        b"\x82\xa1v\x09\xa1t\xa5hello",  # wrong protocol version
        wire.encode(MsgType.CREDIT, half=1)[:-1],  # truncated
        b"\x82\xa1v\x01\xa1t\xa4nope",  # unknown type
    ]
    for f in frames:
        dealer.send(f)
    dealer.send_multipart([b"two", b"frames"])
    dealer.close()
    for payload in (b"\xde\xad\xbe\xef" * 8, wire.encode(MsgType.ATTACH, session=b"x" * 32, mode="tcp", mac=b"m" * 32)):
        s = socket.create_connection(("127.0.0.1", producer.data_port), timeout=5)
        s.settimeout(5)
        assert framing.recv_frame(s)[0] is MsgType.NONCE  # the producer opens with a fresh nonce
        s.sendall(len(payload).to_bytes(4, "big") + payload if payload[0] != 0xDE else payload)
        try:
            assert s.recv(16) == b""  # the producer closes the stream
        except ConnectionResetError:
            pass
        s.close()
    return len(frames)


@pytest.mark.parametrize("path", ["shm", "shm_staged", "tcp"])
def test_both_data_paths_move_exact_bytes(producer, path):
    c = PeerProc(engine_id=f"decode-{path}", role="kv_consumer", data_path=path)
    try:
        tokens = prompt(5 * BS)
        p, _, r = transfer(producer, c, f"path-{path}", tokens, seed=11)
        assert r["done"] and not r["invalid"] and r["digests"] == p["digests"]
        audit_both(producer, c, f"path-{path}")
    finally:
        c.close()
