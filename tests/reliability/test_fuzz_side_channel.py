"""Fuzzing a LIVE KV side channel and data port while good transfers go on.

Random and mutated msgpack frames (garbage, truncations, bit flips, wrong
versions, unknown types, missing or mistyped fields, refused handshakes,
heartbeats with forged sessions, multi-part frames) hit the producer's ZMQ
side channel from many identities, and junk connections hit its data port,
while real requests run through P and D. Good transfers must keep moving the
KV (no recompute) and give the reference tokens; the producer must count the
malformed frames and keep serving; both pools end all free.
"""
from __future__ import annotations

import dataclasses
import random
import socket
import threading
import time

import msgpack
import pytest
import zmq

from connectors.zmq.control import wire
from connectors.zmq.control.wire import MsgType
from rel_pair import Pair, Side, prompt, reference

FIELD_VALUES = [None, True, -1, 0, (1 << 64) - 1, 3.5, "", "x" * 300, b"", b"\x00" * 40, [], [1, -2], ["a"], {}, {"a": 1}]


def valid_frame(rng: random.Random) -> bytes:
    t = rng.choice(list(MsgType))
    fields = {}
    for name, kind in wire.SCHEMA[t].items():
        fields[name] = {str: "fuzz", bytes: rng.randbytes(16), int: rng.randrange(1 << 16), bool: True}.get(
            kind, ["fuzz"] if kind is wire.STR_LIST else [rng.randrange(100)])
    return wire.encode(t, **fields)


def malformed_frame(rng: random.Random) -> bytes:
    """A frame the producer cannot accept as a well-formed message of its protocol."""
    kind = rng.randrange(8)
    if kind == 0:
        return rng.randbytes(rng.randrange(1, 200))
    base = valid_frame(rng)
    if kind == 1:
        return base[: rng.randrange(1, len(base))]  # truncated
    if kind == 2:  # wrong protocol version
        return msgpack.packb({"v": rng.choice([0, 2, "1", None]), "t": "hello"})
    if kind == 3:  # unknown type
        return msgpack.packb({"v": wire.PROTOCOL_VERSION, "t": rng.choice(["", "HELLO", "nope", 7])})
    if kind == 4:  # a field missing
        obj = msgpack.unpackb(base)
        fields = [k for k in obj if k not in ("v", "t")]
        if fields:
            obj.pop(rng.choice(fields))
        else:
            obj["t"] = "pull"
        return msgpack.packb(obj, use_bin_type=True)
    if kind == 5:  # a field of the wrong type
        obj = msgpack.unpackb(base)
        fields = [k for k in obj if k not in ("v", "t")]
        if not fields:
            return b"\xc1"  # never-used msgpack byte
        name = rng.choice(fields)
        kind_wanted = wire.SCHEMA[MsgType(obj["t"])][name]
        bad = [v for v in FIELD_VALUES if not _fits(v, kind_wanted)]
        obj[name] = rng.choice(bad)
        return msgpack.packb(obj, use_bin_type=True)
    if kind == 6:  # an extension type (never allowed)
        return msgpack.packb({"v": 1, "t": "hello", "x": msgpack.ExtType(5, b"boom")})
    # not a map at all
    return msgpack.packb(rng.choice([[1, 2, 3], "hello", 42, None, b"bytes"]), use_bin_type=True)


def _fits(value, kind) -> bool:
    if kind is wire.INT_LIST:
        return isinstance(value, list) and all(type(x) is int and x >= 0 for x in value)
    if kind is wire.STR_LIST:
        return isinstance(value, list) and all(isinstance(x, str) for x in value)
    if kind is int:
        return type(value) is int and value < (1 << 64)
    return isinstance(value, kind)


def side_frames_refused(rng: random.Random) -> bytes:
    """Well-formed messages the producer must refuse (forged sessions, AUTH without challenge)."""
    return rng.choice([
        wire.encode(MsgType.HEARTBEAT, session=rng.randbytes(16), seq=1, mac=rng.randbytes(32), request_ids=["r"]),
        wire.encode(MsgType.DONE, session=rng.randbytes(16), seq=2, mac=rng.randbytes(32), request_ids=["r1", "x"]),
        wire.encode(MsgType.AUTH, proof=rng.randbytes(32)),
    ])


class Fuzzer(threading.Thread):
    def __init__(self, port: int, data_port: int, num_frames: int, seed: int):
        super().__init__(daemon=True, name="fuzzer")
        self.port, self.data_port, self.num_frames, self.rng = port, data_port, num_frames, random.Random(seed)
        self.num_malformed = 0
        self.num_refused = 0
        self.num_data_conns = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        rng, sent = self.rng, 0
        while sent < self.num_frames:
            dealer = ctx.socket(zmq.DEALER)  # a new identity every 500 frames
            dealer.setsockopt(zmq.LINGER, 10_000)  # close() delivers what is still queued (bounded)
            dealer.setsockopt(zmq.SNDTIMEO, 5000)
            dealer.setsockopt(zmq.RCVHWM, 10)
            dealer.connect(f"tcp://127.0.0.1:{self.port}")
            for _ in range(min(500, self.num_frames - sent)):
                r = rng.random()
                if r < 0.85:
                    dealer.send(malformed_frame(rng))
                    self.num_malformed += 1
                elif r < 0.95:
                    dealer.send(side_frames_refused(rng))
                    self.num_refused += 1
                else:
                    dealer.send_multipart([b"two", b"frames"])
                    self.num_malformed += 1
                sent += 1
            dealer.close()
            self._data_junk(rng)

    def _data_junk(self, rng: random.Random) -> None:
        try:
            s = socket.create_connection(("127.0.0.1", self.data_port), timeout=2)
        except OSError:
            return
        self.num_data_conns += 1
        try:
            junk = rng.choice([rng.randbytes(64), (3).to_bytes(4, "big") + b"abc",
                               wire.encode(MsgType.ATTACH, session=rng.randbytes(16), mode="tcp", mac=rng.randbytes(32))])
            s.sendall(junk if junk[:1] != b"\x82" else len(junk).to_bytes(4, "big") + junk)
        except OSError:
            pass
        finally:
            s.close()


def fuzz_while_serving(num_frames: int, fault_record) -> None:
    toks = [prompt(40 + 9 * i, start=i) for i in range(4)]
    wants = [reference(t, 6) for t in toks]
    with Pair(Side("prefill-0", lease_s=10.0), Side("decode-0")) as pair:
        before = pair.p.connector.stats()
        fuzzer = Fuzzer(pair.p.connector.port, pair.p.connector.worker.producer.data_port, num_frames, seed=num_frames)
        t0 = time.monotonic()
        fuzzer.start()
        served = 0
        while fuzzer.is_alive() or served < 4:
            i = served % len(toks)
            out = pair.run(f"good-{served}", toks[i], n=6, timeout_s=30)
            assert out.tokens == wants[i] and out.error is None
            served += 1
        fuzzer.join(60)
        assert fuzzer.error is None, fuzzer.error
        deadline = time.monotonic() + 30  # the side channel drains the queued frames
        while pair.p.connector.stats()["malformed_frames"] - before["malformed_frames"] < fuzzer.num_malformed:
            assert time.monotonic() < deadline, (pair.p.connector.stats(), fuzzer.num_malformed)
            time.sleep(0.1)
        seconds = time.monotonic() - t0
        after = pair.p.connector.stats()
        malformed = after["malformed_frames"] - before["malformed_frames"]
        refused = sum(after["handshakes_refused"].values()) - sum(before["handshakes_refused"].values())
        assert refused >= fuzzer.num_refused * 0.5  # refusals are answered; some AUTHs are just dropped
        assert pair.d.scheduler.stats.num_load_failures_recomputed == 0  # every good request moved its KV
        assert pair.d.connector.stats()["loads_ok"] == served
        # the side channel still accepts a fresh handshake after the storm
        fresh = pair.run("after-fuzz", toks[0], n=6)
        assert fresh.tokens == wants[0]
        pair.assert_all_free()
    fault_record(fault=f"fuzzed side channel: {num_frames} frames + {fuzzer.num_data_conns} junk data connections",
                 where="P side channel / data port",
                 user_saw=f"{served + 1} concurrent good requests: correct tokens, KV transferred",
                 pdkv_did=f"{malformed} malformed frames counted and dropped, {refused} refused; no crash "
                          f"({num_frames / seconds:.0f} frames/s)",
                 pools="all free")


def test_fuzz_side_channel_short(fault_record):
    fuzz_while_serving(3000, fault_record)


@pytest.mark.slow
def test_fuzz_side_channel_100k(fault_record):
    fuzz_while_serving(100_000, fault_record)


def test_consumer_survives_a_hostile_producer(fault_record):
    """D is pointed at a 'producer' that answers every message with random and mutated frames
    (forged challenges and welcomes included): D's load fails cleanly, D recomputes, and its
    next transfer from the real producer still moves the KV."""
    ctx = zmq.Context.instance()
    hostile = ctx.socket(zmq.ROUTER)
    hostile.setsockopt(zmq.LINGER, 0)
    port = hostile.bind_to_random_port("tcp://127.0.0.1")
    stop, sent = threading.Event(), [0]

    def serve():
        rng = random.Random(11)
        while not stop.is_set():
            if hostile.poll(50):
                ident = hostile.recv_multipart()[0]
                for _ in range(100):
                    frame = malformed_frame(rng) if rng.random() < 0.7 else valid_frame(rng)
                    try:
                        hostile.send_multipart([ident, frame], zmq.NOBLOCK)
                        sent[0] += 1
                    except zmq.ZMQError:
                        break

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    toks = prompt(50, start=5)
    want = reference(toks, 6)
    try:
        with Pair(Side("prefill-0", lease_s=3.0), Side("decode-0", timeout_s=1.0)) as pair:
            params = dataclasses.replace(pair.prefill("r1", toks), remote_port=port)  # the router was lied to
            outs = {"r1": pair.add_decode("r1", toks, params, 6)}
            pair.drive(outs, timeout_s=20)
            assert outs["r1"]["tokens"] == want and pair.d.scheduler.stats.num_load_failures_recomputed == 1
            stats = pair.d.connector.stats()
            assert stats["malformed_frames"] + sum(stats["handshakes_refused"].values()) >= 1
            good = pair.run("r2", toks, n=6)
            assert good.tokens == want and pair.d.connector.stats()["loads_ok"] == 1
            pair.assert_all_free(timeout_s=15)  # r1's lease on the real P expires (3 s)
    finally:
        stop.set()
        thread.join(5)
        hostile.close()
    fault_record(fault=f"hostile producer: {sent[0]} random/forged frames to D", where="D consumer side channel",
                 user_saw="correct tokens", pdkv_did=f"load failed cleanly ({stats['failures']}, "
                 f"{stats['malformed_frames']} malformed, refused {stats['handshakes_refused']}); recomputed; "
                 "next transfer fine", pools="all free")
