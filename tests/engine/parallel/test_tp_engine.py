"""The sharded engine: rank 0's `Engine(config, tp=group)` and `Follower`s on real gloo gangs.

A tiny float32 random model with a sliding-window layer (4 query heads, 2 KV heads) runs greedy on
gangs of 2 ranks (KV heads split) and 4 ranks (each KV head on 2 ranks), with prefix caching on (a
second wave of prompts shares the first wave's prefix). Every prompt's 16 tokens must equal TP 1's,
computed here by a plain engine; the one allowed escape is a near-tie: at a first divergence, TP 1's
top-2 logit gap must be under 1e-4. Rank 0's pool must be all free at the end. The TP 2 gang's ranks
must hold KV in the same blocks, each rank's pages its heads of TP 1's pages (atol 1e-5), a block
zeroed on rank 0 (a failed load's) must be zeroed on the follower before the next message, and rank
0's shutdown must end the followers' loops; the TP 4 gang ends by a follower's SIGKILL, which rank 0's
engine must report (dead, with an error naming the gang) within seconds, the other
followers' loops failing too. Refusals that need no gang (fused backend, KV audit, a TP the model
cannot be split by) and the checkpoint slice reads are checked in this process.
"""
from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch
from tests.helpers.tp_gang import Gang

from kvcache.audit import assert_all_free
from pd.engine.config import EngineConfig
from pd.engine.engine import Engine
from pd.engine.model.checkpoint import save_checkpoint
from pd.engine.model.config import ModelConfig
from pd.engine.model.llama import build_model
from pd.engine.parallel.follower import Follower
from pd.engine.parallel.head_slices import head_view
from pd.engine.parallel.sharded_model import build_shard, setup_rank, shard_of
from pd.engine.parallel.tp import TPShape
from pd.engine.sample.params import SamplingParams

MODEL = ModelConfig(vocab_size=260, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=2,
                    layer_types=("full_attention", "sliding_attention", "full_attention"), sliding_window=8)
CONFIG = EngineConfig(model=MODEL, seed=3, block_size=4, kv_cache_bytes=1 << 20, max_num_seqs=8)
NEW_TOKENS = 16
SHARED = [11, 42, 7, 99, 3, 18, 250, 64, 5]  # a prefix both waves share (two full blocks and more)
WAVES = [{f"a{i}": SHARED + [20 + i, 30 + 2 * i] for i in range(3)},
         {f"b{i}": SHARED + [40 + i] * (i + 1) for i in range(3)}]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
TIE_GAP = 1e-4


def _generate(engine: Engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for wave in WAVES:  # the second wave finds the first's prefix cached
        tokens.update(engine.generate_sync(wave, GREEDY))
    return tokens


def _rank0(group, config: EngineConfig, ending: str, ready_file: str) -> dict:
    engine = Engine(config, tp=group)
    result = {"tokens": _generate(engine), "prefix_hits": engine.scheduler.stats.prefix_hits,
              "backend": engine.runner.description, "num_blocks": engine.page_pool.num_blocks,
              "heads": engine.layout.num_kv_heads, "canonical_heads": engine.canonical_layout.num_kv_heads,
              "tp": engine.tp_shape.tp}
    assert_all_free(engine.kv_cache_manager)
    if ending == "stop":
        # a failed load's pages, zeroed by the connector seam through the runner: on every rank before the next step
        used = _used_pages(engine.page_pool)
        engine.runner.zero_blocks({used[0]})
        engine.runner.keepalive()  # (the next message: an empty plan carrying the blocks to zero)
        result.update(used=used, after_zero=_used_pages(engine.page_pool))
        result["pages"] = _pages(engine.layout, engine.page_pool, result["after_zero"])
        engine.shutdown()
        return result
    engine.start()  # idle: keepalives go out, until a follower dies
    with open(ready_file, "w") as f:
        f.write("ready")
    deadline = time.monotonic() + 60
    while engine.dead is None and time.monotonic() < deadline:
        time.sleep(0.05)
    result["dead"] = None if engine.dead is None else f"{type(engine.dead).__name__}: {engine.dead}"
    engine.shutdown()
    return result


def _used_pages(pool) -> list[int]:
    return [b for b in range(pool.num_blocks) if int(pool.buffer[b].count_nonzero())]


def _pages(layout, pool, blocks: list[int]) -> bytes:
    """These blocks' KV as (blocks, rows, local heads, head_dim) float32 bytes."""
    return head_view(layout, pool)[torch.tensor(blocks, dtype=torch.long)].contiguous().numpy().tobytes()


def _follower(group, config: EngineConfig) -> dict:
    follower = Follower(config, group)
    follower.run()
    used = _used_pages(follower.page_pool)
    info = {"used": used, "pages": _pages(follower.layout, follower.page_pool, used), "steps": follower.num_steps,
            "num_blocks": follower.page_pool.num_blocks,
            "heads": list(follower.shape.heads_of(group.rank)), "local_heads": follower.layout.num_kv_heads}
    follower.close()
    return info


def _rank(group, config: EngineConfig, ending: str, ready_file: str) -> dict:
    return _rank0(group, config, ending, ready_file) if group.rank == 0 else _follower(group, config)


def _check_tokens(got: dict[str, list[int]], want: dict[str, list[int]]) -> None:
    model = build_model(MODEL, seed=CONFIG.seed)
    prompts = {rid: ids for wave in WAVES for rid, ids in wave.items()}
    assert set(got) == set(want) == set(prompts)
    for rid, ref in want.items():
        assert len(got[rid]) == len(ref) == NEW_TOKENS
        first = next((i for i, (a, b) in enumerate(zip(got[rid], ref, strict=True)) if a != b), None)
        if first is None:
            continue
        top2 = model.reference_logits(prompts[rid] + ref[:first])[-1].topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < TIE_GAP, f"{rid}: TP diverged from TP 1 at token {first} with a top-2 gap of {gap}"


@pytest.fixture(scope="module")
def tp1() -> Engine:
    engine = Engine(dataclasses.replace(CONFIG, attention_backend="torch"))
    engine.tokens = _generate(engine)  # type: ignore[attr-defined]
    assert_all_free(engine.kv_cache_manager)
    return engine


@pytest.fixture(scope="module")
def tp1_tokens(tp1) -> dict[str, list[int]]:
    return tp1.tokens


@pytest.mark.timeout(200)  # spawning ranks imports torch: slow on a busy box, never stuck
def test_tp2_gives_tp1_tokens_and_stop_ends_the_followers(tp1, tp1_tokens, tmp_path):
    with Gang(2, _rank, CONFIG, "stop", str(tmp_path / "ready"), timeout_s=20.0) as gang:
        replies = gang.results(wait_s=150)
        gang.close()
        assert gang.all_ended()
    assert all("result" in r for r in replies), replies
    rank0, follower = replies[0]["result"], replies[1]["result"]
    _check_tokens(rank0["tokens"], tp1_tokens)
    assert rank0["prefix_hits"] > 0
    assert rank0["backend"] == "torch" or "torch" in rank0["backend"]
    assert (rank0["tp"], rank0["heads"], rank0["canonical_heads"]) == (2, 1, 2)
    assert follower["heads"] == [1] and follower["local_heads"] == 1
    assert follower["num_blocks"] == rank0["num_blocks"]
    assert follower["steps"] > 0  # it ran the forwards (then returned on stop, not on an error)
    # the same blocks hold KV on both ranks (a block id means the same tokens), and the zeroed one on neither
    assert len(rank0["used"]) > 1 and rank0["after_zero"] == rank0["used"][1:] == follower["used"]
    # each rank's pages are its heads of TP 1's pages, block for block (the canonical layout a transfer moves)
    canonical = head_view(tp1.layout, tp1.page_pool)[torch.tensor(follower["used"], dtype=torch.long)]
    shape = TPShape(2, MODEL.num_kv_heads, MODEL.num_heads)
    for rank, reply in enumerate((rank0, follower)):
        heads = shape.heads_of(rank)
        mine = torch.frombuffer(bytearray(reply["pages"]), dtype=torch.float32).view(
            len(follower["used"]), canonical.shape[1], len(heads), canonical.shape[3])
        torch.testing.assert_close(mine, canonical[:, :, heads.start:heads.stop], atol=1e-5, rtol=0)


@pytest.mark.timeout(200)
def test_tp4_with_replicated_kv_heads_gives_tp1_tokens_and_a_follower_death_is_seen(tp1_tokens, tmp_path):
    ready = tmp_path / "ready"
    with Gang(4, _rank, CONFIG, "die", str(ready), timeout_s=20.0) as gang:
        deadline = time.monotonic() + 150
        while not ready.exists() and time.monotonic() < deadline and gang.procs[0].is_alive():
            time.sleep(0.05)
        assert ready.exists(), gang.results(wait_s=5)
        os.kill(gang.procs[3].pid, 9)
        killed = time.monotonic()
        replies = gang.results(wait_s=30, ranks=[0])
        seen_s = time.monotonic() - killed
        others = gang.results(wait_s=30, ranks=[1, 2])
    assert "result" in replies[0], replies
    rank0 = replies[0]["result"]
    _check_tokens(rank0["tokens"], tp1_tokens)
    assert (rank0["tp"], rank0["heads"]) == (4, 1)
    assert rank0["dead"] is not None and "GangError" in rank0["dead"] and "gang" in rank0["dead"], rank0["dead"]
    assert seen_s < 10.0, f"rank 0 reported the dead follower after {seen_s:.1f} s"
    assert all("error" in r for r in others), others  # the survivors' loops fail too: no follower lingers


class _FakeGroup:
    """Enough of a TPGroup for the checks that refuse before any collective."""

    def __init__(self, world_size: int, rank: int = 0):
        self.world_size, self.rank, self.timeout_s = world_size, rank, 1.0

    def min_int(self, value: int) -> int:
        raise AssertionError("a refused config must not reach a collective")


@pytest.mark.parametrize(("change", "tp", "words"), [
    ({"attention_backend": "fused"}, 2, "'fused' cannot run with TP 2"),
    ({"kv_audit_rate": 0.5}, 2, "kv_audit_rate 0.5 with TP 2"),
    ({}, 3, "TP 3 and 2 KV heads"),
    ({"model": dataclasses.replace(MODEL, num_kv_heads=4, num_heads=4, intermediate_size=100)}, 8,
     "TP 8 and 4 query heads"),
])
def test_a_tp_the_engine_cannot_run_is_refused_with_its_reason(change, tp, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        setup_rank(dataclasses.replace(CONFIG, **change), _FakeGroup(tp))  # type: ignore[arg-type]


@pytest.mark.parametrize("tp", [2, 4])
def test_a_rank_reads_exactly_its_slices_of_a_checkpoint(tmp_path, tp):
    full = build_model(MODEL, seed=5)
    save_checkpoint(full, tmp_path / "ckpt", max_shard_bytes=40_000)
    shape = TPShape(tp, MODEL.num_kv_heads, MODEL.num_heads)
    for rank in range(tp):
        read = build_shard(EngineConfig(model_path=str(tmp_path / "ckpt")), shape, rank)
        narrowed = shard_of(full, shape, rank)
        got, want = read.state_dict(), narrowed.state_dict()
        assert set(got) == set(want) and ("lm_head.weight" in got) == (rank == 0)
        for name in want:
            assert torch.equal(got[name], want[name]), name
        assert got["model.layers.0.self_attn.k_proj.weight"].shape[0] == MODEL.resolved_head_dim  # one KV head


def test_a_step_plan_round_trips_and_a_malformed_chunk_is_refused():
    from pd.engine.runner.tp_runner import decode_chunks, encode_plan
    from pd.engine.sched.output import ScheduledChunk

    chunks = [ScheduledChunk("r1", [5, 6, 7], 4, ([3, 9], [4]), True), ScheduledChunk("r2", [8], 12, ([2],), False)]
    plan = encode_plan(chunks, ["gone"], [7, 3])
    assert decode_chunks(plan) == chunks and plan["zero"] == [3, 7] and plan["finished"] == ["gone"]
    for bad in (["r1", [5, "6"], 4, [[3]], True], ["r1", [5], "4", [[3]], True], [1, [5], 4, [[3]], True]):
        with pytest.raises(ValueError, match="malformed"):
            decode_chunks({"chunks": [bad]})


def test_the_seam_zeroes_failed_loads_through_the_runner_given():
    from connectors.noop import NoopConnector, NoopConnectorWorker
    from pd.engine.kv.page_pool import PagePool
    from pd.engine.runner.kv_connector import ConnectorSeam
    from pd.engine.sched.output import SchedulerOutput

    class FailedLoad(NoopConnectorWorker):
        def get_block_ids_with_load_errors(self) -> set[int]:
            return {3, 4}

    connector = NoopConnector()
    connector.worker = FailedLoad()
    zeroed: list[set[int]] = []
    seam = ConnectorSeam(connector, PagePool(6, 64), zero_blocks=zeroed.append)
    seam.before_forward(SchedulerOutput(chunks=[]))
    assert seam.after_forward().invalid_block_ids == {3, 4} and zeroed == [{3, 4}]


def test_rank_0_is_the_engine_not_a_follower():
    with pytest.raises(ValueError, match="rank 0 of a TP gang is the engine"):
        Follower(CONFIG, _FakeGroup(2, rank=0))  # type: ignore[arg-type]
