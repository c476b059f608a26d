"""KV between TP gangs whose ranks are real processes (pd/tools/gang_bench.py's rank agents: each
process one rank's pool and agent, registered on its gang's control socket): P TP 1 -> D TP 2 over
the mapped pools, and (slow) P TP 2 -> D TP 1 over tcp. Each D rank ends holding exactly its heads of the
canonical pages (checksums of its own pool), received its share and only from the P ranks the
mapping rule names."""
from __future__ import annotations

import argparse

import pytest

from pd.engine.parallel.tp import transfer_plan
from pd.tools.gang_bench import _layout, run_pair

ARGS = argparse.Namespace(kv_heads=2, head_dim=8, layers=3, block_size=4, blocks=6, seed=3, reps=1,
                          start_timeout_s=120.0)


@pytest.mark.parametrize(("p_tp", "d_tp", "path"), [(1, 2, "shm"), pytest.param(2, 1, "tcp", marks=pytest.mark.slow)])
def test_rank_processes_move_their_own_heads(p_tp, d_tp, path):
    row = run_pair(ARGS, p_tp, d_tp, path)  # raises unless every D rank holds its heads
    page = _layout(ARGS).page_size_bytes
    for r in range(d_tp):
        want = {}
        for s in transfer_plan(p_tp, d_tp, ARGS.kv_heads):
            if s.d_rank == r:
                want[str(s.p_rank)] = want.get(str(s.p_rank), 0) + ARGS.blocks * page * s.count // ARGS.kv_heads
        assert row["by_rank"][str(r)] == want
        assert row["rank_bytes"][r] == ARGS.blocks * page // d_tp


def test_the_bench_refuses_a_tp_the_kv_heads_cannot_be_split_by():
    from pd.tools.gang_bench import main

    with pytest.raises(ValueError, match="TP 3 and 2 KV heads"):
        main(["--p-tp", "3", "--kv-heads", "2"])
