"""Layer streaming (`transfer.streaming: layer`) between two real engines with real ZMQ connectors.

P publishes each prefill step's blocks slice by slice of layers while its forward runs; D pulls
every slice as it is published. The harness (engines stepped from this thread, real sockets, pools
checked all free at the end) is `test_kv_streaming.py`'s; the killed-P case is parametrized there.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import torch

from connectors.zmq.connector import KVRole
from connectors.zmq.streaming.layer_slices import LayerClock, SlicedPages, blocks_of, choose_num_slices, units
from pd.engine.model.config import ModelConfig
from pd.engine.engine import Engine
from pd.engine.kv.layout import KVLayout
from pd.engine.kv.page_pool import PagePool
from pd.engine.sample.params import SamplingParams
from test_kv_streaming import CHUNK, FULL, HYBRID, PREFILL_ONLY, Drive, colocated, make_engine, prompt, stats

FOUR = ModelConfig(num_layers=4)


@contextlib.contextmanager
def layer_engines(model: ModelConfig = FULL, parts: int = 2, d_parts: int | None = None, block_size: int = 16,
                  backend: str = "torch", data_path: str = "auto") -> Iterator[tuple[Engine, Engine]]:
    """P and D with layer streaming (D cutting pages into `d_parts`, default P's), shut down after."""
    p = make_engine("prefill-0", KVRole.PRODUCER, model, block_size, streaming="layer", layer_parts=parts,
                    backend=backend, data_path=data_path)
    d = make_engine("decode-0", KVRole.CONSUMER, model, block_size, streaming="layer",
                    layer_parts=parts if d_parts is None else d_parts, data_path=data_path)
    try:
        yield p, d
    finally:
        for e in (p, d):
            e.shutdown()


def record_publications(p) -> list[tuple[int, set[int]]]:
    """Each publication P's engine makes: (layers its forward has run so far, slices it names)."""
    calls: list[tuple[int, set[int]]] = []
    ran = [0]
    layers = p.runner.model.model.layers
    layers[0].register_forward_pre_hook(lambda *_: ran.__setitem__(0, 0))
    for layer in layers:
        layer.register_forward_hook(lambda *_: ran.__setitem__(0, ran[0] + 1))
    stream, n = p.connector.worker.producer.stream, p.connector.scheduler.num_slices
    publish = stream.publish

    def recorded(rid, entries, final):
        calls.append((ran[0], {pos % n for _, pos, _ in entries}))
        return publish(rid, entries, final)

    stream.publish = recorded
    return calls


def test_slices_and_units():
    assert [choose_num_slices(30, k) for k in (1, 4, 6, 7, 64)] == [1, 3, 6, 6, 30]
    assert units([3, 5], 3) == [9, 10, 11, 15, 16, 17] and blocks_of([9, 11, 16], 3) == {3, 5}
    clock = LayerClock.from_groups(KVLayout(HYBRID, 4).kv_cache_groups(), 2)
    assert clock.last == ((0, 2), (1, -1))  # full: layers 0 | 2; sliding: layer 1 | nothing
    assert clock.first_due() == [(1, 1)] and clock.due_after(2) == [(0, 1)]
    pool = PagePool(8, KVLayout(FULL, 16).page_size_bytes, torch.device("cpu"))
    view = SlicedPages(pool, 2)
    pool.buffer[3].fill_(7)
    assert view.num_blocks == 16 and view.buffer[6:8].eq(7).all() and not view.buffer[5].any()
    with pytest.raises(ValueError, match="does not cut"):
        SlicedPages(pool, 7)


@pytest.mark.parametrize("sampling", [SamplingParams(max_tokens=8, ignore_eos=True),
                                      SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, seed=1234)],
                         ids=["greedy", "seeded"])
def test_each_slice_is_published_after_its_layers_and_tokens_match(sampling):
    with layer_engines(FOUR, parts=4) as (p, d):
        calls = record_publications(p)
        tokens = prompt(200)
        drive = Drive(p, d)
        drive.stream_whole("r1", tokens, sampling)
        assert drive.got["r1"]["tokens"] == colocated(tokens, sampling, FOUR)
        # every step published slice k alone, right after layer k ran (while layers k+1.. had not)
        steps = -(-200 // CHUNK)
        named = [c for c in calls if c[1]]
        assert named == [(k + 1, {k}) for _ in range(steps) for k in range(4)]
        got = stats(d)
        assert got["blocks_recv"] == 4 * -(-200 // 16) and got["loads_ok"] == 1 and not got["failures"]
        assert 1 < got["stream_parts_received"] <= 4 * steps  # (slices sealed at once travel as one part)
        assert d.scheduler.stats.num_remote_tokens == 200
        drive.settle()


def test_a_forward_of_all_layers_at_once_publishes_after_the_step():
    """The fused kernel runs every layer in one call: its step's slices go when the step is over."""
    from pd.engine.runner.selector import select_backend

    if select_backend("auto", torch.device("cpu"), torch.float32) != "fused":
        pytest.skip("the fused CPU kernel cannot be built here")
    with layer_engines(FULL, parts=2, backend="fused") as (p, d):
        calls = record_publications(p)
        tokens = prompt(100, 4)
        sampling = SamplingParams(max_tokens=5, ignore_eos=True)
        drive = Drive(p, d)
        drive.stream_whole("f", tokens, sampling)
        assert drive.got["f"]["tokens"] == colocated(tokens, sampling)
        assert p.runner.backend.capabilities.name == "fused"
        assert all(ran in (0, 2) and slices == {0, 1} for ran, slices in calls if slices)  # whole steps
        assert stats(d)["blocks_recv"] == 2 * -(-100 // 16) and not stats(d)["failures"]
        drive.settle()


def test_prefix_hit_on_d_pulls_only_the_missing_slices():
    with layer_engines() as (p, d):
        shared = prompt(96)
        second = shared + prompt(70, 11)
        drive = Drive(p, d)
        drive.add("a", shared + prompt(40, 9), SamplingParams(max_tokens=4, ignore_eos=True), p.connector.port)
        drive.until_done()
        before = stats(d)["blocks_recv"]
        drive.add("b", second, SamplingParams(max_tokens=4, ignore_eos=True), p.connector.port)
        drive.until_done()
        assert stats(d)["blocks_recv"] - before == 2 * (-(-len(second) // 16) - 96 // 16)
        assert drive.got["b"]["tokens"] == colocated(second, SamplingParams(max_tokens=4, ignore_eos=True))
        drive.settle()


def test_sliding_window_groups_stream_only_the_final_window():
    with layer_engines(HYBRID, parts=2, block_size=4) as (p, d):
        tokens = prompt(150)
        sampling = SamplingParams(max_tokens=6, ignore_eos=True)
        drive = Drive(p, d)
        drive.stream_whole("w", tokens, sampling)
        assert drive.got["w"]["tokens"] == colocated(tokens, sampling, HYBRID, 4)
        keep = -(-12 // 4) + 1  # the window's blocks, plus the one it starts in
        assert stats(d)["blocks_recv"] == 2 * (-(-150 // 4) + keep)
        drive.settle()


def test_a_slice_that_never_arrives_is_recomputed():
    with layer_engines() as (p, d):
        tokens = prompt(200, 5)
        sampling = SamplingParams(max_tokens=6, ignore_eos=True)
        drive = Drive(p, d)
        drive.start("stall", tokens, sampling, num_p_steps=2)  # P freezes mid-prefill
        drive.until_done(p_too=False)
        assert drive.got["stall"]["tokens"] == colocated(tokens, sampling)
        assert stats(d)["failures"] == {"timeout": 1} and d.scheduler.stats.num_load_failures_recomputed == 1
        p.abort_request("stall")
        drive.settle()


def test_abort_mid_stream_frees_both_sides():
    with layer_engines() as (p, d):
        tokens = prompt(240, 7)
        drive = Drive(p, d)
        drive.start("gone", tokens, SamplingParams(max_tokens=8, ignore_eos=True), num_p_steps=2)
        d.abort_request("gone")
        drive.settle()
        assert stats(p)["leases_ended"] == {"done": 1}
        assert stats(d)["failures"] == {"shutdown": 1} and not d.has_unfinished_requests()


def test_sides_that_cut_pages_differently_refuse_each_other():
    with layer_engines(FOUR, parts=4, d_parts=2) as (p, d):
        tokens = prompt(64, 6)
        sampling = SamplingParams(max_tokens=4, ignore_eos=True)
        drive = Drive(p, d)
        drive.add("cut", tokens, sampling, p.connector.port)
        deadline = time.monotonic() + 30
        while not drive.got["cut"]["finished"]:
            assert time.monotonic() < deadline
            drive.step()
        assert drive.got["cut"]["tokens"] == colocated(tokens, sampling, FOUR)  # recomputed on D
        assert stats(d)["failures"] == {"handshake_refused": 1}
        p.abort_request("cut")
        drive.settle()


@pytest.mark.parametrize("data_path", ["auto", "tcp"])
def test_a_whole_load_in_a_layer_deployment_moves_slices(data_path):
    """The `off` flow in a layer-mode deployment (a router's first request, before it knows P
    streams): P leases its blocks' slices at the end, D pulls them all, the same tokens."""
    with layer_engines(FOUR, parts=4, data_path=data_path) as (p, d):
        tokens = prompt(120, 8)
        sampling = SamplingParams(max_tokens=6, ignore_eos=True)
        p.add_request("whole", tokens, PREFILL_ONLY, kv_transfer_params={"do_remote_decode": True})
        deadline = time.monotonic() + 30
        params = None
        while params is None:
            assert time.monotonic() < deadline
            params = next((o.kv_transfer_params for o in p.step() if o.request_id == "whole" and o.finished), None)
        assert params.do_remote_prefill and not params.streaming
        drive = Drive(p, d)
        d.add_request("whole", tokens, sampling, kv_transfer_params=params)
        drive.got["whole"] = {"tokens": [], "finished": False, "error": None, "cause": None}
        drive.until_done()
        assert drive.got["whole"]["tokens"] == colocated(tokens, sampling, FOUR)
        assert stats(d)["blocks_recv"] == 4 * -(-120 // 16) and stats(d)["loads_ok"] == 1
        assert stats(p)["blocks_sent"] == stats(d)["blocks_recv"]
        drive.settle()


def test_layer_streaming_refuses_a_pool_off_the_cpu_even_in_one_slice():
    """Publishing inside the forward is safe only where the forward's writes are done when a layer
    returns (a CPU pool): any other pool is refused at start, whatever the slice count."""
    from connectors.metrics import TransferMetrics
    from connectors.zmq.connector import ZmqConnectorConfig, ZmqConnectorWorker

    groups = KVLayout(FULL, 16).kv_cache_groups()
    pool = PagePool(8, KVLayout(FULL, 16).page_size_bytes, torch.device("cpu"))
    pool.device = torch.device("meta")  # (what a non-CPU pool reports; no GPU needed to check the refusal)
    config = ZmqConnectorConfig(engine_id="p", role=KVRole.PRODUCER, secret=b"s" * 16, model_id="m",
                                streaming="layer", stream_layer_parts=1)
    worker = ZmqConnectorWorker(config, tuple(groups), TransferMetrics(), num_slices=1)
    with pytest.raises(ValueError, match="CPU page pool"):
        worker.register_kv_caches(pool)
