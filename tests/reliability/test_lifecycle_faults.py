"""Request-lifecycle races between two real engines with real ZMQ connectors:
aborts during a transfer, leases that expire while D is slow to admit, a
producer restarted at the same address (stale peer), duplicate and late
completion messages. Each asserts what the user sees and that pools end all free.
"""
from __future__ import annotations

import time

import pytest

from connectors.zmq.consumer.consumer import RemoteAddr
from connectors.metrics import FailureCause
from rel_pair import Pair, Side, free_port, make_engine, prompt, reference
from connectors.zmq.connector import KVRole

TOKS = prompt(70)


@pytest.fixture(scope="module")
def want():
    return reference(TOKS, 8)


def test_abort_racing_a_transfer(want, fault_record):
    # The pull is held 0.6 s on the wire; D aborts the request while it waits for the KV.
    with Pair(Side("prefill-0", lease_s=3.0), Side("decode-0"), faults="data.pull:delay:0.6") as pair:
        params = pair.prefill("r1", TOKS)
        outs = {"r1": pair.add_decode("r1", TOKS, params, 8)}
        pair.step_until(lambda: pair.d.stats()["num_waiting_for_remote_kvs"] == 1, engines=[pair.d])
        pair.d.abort_request("r1")
        t0 = time.monotonic()
        pair.drive(outs, timeout_s=10)
        assert outs["r1"]["reason"] == "abort" and outs["r1"]["tokens"] == []
        # D keeps the blocks the pull writes into until the pull ended, then frees them; P frees on DONE
        pair.assert_all_free(timeout_s=10)
        freed = time.monotonic() - t0
        again = pair.run("r2", TOKS, 8)
        assert again.tokens == want
        pair.assert_all_free()
    fault_record(fault="abort while the pull is in flight", where="D engine",
                 user_saw="finish_reason=abort at once", pdkv_did="D held the landing blocks until the pull ended",
                 pools=f"all free ({freed:.1f}s)")


def test_abort_on_producer_before_decode_arrives(want, fault_record):
    with Pair(Side("prefill-0", lease_s=30.0), Side("decode-0")) as pair:
        params = pair.prefill("r1", TOKS)
        # the router gave up before sending the decode: D tells P to drop the lease (what a refused decode does)
        assert pair.d.connector.release_remote(params)
        t0 = time.monotonic()
        pair.assert_all_free(timeout_s=5)  # far less than the 30 s lease
        freed = time.monotonic() - t0
    fault_record(fault="decode never sent (router gave up)", where="P lease",
                 user_saw="(request ended at the router)", pdkv_did="release notice ends P's lease at once",
                 pools=f"all free ({freed:.1f}s, lease 30s)")


@pytest.mark.parametrize("faults", [None, "side.heartbeat:drop:times=all"])
def test_lease_expires_while_decode_is_slow_to_admit(want, faults, fault_record):
    # D runs one request at a time; r2 waits behind a long r1 well past P's 2 s lease.
    with Pair(Side("prefill-0", lease_s=2.0), Side("decode-0", max_num_seqs=1, heartbeat_s=0.15),
              faults=faults) as pair:
        long_prompt = prompt(40, start=9)
        p1, p2 = pair.prefill("r1", long_prompt), pair.prefill("r2", TOKS)
        outs = {"r1": pair.add_decode("r1", long_prompt, p1, 100)}
        deadline = time.monotonic() + 20
        while not outs["r1"]["tokens"] and time.monotonic() < deadline:  # r1 decoding
            pair.collect(outs, pair.d.step())
        outs["r2"] = pair.add_decode("r2", TOKS, p2, 8)  # queued behind r1 (max_num_seqs=1)
        pair.drive(outs, timeout_s=60, on_step=lambda: time.sleep(0.03))  # a slow D
        assert outs["r1"]["tokens"] == reference(long_prompt, 100)
        assert outs["r2"]["tokens"] == want
        expired = pair.p.connector.stats()["leases_expired"]
        recomputed = pair.d.scheduler.stats.num_load_failures_recomputed
        if faults is None:  # D's heartbeats keep the lease alive while r2 queues
            assert expired == 0 and recomputed == 0
        else:  # heartbeats lost: the lease expires, the late pull is refused, D recomputes (never stale bytes)
            assert expired >= 1 and recomputed >= 1
        pair.assert_all_free()
    fault_record(fault="D slow to admit past P's lease" + (" + heartbeats dropped" if faults else ""),
                 where="P lease / D queue", user_saw="correct tokens",
                 pdkv_did=("heartbeats kept the lease alive; KV transferred" if faults is None else
                           f"{expired} lease(s) expired; pull refused; D recomputed"),
                 pools="all free")


@pytest.mark.parametrize("same_engine_id", [False, True])
def test_producer_restarted_at_the_same_address(want, same_engine_id, fault_record):
    port = free_port()
    p_side = Side("prefill-0", port=port)
    with Pair(p_side, Side("decode-0")) as pair:
        warm = pair.run("warm", TOKS, 8)  # D now has a session with the first producer
        assert warm.tokens == want
        pair.assert_all_free()
        params = pair.prefill("r1", TOKS)
        pair.p.shutdown()
        pair.p = None  # (restarted at once: the producer's bind waits out libzmq's asynchronous release)
        new_id = "prefill-0" if same_engine_id else "prefill-0-restarted"
        pair.p = make_engine(Side(new_id, port=port), KVRole.PRODUCER)
        assert pair.p.connector.port == port
        out = {"r1": pair.add_decode("r1", TOKS, params, 8)}
        t0 = time.monotonic()
        pair.drive(out, timeout_s=20)
        seconds = time.monotonic() - t0
        assert out["r1"]["tokens"] == want  # never the restarted producer's bytes
        assert pair.d.scheduler.stats.num_load_failures_recomputed == 1
        failures = pair.d.connector.stats()["failures"]
        pair.assert_all_free()
    fault_record(fault=f"producer restarted at the same address ({'same' if same_engine_id else 'new'} engine id)",
                 where="KV handshake / pull", user_saw=f"correct tokens in {seconds:.1f}s",
                 pdkv_did=f"stale peer detected ({failures}); D recomputed", pools="all free")


def test_restarted_producer_with_fail_policy_gives_a_clear_error(fault_record):
    port = free_port()
    with Pair(Side("prefill-0", port=port), Side("decode-0", policy="fail")) as pair:
        params = pair.prefill("r1", TOKS)
        pair.p.shutdown()
        pair.p = make_engine(Side("prefill-0-restarted", port=port), KVRole.PRODUCER)
        out = {"r1": pair.add_decode("r1", TOKS, params, 8)}
        t0 = time.monotonic()
        pair.drive(out, timeout_s=20)
        assert out["r1"]["reason"] == "error" and "KV load failed" in out["r1"]["error"]
        assert out["r1"]["cause"] is FailureCause.HANDSHAKE_REFUSED  # the connector's cause, as the enum
        assert out["r1"]["tokens"] == []
        seconds = time.monotonic() - t0
        pair.assert_all_free()
    fault_record(fault="stale producer, kv_load_failure_policy=fail", where="D engine",
                 user_saw=f"error 'KV load failed' in {seconds:.1f}s", pdkv_did="load refused by handshake",
                 pools="all free")


def test_duplicate_and_late_completion_messages_end_a_lease_once(want, fault_record):
    with Pair(Side("prefill-0", lease_s=30.0), Side("decode-0")) as pair:
        out = pair.run("r1", TOKS, 8)
        assert out.tokens == want
        pair.assert_all_free()
        consumer = pair.d.connector.worker.consumer
        remote = RemoteAddr("prefill-0", "127.0.0.1", pair.p.connector.port)
        # late and repeated DONEs for a released lease, and one for a request P never had
        for _ in range(3):
            consumer.notify_done(remote, ["r1", "never-existed"])
        # A new lease under the SAME request id: a late DONE may end it early (leases are keyed by request
        # id; the router never reuses ids). Then the pull is refused and D recomputes: slower, never wrong.
        params = pair.prefill("r1", TOKS)
        outs = {"r1": pair.add_decode("r1", TOKS, params, 8)}
        pair.drive(outs)
        assert outs["r1"]["tokens"] == want
        recomputed = pair.d.scheduler.stats.num_load_failures_recomputed
        ended = pair.p.connector.stats()["leases_ended"]
        pair.assert_all_free()
        assert pair.p.kv_cache_manager.block_pool.get_num_free_blocks() == pair.p.page_pool.num_blocks - 1
    fault_record(fault="duplicate and late completion (DONE) messages, request id reused", where="P lease table",
                 user_saw="correct tokens",
                 pdkv_did=f"no double free; leases ended {ended}; late DONE on a reused id -> {recomputed} recompute",
                 pools="all free")


def test_decode_waits_for_blocks_then_serves(want, fault_record):
    # D's pool (9 usable blocks) holds r1 (130 tokens = 9 blocks) or r2 (5 blocks + growth), not both:
    # r2's admission is refused for lack of blocks until r1 finishes; heartbeats keep P's lease meanwhile.
    with Pair(Side("prefill-0", lease_s=2.0), Side("decode-0", num_blocks=10, heartbeat_s=0.15)) as pair:
        long_prompt = prompt(70, start=21)
        p1, p2 = pair.prefill("r1", long_prompt), pair.prefill("r2", TOKS)
        outs = {"r1": pair.add_decode("r1", long_prompt, p1, 60)}
        deadline = time.monotonic() + 20
        while not outs["r1"]["tokens"] and time.monotonic() < deadline:
            pair.collect(outs, pair.d.step())
        outs["r2"] = pair.add_decode("r2", TOKS, p2, 8)
        waited = []
        pair.drive(outs, timeout_s=60, on_step=lambda: (time.sleep(0.02),
                                                         waited.append(pair.d.stats()["num_waiting"])))
        assert max(waited) == 1  # r2 really waited for blocks
        assert outs["r1"]["tokens"] == reference(long_prompt, 60) and outs["r2"]["tokens"] == want
        assert pair.p.connector.stats()["leases_expired"] == 0
        assert pair.d.scheduler.stats.num_load_failures_recomputed == 0
        pair.assert_all_free()
    fault_record(fault="decode admission refused for lack of blocks (pool busy)", where="D scheduler",
                 user_saw="correct tokens once blocks freed", pdkv_did="r2 waited; heartbeats kept P's lease; KV transferred",
                 pools="all free")
