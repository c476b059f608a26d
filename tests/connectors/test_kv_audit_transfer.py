"""The online KV audit (`pd.engine.runner.kv_audit`) between two real engines with real ZMQ connectors.

P prefills, D pulls the prompt's pages over real sockets and, for a sampled request, recomputes the
last pulled full block over the received prefix and compares it with what P sent. A clean P is never
flagged; a P whose first layer's K is perturbed after its forward (the fault plan's `perturb_kv`: the
connector's checksums are sealed over the perturbed bytes, so the load itself succeeds) is flagged for
every sampled request. Engines are stepped from this thread; both pools end all free.
"""
from __future__ import annotations

import functools
import logging
import random
import time

import pytest
import test_kv_streaming as streaming  # (its harness: P and D stepped here, a streamed request end to end)
import torch

from connectors.zmq.connector import KVRole, ZmqConnector, ZmqConnectorConfig
from kvcache.audit import assert_all_free, check_invariants
from pd.engine.config import EngineConfig
from pd.engine.engine import Engine
from pd.engine.kv.layout import KVLayout
from pd.engine.runner.kv_audit import sampled
from pd.engine.model.config import ModelConfig
from pd.engine.sample.params import SamplingParams
from pd.engine.step_isolation import PERTURB_KV
from pd.router.metrics import RouterMetrics, WorkerFigures
from pd.worker.wiring import engine_stats

torch.set_num_threads(1)

SECRET = b"audit-secret-0123456789abc"
MODEL = ModelConfig(num_layers=2)
BLOCK = 16
PREFILL_ONLY = SamplingParams(max_tokens=1, ignore_eos=True)
DECODE = SamplingParams(max_tokens=4, ignore_eos=True)
# Lengths: ragged, one on a block boundary (its last token is recomputed locally, into the audited block)
LENGTHS = (40, 64, 33, 100, 17, 80)


def make_engine(engine_id: str, role: KVRole, rate: float = 0.0, tolerance: float | None = 0.0) -> Engine:
    config = EngineConfig(model=MODEL, seed=5, block_size=BLOCK, num_blocks=96, max_num_batched_tokens=512,
                          max_num_seqs=16, engine_id=engine_id, kv_audit_rate=rate, kv_audit_tolerance=tolerance)
    connector = ZmqConnector(ZmqConnectorConfig(
        engine_id=engine_id, role=role, secret=SECRET, model_id="tiny-2@5", lease_s=10.0,
        handshake_timeout_s=5.0, transfer_timeout_s=5.0, io_timeout_s=5.0),
        KVLayout(MODEL, BLOCK).kv_cache_groups())
    return Engine(config, connector=connector)


@pytest.fixture
def pair():
    p = make_engine("prefill-0", KVRole.PRODUCER)
    d = make_engine("decode-0", KVRole.CONSUMER, rate=1.0)
    yield p, d
    p.shutdown()
    d.shutdown()


def prompts(seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(0, 256) for _ in range(n)] for i, n in enumerate(LENGTHS)}


def step_until_idle(*engines: Engine, until=None, timeout_s: float = 120.0) -> dict[str, list]:
    """Steps until every engine is idle (or `until(outputs)` holds); returns the outputs by request."""
    outs: dict[str, list] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if until(outs) if until is not None else not any(e.has_unfinished_requests() for e in engines):
            return outs
        stepped = False
        for e in engines:
            for o in e.step():
                stepped = True
                outs.setdefault(o.request_id, []).append(o)
        if not stepped:
            time.sleep(0.001)  # (only transfers pending: let the connectors' threads move the bytes)
    raise AssertionError("engines did not go idle")


def transfer(p: Engine, d: Engine, batch: dict[str, list[int]], perturb: bool = False) -> dict[str, list]:
    """Prefill each prompt on P (marked to be perturbed or not), then decode it on D from P's KV."""
    for rid, tokens in batch.items():
        if perturb:
            p.fault_marks.mark(rid, PERTURB_KV)
        p.add_request(rid, tokens, PREFILL_ONLY, kv_transfer_params={"do_remote_decode": True})
    prefilled = step_until_idle(p, until=lambda outs: all(rid in outs and outs[rid][-1].finished for rid in batch))
    firsts = {rid: outs[-1] for rid, outs in prefilled.items()}
    for rid, tokens in batch.items():
        assert firsts[rid].finished and firsts[rid].kv_transfer_params, firsts[rid]
        d.add_request(rid, tokens, DECODE, kv_transfer_params=firsts[rid].kv_transfer_params)
    outs = step_until_idle(p, d)
    for rid in batch:
        assert outs[rid][-1].finished and outs[rid][-1].error is None, outs[rid][-1]
    return outs


def check_free(*engines: Engine) -> None:
    for e in engines:
        check_invariants(e.kv_cache_manager)
        assert_all_free(e.kv_cache_manager)


def test_clean_transfer_is_never_flagged(pair, caplog):
    p, d = pair
    caplog.set_level(logging.INFO, logger="pd.engine.runner.kv_audit")
    batch = prompts(1)
    transfer(p, d, batch)
    s = d.stats()
    audited = [rid for rid, t in batch.items() if len(t) >= BLOCK]
    assert s["kv_audit_checked"] == len(audited)
    assert s["kv_audit_mismatched"] == 0 and s["kv_audit_errors"] == 0
    assert s["kv_audit_worst_diff"] == 0.0  # same kernels, same dtype: bitwise
    assert d.connector.stats()["failures"] == {}
    lines = [r.getMessage() for r in caplog.records if "matches" in r.getMessage()]
    assert len(lines) == len(audited)
    assert all("prefill-0" in m and "decode-0" in m for m in lines)
    check_free(p, d)


@pytest.mark.parametrize("tolerance", [0.0, None])  # bitwise, and the float32 default (1e-4 relative)
def test_perturbed_producer_is_flagged_for_every_sampled_request(tolerance, caplog):
    p = make_engine("prefill-0", KVRole.PRODUCER)
    d = make_engine("decode-0", KVRole.CONSUMER, rate=1.0, tolerance=tolerance)
    try:
        flagged_everywhere(p, d, caplog)
    finally:
        p.shutdown()
        d.shutdown()


def flagged_everywhere(p: Engine, d: Engine, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="pd.engine.runner.kv_audit")
    batch = prompts(2)
    transfer(p, d, batch, perturb=True)
    s = d.stats()
    assert d.connector.stats()["failures"] == {}  # the checksums pass: the bytes arrived as sent
    assert s["kv_audit_checked"] == len(batch) == s["kv_audit_mismatched"]
    assert s["kv_audit_worst_diff"] > 0.0
    flagged = [r.getMessage() for r in caplog.records if "MISMATCH" in r.getMessage()]
    assert len(flagged) == len(batch)
    for rid in batch:
        assert any(f"request {rid} from P prefill-0 on D decode-0" in m for m in flagged), flagged
    assert all("layer 0 K" in m for m in flagged)  # the perturbed layer is the first that differs
    # what the router exports from D's polled stats
    figures = WorkerFigures("decode-0", "decode", True, engine_stats(d, d.connector))
    text = RouterMetrics("tiny", lambda: [figures]).render().decode()
    labels = '{model_name="tiny",role="decode",worker="decode-0"}'
    assert f"pdkv_kv_audit_checked_total{labels} {float(len(batch))}" in text
    assert f"pdkv_kv_audit_mismatched_total{labels} {float(len(batch))}" in text
    assert f"pdkv_kv_audit_worst_diff{labels} {s['kv_audit_worst_diff']}" in text
    check_free(p, d)


def test_tolerance_accepts_a_difference_within_it_and_rate_zero_audits_nothing():
    p = make_engine("prefill-1", KVRole.PRODUCER)
    lax = make_engine("decode-1", KVRole.CONSUMER, rate=1.0, tolerance=1.0)  # (relative: the whole value)
    try:
        batch = {k: v for k, v in prompts(3).items() if len(v) >= BLOCK}
        transfer(p, lax, batch, perturb=True)
        s = lax.stats()
        assert s["kv_audit_checked"] == len(batch) and s["kv_audit_mismatched"] == 0
        assert 0.0 < s["kv_audit_worst_diff"] <= 1.0
        check_free(p, lax)
    finally:
        p.shutdown()
        lax.shutdown()
    p = make_engine("prefill-2", KVRole.PRODUCER)
    off = make_engine("decode-2", KVRole.CONSUMER)
    try:
        transfer(p, off, prompts(4), perturb=True)
        assert off.stats()["kv_audit_checked"] == 0 and off.stats()["kv_audit_skipped"] == 0
        check_free(p, off)
    finally:
        p.shutdown()
        off.shutdown()


def test_sampling_follows_the_rate():
    ids = [f"req-{i}" for i in range(4000)]
    share = sum(sampled(i, 0.01) for i in ids) / len(ids)
    assert 0.005 < share < 0.02
    assert not any(sampled(i, 0.0) for i in ids) and all(sampled(i, 1.0) for i in ids)
    assert [sampled(i, 0.3) for i in ids] == [sampled(i, 0.3) for i in ids]  # a request decides alike each time


def test_the_audit_leaves_the_prefix_cache_as_it_was(pair):
    """Same prompts into an auditing D and a non-auditing one: the same cached blocks, no scratch block
    among them, and the same tokens (the audit changes nothing the request sees)."""
    p, d = pair
    plain = make_engine("decode-9", KVRole.CONSUMER)
    try:
        batch = prompts(6)
        audited_out = transfer(p, d, batch)
        plain_out = transfer(p, plain, {rid: tokens for rid, tokens in batch.items()})
        assert d.stats()["kv_audit_checked"] == len(batch)
        for rid in batch:
            assert [t for o in audited_out[rid] for t in o.new_token_ids] == \
                   [t for o in plain_out[rid] for t in o.new_token_ids]
        cached = [set(e.kv_cache_manager.block_pool.cached_map(0)) for e in (d, plain)]
        assert cached[0] == cached[1] and cached[0]
        check_free(p, d, plain)
    finally:
        plain.shutdown()


def test_a_request_failed_before_its_audit_runs_is_skipped(pair):
    """D's request fails in the very step its load landed in (an injected step failure): the audit of
    it is skipped, never computed over blocks it no longer holds, and every block comes back."""
    p, d = pair
    batch = {k: v for k, v in prompts(7).items() if len(v) >= BLOCK}
    for rid, tokens in batch.items():
        p.add_request(rid, tokens, PREFILL_ONLY, kv_transfer_params={"do_remote_decode": True})
    firsts = {rid: o[-1] for rid, o in step_until_idle(
        p, until=lambda outs: all(rid in outs and outs[rid][-1].finished for rid in batch)).items()}
    doomed = sorted(batch)[0]
    d.fault_marks.mark(doomed, "step")
    for rid, tokens in batch.items():
        d.add_request(rid, tokens, DECODE, kv_transfer_params=firsts[rid].kv_transfer_params)
    outs = step_until_idle(p, d)
    assert outs[doomed][-1].error and all(outs[r][-1].error is None for r in batch if r != doomed)
    s = d.stats()
    assert s["kv_audit_skipped"] == 1 and s["kv_audit_checked"] == len(batch) - 1
    assert s["kv_audit_mismatched"] == 0
    check_free(p, d)


@pytest.mark.parametrize("perturb", [False, True], ids=["clean", "perturbed"])
def test_chunk_streamed_prefills_are_audited(perturb, monkeypatch):
    """`transfer.streaming: chunk` (test_kv_streaming.py's harness): P publishes each prefill step's
    blocks as it goes; the fault plan shifts every chunk before it is published, and D flags them all."""
    monkeypatch.setattr(streaming, "EngineConfig", functools.partial(EngineConfig, kv_audit_rate=1.0))
    p = streaming.make_engine("prefill-0", KVRole.PRODUCER)
    d = streaming.make_engine("decode-0", KVRole.CONSUMER)
    try:
        drive = streaming.Drive(p, d)
        lengths = (100, 64, 47)  # 4, 2 and 2 prefill steps of 32 tokens: the last full block in an early one
        for i, n in enumerate(lengths):
            if perturb:
                p.fault_marks.mark(f"s{i}", PERTURB_KV)
            drive.stream_whole(f"s{i}", streaming.prompt(n, start=i), DECODE)
        s = d.stats()
        assert s["kv_audit_checked"] == len(lengths)
        assert s["kv_audit_mismatched"] == (len(lengths) if perturb else 0)
        assert d.connector.stats()["failures"] == {} and s["kv_audit_errors"] == 0
        drive.settle()  # both pools all free
    finally:
        p.shutdown()
        d.shutdown()
