"""What an unauthenticated peer can cost a producer (issue 13, findings 2, 3 and 8).

- REFUSE frames with ever new reasons leave the connector's metrics at their size, and the
  log single-line and rate-limited;
- 200 idle or trickling sockets on the data port leave KV transfer working, and a trickled
  ATTACH is cut at one deadline for the whole of it;
- a refused HELLO tells the peer neither the producer's engine id nor its compatibility hash.
"""
from __future__ import annotations

import logging
import random
import socket
import time

import pytest
import zmq

from connectors.zmq.control import wire
from connectors.zmq.control.wire import MsgType
from pd.tools.junk_connections import TRICKLE, JunkHolder
from rel_pair import Pair, Side, prompt, reference


def _flat_keys(d: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in d.items():
        out |= _flat_keys(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}"}
    return out


def _refuse_flood(port: int, seconds: float, max_frames: int) -> int:
    """REFUSE frames, each with a new reason and a detail that tries to forge log lines."""
    ctx, sent, rng = zmq.Context.instance(), 0, random.Random(3)
    end = time.monotonic() + seconds
    while sent < max_frames and time.monotonic() < end:
        dealer = ctx.socket(zmq.DEALER)  # a new identity every 1000 frames
        dealer.setsockopt(zmq.LINGER, 10_000)
        dealer.setsockopt(zmq.SNDTIMEO, 5000)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        for _ in range(min(1000, max_frames - sent)):
            reason = f"r{sent}.{rng.random()}\nWARNING forged line {sent}"
            dealer.send(wire.encode(MsgType.REFUSE, reason=reason, detail="x" * 500 + "\r\nFORGED\n" + "y" * 500))
            sent += 1
        dealer.close()
    return sent


def refuse_flood_leaves_metrics_bounded(seconds: float, max_frames: int, caplog, fault_record) -> None:
    toks = prompt(40, start=4)
    want = reference(toks, 6)
    caplog.set_level(logging.WARNING)
    with Pair(Side("prefill-0"), Side("decode-0")) as pair:
        assert pair.run("warm", toks, n=6).tokens == want
        before = pair.p.connector.stats()
        keys_before = _flat_keys(before)
        caplog.clear()
        t0 = time.monotonic()
        sent = _refuse_flood(pair.p.connector.port, seconds, max_frames)
        deadline = time.monotonic() + 60  # the side channel drains what was queued
        while sum(pair.p.connector.stats()["handshakes_refused"].values()) - sum(before["handshakes_refused"].values()) < sent:
            assert time.monotonic() < deadline, pair.p.connector.stats()["handshakes_refused"]
            time.sleep(0.1)
        seconds_taken = time.monotonic() - t0
        after = pair.p.connector.stats()
        new_keys = _flat_keys(after) - keys_before
        assert len(new_keys) <= 1, sorted(new_keys)[:10]  # at most the "other" bucket appears
        assert after["handshakes_refused"].get("other", 0) - before["handshakes_refused"].get("other", 0) == sent
        records = [r for r in caplog.records if r.name.startswith("connectors")]
        lines = [r.getMessage() for r in records]
        assert all("\n" not in m and "\r" not in m and len(m) < 600 for m in lines), [m for m in lines if "\n" in m][:3]
        # rate-limited, whatever the rate of frames: two limiters ("refused", "dropped") of 5 lines per
        # 10 s each, over however long this machine took to drain the flood
        assert len(records) <= 2 * 5 * (int(seconds_taken // 10) + 2), (len(records), seconds_taken)
        out = pair.run("after", toks, n=6)  # good transfers go on
        assert out.tokens == want and pair.d.scheduler.stats.num_load_failures_recomputed == 0
        pair.assert_all_free()
    fault_record(fault=f"{sent} REFUSE frames with new reasons and forged log lines", where="P side channel",
                 user_saw="correct tokens, KV transferred",
                 pdkv_did=f"counted under 'other' ({len(new_keys)} new metric key), {len(records)} log lines "
                          f"(single-line, rate-limited), {sent / seconds_taken:.0f} frames/s", pools="all free")


def test_refuse_flood_leaves_metrics_and_log_bounded(caplog, fault_record):
    refuse_flood_leaves_metrics_bounded(8.0, 100_000, caplog, fault_record)


@pytest.mark.slow
def test_refuse_flood_100k(caplog, fault_record):
    refuse_flood_leaves_metrics_bounded(600.0, 100_000, caplog, fault_record)


def test_idle_and_trickling_sockets_leave_transfers_working(fault_record):
    toks = [prompt(40 + 8 * i, start=i) for i in range(4)]
    wants = [reference(t, 6) for t in toks]
    with Pair(Side("prefill-0", timeout_s=2.0), Side("decode-0", timeout_s=5.0)) as pair:
        data_port = pair.p.connector.worker.producer.data_port
        holder = JunkHolder("127.0.0.1", data_port, 200)
        holder.start()
        try:
            assert holder.opened.wait(30)  # the junk is in place (and churning) before D's first ATTACH
            deadline = time.monotonic() + 10
            while holder.num_reopened < 50 and time.monotonic() < deadline:
                time.sleep(0.1)
            for i, t in enumerate(toks):
                out = pair.run(f"good-{i}", t, n=6, timeout_s=30)
                assert out.tokens == wants[i] and out.error is None
            assert pair.d.connector.stats()["loads_ok"] == len(toks)
            assert pair.d.scheduler.stats.num_load_failures_recomputed == 0
        finally:
            holder.stop.set()
            holder.join(10)
        # One trickler alone (under every cap): cut at the deadline for the whole ATTACH (2 s).
        probe = socket.create_connection(("127.0.0.1", data_port), timeout=2)
        probe.settimeout(0.3)
        t0, closed_s = time.monotonic(), None
        try:
            for k in range(len(TRICKLE)):
                if time.monotonic() - t0 > 8:
                    break
                probe.send(TRICKLE[k : k + 1])
                try:
                    if probe.recv(4096) == b"":
                        closed_s = time.monotonic() - t0
                        break
                except socket.timeout:
                    pass
        except OSError:
            closed_s = time.monotonic() - t0
        finally:
            probe.close()
        assert closed_s is not None and closed_s < 5.0, f"a trickled ATTACH was not cut (after {closed_s} s)"
        stats = pair.p.connector.stats()
        pair.assert_all_free()
    fault_record(fault="200 idle / trickling sockets held on the data port", where="P data port",
                 user_saw=f"{len(toks)} requests: correct tokens, KV transferred",
                 pdkv_did=f"pre-auth cap and whole-ATTACH deadline ({stats['handshakes_refused']}); "
                          f"{holder.num_reopened} reconnects", pools="all free")


def test_a_refused_hello_reveals_nothing_of_the_producer(fault_record):
    with Pair(Side("prefill-secret-7f3a"), Side("decode-0")) as pair:
        producer = pair.p.connector.worker.producer
        compat = producer.config.compat_hash
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{producer.port}")
        answers = []
        try:
            for expect, their_compat in (("guess", compat), ("guess", "0" * 64), ("prefill-secret-7f3a", "0" * 64)):
                dealer.send(wire.encode(MsgType.HELLO, engine_id="stranger", expect_engine_id=expect,
                                        compat=their_compat, nonce=b"n" * 16))
                assert dealer.poll(10_000), "no answer to a HELLO"
                answers.append(dealer.recv())
        finally:
            dealer.close()
        for raw in answers:
            msg_type, msg = wire.decode(raw)
            assert msg_type is MsgType.REFUSE, msg
            assert b"7f3a" not in raw and compat[:8].encode() not in raw, msg
        pair.assert_all_free()
    fault_record(fault="HELLO naming the wrong engine id or compatibility hash", where="P side channel",
                 user_saw="-", pdkv_did="refused; the REFUSE names neither P's engine id nor its hash", pools="all free")
