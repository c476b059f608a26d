"""The persistent block-table rows: after any sequence of steps over the real scheduler and KV cache manager
(preemption, aborts, prefix hits, chunked prefill, sliding windows), each step's block tables equal the
tables rebuilt from the chunks' lists, on the host and in the device's copy of the rows."""
import random

import pytest
import torch
from kvcache.audit import assert_all_free
from tests.helpers.engine_cases import MODELS, engine_config

from pd.engine.attention.block_rows import BlockRows
from pd.engine.engine import Engine
from pd.engine.sample.params import SamplingParams


def _rebuilt(chunks, g: int, width: int) -> torch.Tensor:
    return torch.tensor([list(c.block_ids[g]) + [0] * (width - len(c.block_ids[g])) for c in chunks],
                        dtype=torch.long).view(len(chunks), width)


def _checked(inputs, fixed: bool):
    """Wraps `inputs.build` so every step compares its tables with the lists (and counts the steps)."""
    build, seen = inputs.build, {"steps": 0, "row_writes": 0}

    def checking_build(chunks, pad_to=None):
        md = build(chunks, pad_to=pad_to)
        width = md.block_tables[0].shape[1]
        if fixed:
            assert width == inputs.capacity.max_blocks_per_seq
        rows = inputs.rows
        for g, table in enumerate(md.block_tables):
            assert torch.equal(table, _rebuilt(chunks, g, width)), f"group {g}"
            assert torch.equal(rows.device[g], rows.host[g])  # the device's copy follows the host's
            assert not rows.host[g][rows.null_row].any()
        seen["steps"] += 1
        return md

    inputs.build = checking_build
    return seen


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_rows_follow_the_scheduler_through_random_traffic(name, seed):
    rng = random.Random(seed)
    eng = Engine(engine_config(MODELS[name], num_blocks=40, max_num_batched_tokens=48,
                               long_prefill_token_threshold=rng.choice([0, 16]), max_num_seqs=6))
    inputs = eng.runner.inputs
    fixed = seed == 1
    inputs.fixed_table_width = fixed
    inputs._separate_rows = True  # a device copy of the rows on the CPU: the GPU's path of copies
    inputs._allocate(inputs.capacity)
    seen = _checked(inputs, fixed)
    shared = [rng.randrange(256) for _ in range(24)]
    live: set[str] = set()
    for step in range(150):
        if step < 100 and rng.random() < 0.4:
            rid = f"r{step % 30}"  # ids come back once their request finished
            if rid not in live:
                own = [rng.randrange(256) for _ in range(rng.randint(1, 40))]
                prompt = (shared if rng.random() < 0.5 else []) + own
                eng.add_request(rid, prompt, SamplingParams(max_tokens=rng.randint(1, 16), ignore_eos=True))
                live.add(rid)
        if live and rng.random() < 0.1:
            eng.abort_request(rng.choice(sorted(live)))
        for out in eng.step():
            if out.finished:
                live.discard(out.request_id)
        assert inputs.rows.num_assigned <= inputs.capacity.max_num_seqs
        assert eng.runner.num_held_requests == inputs.rows.num_assigned  # (what a worker's stats report)
    while eng.has_unfinished_requests():
        for out in eng.step():
            live.discard(out.request_id)
    assert seen["steps"] > 50
    assert eng.stats()["num_preemptions"] > 0
    assert inputs.rows.num_assigned == 0 == eng.runner.num_held_requests  # every finished request gave its row back
    assert_all_free(eng.kv_cache_manager)


def test_rows_write_only_what_changed():
    rows = BlockRows(1, max_rows=3, max_blocks=4, device=torch.device("cpu"), separate_device_copy=True)
    assert rows.rows_for(["a", "b"], [([5],), ([6, 7],)]) == [0, 1]
    rows.host[0][0, 3] = 99  # a marker past every table row 0 holds below: no write touches it
    rows.rows_for(["a"], [([5, 8],)])  # a new block: only the tail is written
    assert rows.host[0][0].tolist() == [5, 8, 0, 99]
    rows.rows_for(["a"], [([0, 8],)])  # a sliding window nulls the first block: the whole row again
    assert rows.host[0][0].tolist() == [0, 8, 0, 99]
    rows.rows_for(["a"], [([9],)])  # preempted, then fewer new blocks: the rest nulled
    assert rows.host[0][0].tolist() == [9, 0, 0, 99]
    rows.release(["a", "never-seen"])
    assert rows.rows_for(["c"], [([1],)]) == [0]  # the freed row, rewritten for its new holder
    assert rows.host[0][0].tolist() == [1, 0, 0, 99]
    assert torch.equal(rows.device[0], rows.host[0]) and not rows.host[0][rows.null_row].any()


def test_rows_of_requests_gone_without_a_release_are_reused():
    rows = BlockRows(1, max_rows=2, max_blocks=2, device=torch.device("cpu"))
    rows.rows_for(["a", "b"], [([1],), ([2],)])
    assert sorted(rows.rows_for(["c", "d"], [([3],), ([4],)])) == [0, 1]  # a and b were never released
    with pytest.raises(ValueError, match="more than 2 sequences"):
        rows.rows_for(["e", "f", "g"], [([1],), ([2],), ([3],)])
    with pytest.raises(ValueError, match="exceeds"):
        rows.rows_for(["c"], [([1, 2, 3],)])
