"""KV streaming (`transfer.streaming: chunk`) between two real engines with real ZMQ connectors
(layer mode's own tests, on this harness: `test_kv_layer_streaming.py`).

P prefills a streamed request in chunks and publishes the blocks each step completed; D, given
only P's address and request id, pulls every part as it is published. Engines are stepped from
this thread (P in a child process where it must die); the connectors' threads move the bytes over
real sockets. Every test ends with both pools all free (`kvcache.audit.assert_all_free`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import select
import subprocess
import sys
import time

import pytest
import torch

from connectors.params import make_stream_params
from connectors.zmq.connector import KVRole, ZmqConnector, ZmqConnectorConfig
from kvcache.audit import assert_all_free, check_invariants
from pd.engine.config import EngineConfig
from pd.engine.model.config import ModelConfig
from pd.engine.engine import Engine
from pd.engine.kv.layout import KVLayout
from pd.engine.sample.params import SamplingParams

torch.set_num_threads(1)

SECRET = b"streaming-secret-0123456789"
FULL = ModelConfig(num_layers=2)
HYBRID = ModelConfig(num_layers=3, layer_types=("full_attention", "sliding_attention", "full_attention"),
                     sliding_window=12)
PREFILL_ONLY = SamplingParams(max_tokens=1, ignore_eos=True)
STREAMED = {"do_remote_decode": True, "streaming": True}
CHUNK = 32  # a streamed prefill's largest step here: a 200-token prompt goes in 7 parts


def prompt(n: int, start: int = 3) -> list[int]:
    return [(start + 7 * i) % 250 for i in range(n)]


def make_engine(engine_id: str, role: KVRole | None, model: ModelConfig = FULL, block_size: int = 16,
                timeout_s: float = 2.0, policy: str = "recompute", data_path: str = "auto",
                num_blocks: int = 160, streaming: str = "chunk", layer_parts: int = 6,
                backend: str = "torch") -> Engine:
    config = EngineConfig(model=model, seed=5, block_size=block_size, num_blocks=num_blocks, max_num_batched_tokens=512,
                          max_num_seqs=16, kv_load_failure_policy=policy, engine_id=engine_id, attention_backend=backend)
    connector = None
    if role is not None:
        connector = ZmqConnector(ZmqConnectorConfig(
            engine_id=engine_id, role=role, secret=SECRET, model_id=f"tiny-{model.num_layers}@5", lease_s=10.0,
            handshake_timeout_s=timeout_s, transfer_timeout_s=timeout_s, io_timeout_s=timeout_s,
            data_path=data_path, streaming=streaming, stream_chunk_tokens=CHUNK, stream_layer_parts=layer_parts),
            KVLayout(model, block_size).kv_cache_groups())
    return Engine(config, connector=connector)


def colocated(tokens: list[int], params: SamplingParams, model: ModelConfig = FULL, block_size: int = 16) -> list[int]:
    eng = make_engine("reference", None, model, block_size)
    try:
        return eng.generate_sync({"ref": tokens}, params)["ref"]
    finally:
        eng.shutdown()


def stats(eng: Engine) -> dict:
    return eng.connector.stats()


class Drive:
    """Steps P (if any, in this process) and D until D's requests finish; collects D's outputs."""

    def __init__(self, p: Engine | None, d: Engine):
        self.p, self.d = p, d
        self.got: dict[str, dict] = {}

    def add(self, rid: str, tokens: list[int], params: SamplingParams, p_port: int, p_id: str = "prefill-0",
            on_p: bool = True) -> None:
        if on_p and self.p is not None:
            self.p.add_request(rid, tokens, PREFILL_ONLY, kv_transfer_params=dict(STREAMED))
        self.d.add_request(rid, tokens, params, kv_transfer_params=make_stream_params(p_id, "127.0.0.1", p_port, rid))
        self.got[rid] = {"tokens": [], "finished": False, "error": None, "cause": None}

    def start(self, rid: str, tokens: list[int], params: SamplingParams, num_p_steps: int | None = None) -> None:
        """D first: D alone runs until P's side channel has its WATCH for `rid`, then P gets the
        request, so every part P publishes reaches D as its own PUBLISHED. With `num_p_steps`, P
        then runs that many prefill steps (of two blocks: one part each) and D alone runs until
        it has landed them all: P is mid-prefill then, no pull in flight, on a fast or slow host."""
        assert self.p is not None
        self.add(rid, tokens, params, self.p.connector.port, on_p=False)
        publisher, deadline = self.p.connector.worker.producer.stream, time.monotonic() + 10
        while not publisher.is_watched(rid):
            assert time.monotonic() < deadline, "D's WATCH never reached P"
            self.step(p_too=False)
        self.p.add_request(rid, tokens, PREFILL_ONLY, kv_transfer_params=dict(STREAMED))
        if num_p_steps is None:
            return
        landed, published = stats(self.d)["stream_parts_received"], stats(self.p)["stream_parts_published"]
        for _ in range(num_p_steps):
            self.step_p_sealed()
        sealed = self.p.connector.worker.producer.leases.published(rid)
        while sealed is None or len(sealed.entries) < self._num_published(num_p_steps):  # (layer: a step's
            assert time.monotonic() < deadline, "P's parts were never sealed"  # slices seal one by one)
            time.sleep(0.002)
            sealed = self.p.connector.worker.producer.leases.published(rid)
        parts = stats(self.p)["stream_parts_published"] - published  # each a part on D once landed
        while stats(self.d)["stream_parts_received"] < landed + parts:  # (all landed: no pull in flight)
            assert time.monotonic() < deadline, "D landed no part"
            self.step(p_too=False)
        assert self.p.has_unfinished_requests()  # P still prefills: the stream is mid-way

    def stream_whole(self, rid: str, tokens: list[int], params: SamplingParams) -> None:
        """`start`, then P's steps one by one (each part told to D on its own) and D to the end."""
        self.start(rid, tokens, params)
        assert self.p is not None
        while rid not in self.p.scheduler.held:
            self.step_p_sealed()
        self.until_done()
        assert self.got[rid]["error"] is None

    def _num_published(self, num_p_steps: int) -> int:
        """Units P published in its first `num_p_steps` steps of two blocks each (layer: per slice)."""
        return num_p_steps * 2 * self.p.connector.scheduler.num_slices

    def step_p_sealed(self) -> None:
        """One P step that publishes a part, then waits until P's side channel sealed (and sent) it."""
        assert self.p is not None
        before, deadline = stats(self.p)["stream_parts_published"], time.monotonic() + 10
        self.p.step()
        while stats(self.p)["stream_parts_published"] == before:
            assert time.monotonic() < deadline, "P's part was never sealed"
            time.sleep(0.002)

    def step(self, p_too: bool = True) -> None:
        if p_too and self.p is not None and self.p.has_unfinished_requests():
            self.p.step()
        for o in self.d.step():
            g = self.got.get(o.request_id)
            if g is not None:
                g["tokens"] += o.new_token_ids
                if o.finished:
                    g.update(finished=True, error=o.error, cause=o.error_cause)
        if not self.d.scheduler.has_runnable_work():
            time.sleep(0.002)

    def until_done(self, timeout_s: float = 30.0, p_too: bool = True) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(g["finished"] for g in self.got.values()):
            assert time.monotonic() < deadline, f"not finished within {timeout_s}s: {self.got}"
            self.step(p_too)

    def settle(self, timeout_s: float = 15.0) -> None:
        """Steps until neither engine holds anything, then checks both pools are all free."""
        engines = [e for e in (self.p, self.d) if e is not None]
        deadline = time.monotonic() + timeout_s
        while any(e.has_unfinished_requests() for e in engines):
            assert time.monotonic() < deadline, "engines still hold requests"
            for e in engines:
                if e.has_unfinished_requests():
                    e.step()
            time.sleep(0.002)
        for e in engines:
            e.kv_cache_manager.reset_prefix_cache()
            check_invariants(e.kv_cache_manager)
            assert_all_free(e.kv_cache_manager)


@pytest.fixture
def pair():
    p = make_engine("prefill-0", KVRole.PRODUCER)
    d = make_engine("decode-0", KVRole.CONSUMER)
    yield p, d
    for e in (p, d):
        e.shutdown()


@pytest.mark.parametrize("sampling", [SamplingParams(max_tokens=8, ignore_eos=True),
                                      SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, seed=1234)],
                         ids=["greedy", "seeded"])
def test_streamed_load_in_parts_is_token_identical(pair, sampling):
    p, d = pair
    tokens = prompt(200)
    drive = Drive(p, d)
    drive.start("r1", tokens, sampling)
    while "r1" not in p.scheduler.held:  # one part per P step (the last: P's end), each told to D on its own
        drive.step_p_sealed()
    drive.until_done()
    assert drive.got["r1"]["error"] is None
    assert drive.got["r1"]["tokens"] == colocated(tokens, sampling)
    sent, got = stats(p), stats(d)
    assert sent["stream_parts_published"] == -(-200 // CHUNK)  # one part per prefill step
    assert got["stream_parts_received"] > 1 and got["loads_ok"] == 1 and not got["failures"]
    assert d.scheduler.stats.num_remote_tokens == 200  # nothing recomputed on D but the last token
    drive.settle()


def test_prefix_hit_on_d_pulls_only_the_missing_blocks(pair):
    p, d = pair
    shared = prompt(96)
    first, second = shared + prompt(40, 9), shared + prompt(70, 11)
    drive = Drive(p, d)
    drive.add("a", first, SamplingParams(max_tokens=4, ignore_eos=True), p.connector.port)
    drive.until_done()
    before = stats(d)["blocks_recv"]
    drive.add("b", second, SamplingParams(max_tokens=4, ignore_eos=True), p.connector.port)
    drive.until_done()
    pulled = stats(d)["blocks_recv"] - before
    assert pulled == -(-len(second) // 16) - 96 // 16  # D's 6-block prefix hit is not pulled again
    assert drive.got["b"]["tokens"] == colocated(second, SamplingParams(max_tokens=4, ignore_eos=True))
    drive.settle()


def test_sliding_window_groups_stream_only_the_final_window():
    p = make_engine("prefill-0", KVRole.PRODUCER, HYBRID, block_size=4)
    d = make_engine("decode-0", KVRole.CONSUMER, HYBRID, block_size=4)
    try:
        tokens = prompt(150)
        sampling = SamplingParams(max_tokens=6, ignore_eos=True)
        drive = Drive(p, d)
        drive.start("w", tokens, sampling)
        while "w" not in p.scheduler.held:  # a part per P step, each told to D on its own
            drive.step_p_sealed()
        drive.until_done()
        assert drive.got["w"]["error"] is None
        assert drive.got["w"]["tokens"] == colocated(tokens, sampling, HYBRID, 4)
        num_full = -(-150 // 4)
        keep = -(-12 // 4) + 1  # the window's blocks, plus the one it starts in
        assert stats(d)["blocks_recv"] == num_full + keep  # full-attention group, and the window only
        assert stats(d)["stream_parts_received"] > 1
        drive.settle()
    finally:
        for e in (p, d):
            e.shutdown()


def test_a_part_that_never_arrives_is_recomputed(pair):
    """P stops after its first steps (frozen): D's progress deadline ends the load, D recomputes."""
    p, d = pair
    tokens = prompt(200, 5)
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    drive = Drive(p, d)
    drive.start("stall", tokens, sampling, num_p_steps=2)  # P runs until D has landed a part, then freezes
    started = time.monotonic()
    drive.until_done(p_too=False)
    waited = time.monotonic() - started
    assert drive.got["stall"]["error"] is None and drive.got["stall"]["tokens"] == colocated(tokens, sampling)
    assert stats(d)["failures"] == {"timeout": 1} and d.scheduler.stats.num_load_failures_recomputed == 1
    assert waited >= d.connector.config.transfer_timeout_s * 0.9  # the deadline, not a quicker path, ended it
    p.abort_request("stall")  # (the router would: D answered) P's lease ends, its blocks go
    drive.settle()


def test_a_part_that_never_arrives_fails_with_the_fail_policy():
    p = make_engine("prefill-0", KVRole.PRODUCER)
    d = make_engine("decode-0", KVRole.CONSUMER, policy="fail")
    try:
        drive = Drive(None, d)
        drive.add("never", prompt(64), SamplingParams(max_tokens=4), p.connector.port)  # P never gets it
        drive.until_done()
        assert drive.got["never"]["error"] is not None and drive.got["never"]["cause"] == "timeout"
        drive.settle()
        producer = p.connector.worker.producer
        deadline = time.monotonic() + 5  # D's DONE (after its failed load) reaches P's side channel
        while not producer.leases.stream_closed("never"):
            assert time.monotonic() < deadline, "P never heard D's DONE"
            time.sleep(0.01)
        late = Drive(p, d)  # P gets the request only now: it must lease nothing for a consumer gone
        p.add_request("never", prompt(64), PREFILL_ONLY, kv_transfer_params=dict(STREAMED))
        while p.has_unfinished_requests() and not p.scheduler.held:
            assert time.monotonic() < deadline + 10
            p.step()
        assert not p.scheduler.held and stats(p)["stream_parts_published"] == 0  # freed at once, not at expiry
        late.settle()
    finally:
        for e in (p, d):
            e.shutdown()


def test_abort_mid_stream_frees_both_sides(pair):
    p, d = pair
    tokens = prompt(240, 7)
    drive = Drive(p, d)
    drive.start("gone", tokens, SamplingParams(max_tokens=8, ignore_eos=True), num_p_steps=2)
    d.abort_request("gone")  # the client left (the router aborts P as well: not needed here)
    drive.settle()  # P prefills on, publishes no more, and frees its blocks when it ends
    assert stats(p)["leases_ended"] == {"done": 1}  # D's cancel told P at once
    assert stats(d)["failures"] == {"shutdown": 1} and not d.has_unfinished_requests()
    # the next streamed request on the same pair goes through whole
    drive2 = Drive(p, d)
    drive2.add("next", tokens, SamplingParams(max_tokens=4, ignore_eos=True), p.connector.port)
    drive2.until_done()
    assert drive2.got["next"]["tokens"] == colocated(tokens, SamplingParams(max_tokens=4, ignore_eos=True))
    drive2.settle()


def test_lease_ended_mid_prefill_keeps_blocks_until_its_pull_drains(pair):
    """D's DONE (or expiry) ends a streamed lease while one of its pulls still reads a block:
    the prefill, when it ends, hands its blocks back only once that pull is over."""
    from connectors.metrics import LeaseEnd

    p, d = pair
    producer = p.connector.worker.producer
    p.add_request("drain", prompt(200, 4), PREFILL_ONLY, kv_transfer_params=dict(STREAMED))
    p.step()  # the first part: the lease is created
    deadline = time.monotonic() + 5
    while (published := producer.leases.published("drain")) is None:  # sealed by the side channel
        assert time.monotonic() < deadline
        time.sleep(0.01)
    lease = producer.leases.begin_pull("drain", [published.entries[0][2]])  # a pull in flight (as a data stream does)
    assert producer.leases.end("drain", LeaseEnd.DONE)  # draining: the pull still reads
    while p.has_unfinished_requests() and "drain" not in p.scheduler.held:
        assert time.monotonic() < deadline + 10
        p.step()
    assert "drain" in p.scheduler.held  # the prefill is over; its blocks wait for the pull
    producer.leases.end_pull(lease)
    Drive(p, d).settle()


def test_p_fails_a_streamed_request_it_would_preempt_and_d_recomputes():
    """P runs out of blocks with two streamed prefills: the one it would preempt (its published
    blocks are leased) fails instead, D is told and recomputes it; nothing is preempted."""
    p = make_engine("prefill-0", KVRole.PRODUCER, num_blocks=48)
    d = make_engine("decode-0", KVRole.CONSUMER)
    try:
        drive, sampling = Drive(p, d), SamplingParams(max_tokens=4, ignore_eos=True)
        first, second = prompt(400, 3), prompt(400, 6)  # 25 blocks each: both do not fit in 47
        drive.start("first", first, sampling)
        drive.start("second", second, sampling)
        drive.until_done()
        assert drive.got["first"]["tokens"] == colocated(first, sampling)
        assert drive.got["second"]["tokens"] == colocated(second, sampling)
        assert p.scheduler.stats.num_preemptions == 0 and p.scheduler.stats.num_errors == 1
        # D learns it either from P's PUBLISHED(ok=false) or, when its pull got there first, from P
        # refusing the pull of an ended lease: one failed load, recomputed, either way
        assert stats(d)["failures"] in ({"peer_gone": 1}, {"pull_refused": 1})
        assert d.scheduler.stats.num_load_failures_recomputed == 1
        drive.settle()
    finally:
        for e in (p, d):
            e.shutdown()


def test_a_watch_naming_a_request_twice_is_answered_once():
    """An authenticated peer's WATCH listing one request many times gets one PUBLISHED, not one per name."""
    from connectors.metrics import TransferMetrics
    from connectors.zmq.producer.leases import LeaseTable
    from connectors.zmq.control.session import ProducerSession
    from connectors.zmq.streaming.publisher import StreamPublisher

    metrics = TransferMetrics()
    leases = LeaseTable(10.0, metrics)
    publisher = StreamPublisher(leases, lambda ids: [7 * b for b in ids], metrics)
    try:
        sent: list[bytes] = []
        assert publisher.publish("r", [(0, 0, 5), (0, 1, 6)], False)
        publisher.flush(lambda ident, payload: sent.append(payload))
        publisher.watch(ProducerSession(b"s" * 16, b"k" * 32, b"c", "decode-0", 0.0), ["r"] * 1000,
                        lambda ident, payload: sent.append(payload))
        assert len(sent) == 1
    finally:
        publisher.close()


def _publisher(max_watchers: int = 4096):
    from connectors.metrics import TransferMetrics
    from connectors.zmq.producer.leases import LeaseTable
    from connectors.zmq.streaming.publisher import StreamPublisher

    metrics = TransferMetrics()
    leases = LeaseTable(10.0, metrics)
    return StreamPublisher(leases, lambda ids: [7 * b for b in ids], metrics, max_watchers), leases, metrics


def _session(name: bytes):
    from connectors.zmq.control.session import ProducerSession

    return ProducerSession(name * 16, b"k" * 32, name, "decode-" + name.decode(), 0.0)


def test_a_watched_request_cannot_be_taken_or_ended_by_another_session():
    """The first live session that WATCHes a request owns its stream: another authenticated peer's
    WATCH gets nothing and diverts nothing, and its DONE ends neither the stream nor the lease."""
    from connectors.zmq.control import wire

    publisher, leases, metrics = _publisher()
    try:
        sent: list[tuple[bytes, bytes]] = []
        def send(ident, payload):
            sent.append((ident, payload))
        owner, stranger = _session(b"a"), _session(b"b")
        assert publisher.publish("r", [(0, 0, 5)], False)
        publisher.flush(send)  # sealed; nobody watches yet
        publisher.watch(owner, ["r"], send)
        publisher.watch(stranger, ["r"], send)
        assert [ident for ident, _ in sent] == [b"a"]  # the owner got what was published; the stranger nothing
        assert publisher.forget(stranger, ["r"]) == [] and leases.holds("r")
        assert publisher.publish("r", [(0, 1, 6)], True)
        publisher.flush(send)
        assert [ident for ident, _ in sent] == [b"a", b"a"]
        assert wire.decode(sent[-1][1])[1]["block_ids"] == [6]
        assert metrics.snapshot()["handshakes_refused"] == {"claimed": 2}
        owner.closed = True  # a session that ended no longer holds its claim
        publisher.watch(stranger, ["q"], send)
        assert publisher.is_watched("q")
    finally:
        publisher.close()


def test_live_watchers_are_capped():
    """An authenticated peer cannot grow the watcher table past max_watchers with WATCHes for ids
    that never come: the WATCH past it is refused and counted, and the ones before keep working."""
    publisher, _, metrics = _publisher(max_watchers=3)
    try:
        session = _session(b"a")
        publisher.watch(session, [f"r{i}" for i in range(10)], lambda ident, payload: None)
        assert [publisher.is_watched(f"r{i}") for i in range(10)] == [True] * 3 + [False] * 7
        assert metrics.snapshot()["handshakes_refused"] == {"capacity": 7}
        publisher.watch(session, ["r0"], lambda ident, payload: None)  # one already watched: renewed, not refused
        assert metrics.snapshot()["handshakes_refused"] == {"capacity": 7}
        assert publisher.forget(session, ["r1"]) == ["r1"] and not publisher.is_watched("r1")
        publisher.watch(session, ["r9"], lambda ident, payload: None)
        assert publisher.is_watched("r9")
    finally:
        publisher.close()


def test_p_aborted_mid_stream_tells_d_which_recomputes(pair):
    """P's request ends badly mid-stream (aborted there): its lease ends at once and D is told, so
    D's load fails now (not at its deadline) and the policy recomputes the prompt."""
    p, d = pair
    tokens = prompt(240, 8)
    sampling = SamplingParams(max_tokens=5, ignore_eos=True)
    drive = Drive(p, d)
    drive.start("p-gone", tokens, sampling, num_p_steps=2)
    p.abort_request("p-gone")
    drive.until_done()  # (the cause below says the notice, not the deadline, ended the load)
    assert drive.got["p-gone"]["tokens"] == colocated(tokens, sampling)
    assert stats(p)["leases_ended"] == {"aborted": 1}
    assert stats(d)["failures"] == {"peer_gone": 1} and d.scheduler.stats.num_load_failures_recomputed == 1
    drive.settle()


_P_PROC = r"""
import json, sys
from test_kv_streaming import KVRole, PREFILL_ONLY, STREAMED, make_engine
p = make_engine("prefill-0", KVRole.PRODUCER, data_path="tcp", streaming={streaming!r})
print(json.dumps({{"port": p.connector.port}}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["cmd"] == "add":
        p.add_request(cmd["rid"], cmd["tokens"], PREFILL_ONLY, kv_transfer_params=dict(STREAMED))
    for _ in range(cmd.get("steps", 0)):
        p.step()
    print(json.dumps({{"computed": p.scheduler.requests[cmd["rid"]].request.num_computed_tokens}}), flush=True)
"""


def _ask(proc: subprocess.Popen, timeout_s: float = 30, **cmd) -> dict:
    if cmd:
        proc.stdin.write(json.dumps(cmd) + "\n")
        proc.stdin.flush()
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"P did not answer {cmd}"
    return json.loads(proc.stdout.readline())


@pytest.mark.parametrize("streaming", ["chunk", "layer"])
def test_killed_p_mid_stream_is_recomputed(streaming):
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # run in this folder: `python -c` puts the working directory on sys.path, so the child imports this module
    proc = subprocess.Popen([sys.executable, "-c", _P_PROC.format(streaming=streaming)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=here)
    d = make_engine("decode-0", KVRole.CONSUMER, timeout_s=5.0, streaming=streaming)
    try:
        port = _ask(proc, 60)["port"]
        tokens = prompt(256, 2)
        sampling = SamplingParams(max_tokens=6, ignore_eos=True)
        drive = Drive(None, d)
        drive.add("killed", tokens, sampling, port)
        computed = _ask(proc, cmd="add", rid="killed", tokens=tokens, steps=2)["computed"]
        assert 0 < computed < len(tokens)  # mid-prefill
        deadline = time.monotonic() + 10
        while stats(d)["stream_parts_received"] < 1:
            assert time.monotonic() < deadline
            drive.step()
        proc.kill()
        proc.wait(10)
        drive.until_done()
        assert drive.got["killed"]["tokens"] == colocated(tokens, sampling)
        # D learns it either from P's PUBLISHED(ok=false) or, when its pull got there first, from P
        # refusing the pull of an ended lease: one failed load, recomputed, either way
        assert stats(d)["failures"] in ({"peer_gone": 1}, {"pull_refused": 1})
        assert d.scheduler.stats.num_load_failures_recomputed == 1
        drive.settle()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for f in (proc.stdin, proc.stdout):
            f.close()
        d.shutdown()


def test_streaming_config_and_params_are_checked_at_the_edge():
    from pydantic import ValidationError

    from connectors.params import InvalidKVParams, TransferParams, parse_remote_prefill
    from pd.cluster.config import TransferSection

    assert TransferSection().streaming == "off"  # the default: the flow as before
    assert TransferSection(streaming="chunk", stream_chunk_tokens=64).transfer_settings().stream_chunk_tokens == 64
    assert TransferSection(streaming="layer", stream_layer_parts=4).transfer_settings().stream_layer_parts == 4
    for bad in ({"streaming": "layers"}, {"streaming": True}, {"stream_chunk_tokens": 0},
                {"stream_layer_parts": 0}, {"stream_layer_parts": 65}):
        with pytest.raises(ValidationError):
            TransferSection(**bad)
    params = make_stream_params("prefill-0", "127.0.0.1", 5555, "r")
    assert parse_remote_prefill(params, 2).streamed
    for bad in ({"remote_block_ids": ((1,), (2,))}, {"remote_port": 0}):
        with pytest.raises(InvalidKVParams):
            parse_remote_prefill(dataclasses.replace(params, **bad), 2)
    with pytest.raises(InvalidKVParams):
        TransferParams.from_dict({**params.to_dict(), "streaming": 1})


def test_published_frames_are_bound_to_their_session():
    from connectors.zmq.control import wire
    from connectors.zmq.control.session import ClientSession, ProducerSession

    key, sid = b"k" * 32, b"s" * 16
    producer, consumer = ProducerSession(sid, key, b"c", "decode-0", 0.0), ClientSession(sid, key)
    fields = {"request_id": "r", "groups": [0], "positions": [3], "block_ids": [9], "digests": [123],
              "final": False, "ok": True}
    first = wire.decode(producer.published_message(fields))[1]
    consumer.check_published(first)
    with pytest.raises(wire.MalformedMessage):  # replayed
        consumer.check_published(first)
    forged = wire.decode(producer.published_message(fields))[1]
    forged["block_ids"] = [10]
    with pytest.raises(wire.MalformedMessage):  # altered: the MAC no longer matches
        consumer.check_published(forged)
    other = wire.decode(ProducerSession(sid, b"x" * 32, b"c", "d", 0.0).published_message(fields))[1]
    other["seq"] = 99
    with pytest.raises(wire.MalformedMessage):  # another key
        consumer.check_published(other)
