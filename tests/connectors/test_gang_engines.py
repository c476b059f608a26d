"""Hetero TP through the real ZMQ connector, end to end: a P gang and a D gang of real engines (rank 0
`Engine(config, connector, tp=group)`, the other ranks `Follower`s, gloo between processes), the P/D
flow of a served request (P prefills with do_remote_decode, D decodes from P's kv_transfer_params),
every rank moving its own KV heads (tests/helpers/gang_engines.py wires it as a worker would).

Default suite: P TP 2 -> D TP 1 over the mapped pools and P TP 1 -> D TP 2 over tcp. Slow: P TP 4 ->
D TP 2 with replicated heads (2 KV heads), over both. The model has a sliding-window layer. D's greedy
tokens must equal a colocated TP 1 engine's (the one escape: a near-tie under 1e-4 in TP 1's top-2
logits at the first divergence); each D rank received exactly its share of the canonical pages, from
the P ranks the mapping rule names; no load failed; both sides' pools end all free.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from tests.helpers.gang_engines import d_rank, p_rank
from tests.helpers.tp_gang import Gang

from kvcache.audit import assert_all_free
from pd.engine.config import EngineConfig
from pd.engine.engine import Engine
from pd.engine.kv.layout import KVLayout
from pd.engine.model.config import ModelConfig
from pd.engine.model.llama import build_model
from pd.engine.parallel.tp import transfer_plan
from pd.engine.sample.params import SamplingParams

MODEL = ModelConfig(vocab_size=260, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=2,
                    layer_types=("full_attention", "sliding_attention", "full_attention"), sliding_window=8)
CONFIG = EngineConfig(model=MODEL, seed=3, block_size=4, kv_cache_bytes=1 << 20, max_num_seqs=8,
                      attention_backend="torch")
NEW_TOKENS = 12
PROMPTS = {"r0": [11, 42, 7, 99, 3, 18, 250, 64, 5, 20, 31], "r1": [5, 6, 7, 8, 9, 10, 11, 12, 13],
           "r2": [200 + i for i in range(17)]}
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
TIE_GAP = 1e-4


@pytest.fixture(scope="module")
def tp1_tokens() -> dict[str, list[int]]:
    engine = Engine(CONFIG)
    tokens = engine.generate_sync(PROMPTS, GREEDY)
    assert_all_free(engine.kv_cache_manager)
    return tokens


def _check_tokens(got: dict[str, list[int]], want: dict[str, list[int]]) -> None:
    model = build_model(MODEL, seed=CONFIG.seed)
    for rid, ref in want.items():
        assert len(got[rid]) == len(ref) == NEW_TOKENS, (rid, got[rid])
        first = next((i for i, (a, b) in enumerate(zip(got[rid], ref, strict=True)) if a != b), None)
        if first is None:
            continue
        top2 = model.reference_logits(PROMPTS[rid] + ref[:first])[-1].topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < TIE_GAP, f"{rid}: D diverged from TP 1 at token {first} with a top-2 gap of {gap}"


def _run(p_tp: int, d_tp: int, data_path: str, shared: str, lie_slices: int = 0,
         d_config: EngineConfig = CONFIG, streaming: bool = False) -> tuple[list[dict], list[dict]]:
    with Gang(p_tp, p_rank, CONFIG, PROMPTS, data_path, shared, lie_slices, streaming, timeout_s=30.0) as p_gang, \
            Gang(d_tp, d_rank, d_config, GREEDY, PROMPTS, data_path, shared, streaming, timeout_s=30.0) as d_gang:
        d_replies = d_gang.results(wait_s=200)
        p_replies = p_gang.results(wait_s=60)
    assert all("result" in r for r in p_replies + d_replies), (p_replies, d_replies)
    return [r["result"] for r in p_replies], [r["result"] for r in d_replies]


def _check(p_tp: int, d_tp: int, data_path: str, tp1_tokens, tmp_path, streaming: bool = False) -> None:
    p_res, d_res = _run(p_tp, d_tp, data_path, str(tmp_path), streaming=streaming)
    d0 = d_res[0]
    if streaming:  # every block of every prompt came as its own published part
        assert d0["stream_parts"] >= sum(len(t) // CONFIG.block_size for t in PROMPTS.values()), d0
    assert d0["errors"] == {} and d0["failures"] == {}, d0
    _check_tokens(d0["tokens"], tp1_tokens)
    assert set(d0["paths"]["p-gang"]) == {"gang"}
    page = KVLayout(MODEL, CONFIG.block_size).page_size_bytes
    blocks = d0["blocks_recv"]
    assert blocks > 0 and d0["bytes_recv"] == blocks * page  # D's figures count canonical pages
    plan = transfer_plan(p_tp, d_tp, MODEL.num_kv_heads)
    for r, res in enumerate(d_res):
        want = {}
        for s in plan:
            if s.d_rank == r:
                want[str(s.p_rank)] = want.get(str(s.p_rank), 0) + blocks * page * s.count // MODEL.num_kv_heads
        assert res["received_from"] == want, (r, res)  # its share, from the P ranks the rule names
        assert res["received"] == blocks * page // min(d_tp, MODEL.num_kv_heads)
    assert all(r.get("forwarded", 0) == 0 for r in d_res)  # no D rank serves anything
    assert all(r["received"] == 0 for r in p_res)  # no P rank receives anything
    if p_tp > MODEL.num_kv_heads:  # replicas (odd ranks here) are never read
        assert [r["served_slices"] > 0 for r in p_res[1:]] == [False, True, False][: p_tp - 1]


@pytest.mark.timeout(280)  # spawning ranks imports torch: slow on a busy box, never stuck
@pytest.mark.parametrize(("p_tp", "d_tp", "data_path"), [(2, 1, "shm"), (1, 2, "tcp")])
def test_hetero_tp_through_the_connector_gives_tp1_tokens(p_tp, d_tp, data_path, tp1_tokens, tmp_path):
    _check(p_tp, d_tp, data_path, tp1_tokens, tmp_path)


@pytest.mark.timeout(280)
def test_chunk_streaming_between_gangs(tp1_tokens, tmp_path):
    """`transfer.streaming: chunk` with TP: P publishes each prefill step's blocks, D's ranks pull each
    part as it is published (whole pages: every rank its heads of them)."""
    _check(1, 2, "shm", tp1_tokens, tmp_path, streaming=True)


@pytest.mark.timeout(280)
def test_a_p_rank_whose_heads_fail_their_checksum_is_recomputed_on_d(tp1_tokens, tmp_path):
    """P rank 1 answers its first slice with wrong checksums: that load's blocks are untrusted (every D
    rank's part of them), D recomputes them (the default policy) and still gives TP 1's tokens."""
    p_res, d_res = _run(2, 1, "tcp", str(tmp_path), lie_slices=1)
    d0 = d_res[0]
    assert d0["errors"] == {} and d0["failures"] == {"checksum": 1}, d0
    _check_tokens(d0["tokens"], tp1_tokens)
    assert p_res[1]["served_slices"] >= len(PROMPTS)  # (a load may travel as several pulls)


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_with_the_fail_policy_a_bad_rank_part_fails_its_request(tp1_tokens, tmp_path):
    fail = dataclasses.replace(CONFIG, kv_load_failure_policy="fail")
    _, d_res = _run(2, 1, "tcp", str(tmp_path), lie_slices=1, d_config=fail)
    d0 = d_res[0]
    assert len(d0["errors"]) == 1 and d0["failures"] == {"checksum": 1}, d0
    for rid in set(PROMPTS) - set(d0["errors"]):
        assert d0["tokens"][rid] == tp1_tokens[rid]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("data_path", ["shm", "tcp"])
def test_p_tp4_to_d_tp2_with_replicated_heads(data_path, tp1_tokens, tmp_path):
    _check(4, 2, data_path, tp1_tokens, tmp_path)


def test_layer_streaming_is_refused_with_tp():
    from connectors.zmq.connector import KVRole, ZmqConnector, ZmqConnectorConfig
    from connectors.zmq.gang.gang_control import GangControl
    from connectors.zmq.gang.gang_side import GangSide
    from connectors.zmq.gang.head_plan import HeadGeometry, RankHeads

    control = GangControl(2)
    try:
        gang = GangSide(2, RankHeads(0, 0, 1), HeadGeometry(1, 16, torch.float32), control)
        with pytest.raises(ValueError, match="'layer' with TP > 1"):
            ZmqConnector(ZmqConnectorConfig(engine_id="p", role=KVRole.PRODUCER, secret=b"x" * 16, model_id="m",
                                            streaming="layer"),
                         KVLayout(MODEL, CONFIG.block_size).kv_cache_groups(), gang=gang)
    finally:
        control.close()

