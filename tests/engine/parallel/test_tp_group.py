"""The TP group (pd/engine/parallel/group.py) with real processes and gloo on 127.0.0.1: all-reduces
across 2 and 4 ranks, two gangs on one host at once (each on its own port, neither sees the other's
values), and a rank that dies or hangs makes the others' next collective fail within the timeout."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from tests.helpers.tp_gang import Gang

from pd.engine.parallel.group import TPGroup, backend_for, open_rendezvous

TIMEOUT_S = 5.0


def _sums(group: TPGroup, base: int, rounds: int) -> dict:
    sums = []
    for i in range(rounds):
        t = torch.tensor([float(base + group.rank), float(i)])
        sums.append(group.all_reduce(t).tolist())
        time.sleep(0.05)  # keep two gangs' rounds interleaved in time
    smallest = group.min_int(100 + group.rank * 7)
    largest = int(group.all_reduce(torch.tensor([group.rank]), op="max").item())
    control = group.broadcast_control(torch.tensor([group.rank * 10 + 3]), src=group.world_size - 1).item()
    try:
        TPGroup(group.rank, group.world_size, "127.0.0.1:1", timeout_s=1)
        second = "joined a second group"
    except RuntimeError as exc:
        second = str(exc)
    return {"sums": sums, "min": smallest, "max": largest, "control": control, "backend": group.backend,
            "second": second}


@pytest.mark.timeout(150)  # spawning ranks imports torch: slow on a busy box, never stuck
def test_all_reduce_and_control_broadcast_over_four_real_ranks():
    world_size = 4  # two ranks: the two gangs below
    with Gang(world_size, _sums, 0, 3, timeout_s=TIMEOUT_S) as gang:
        replies = gang.results()
    assert all("result" in r for r in replies), replies
    want = float(sum(range(world_size)))
    for r in replies:
        res = r["result"]
        assert res["sums"] == [[want, float(i * world_size)] for i in range(3)]
        assert (res["min"], res["max"], res["control"]) == (100, world_size - 1, (world_size - 1) * 10 + 3)
        assert res["backend"] == "gloo"
        assert res["second"] == "this process already belongs to a TP group (one rank per process)"
    assert gang.all_ended()


@pytest.mark.timeout(150)  # spawning ranks imports torch: slow on a busy box, never stuck
def test_two_gangs_on_one_host_do_not_collide():
    with Gang(2, _sums, 1000, 6, timeout_s=TIMEOUT_S) as first, Gang(2, _sums, 5000, 6, timeout_s=TIMEOUT_S) as second:
        assert first.address != second.address and first.address.startswith("127.0.0.1:")
        a, b = first.results(), second.results()
    assert [r["result"]["sums"] for r in a] == [[[2001.0, 2.0 * i] for i in range(6)]] * 2, a
    assert [r["result"]["sums"] for r in b] == [[[10001.0, 2.0 * i] for i in range(6)]] * 2, b
    assert [(r["result"]["min"], r["result"]["max"], r["result"]["control"]) for r in a + b] == [(100, 1, 13)] * 4


def _one_rank_dies(group: TPGroup, how: str) -> dict:
    group.all_reduce(torch.ones(1))  # everyone is up
    if group.rank == group.world_size - 1:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # a hang: alive, never joins the next collective
    start = time.monotonic()
    try:
        group.all_reduce(torch.ones(1))
    except Exception as exc:  # noqa: BLE001 - what the survivors see is the result
        return {"error": f"{type(exc).__name__}: {exc}", "elapsed": time.monotonic() - start}
    return {"completed": True}


@pytest.mark.timeout(150)  # spawning ranks imports torch: slow on a busy box, never stuck
@pytest.mark.parametrize(("how", "world_size"), [("kill", 3), ("hang", 2)])
def test_a_dead_or_hung_rank_fails_the_others_next_collective_within_the_timeout(how, world_size):
    with Gang(world_size, _one_rank_dies, how, timeout_s=TIMEOUT_S) as gang:
        survivors = gang.results(wait_s=45, ranks=list(range(world_size - 1)))
        if how == "kill":
            assert gang.results(wait_s=5, ranks=[world_size - 1]) == [{"gone": -signal.SIGKILL}]
    for r in survivors:
        assert "result" in r and "error" in r["result"], survivors
        assert r["result"]["elapsed"] < 30, r  # seconds, not the library's default minutes
    if how == "hang":  # a live peer is given up on at the timeout, not before
        assert survivors[0]["result"]["elapsed"] >= TIMEOUT_S * 0.8, survivors
    assert gang.all_ended()  # the hung rank was ended on the way out


def test_bad_settings_are_refused_before_any_connection():
    assert backend_for("cpu") == "gloo" and backend_for(torch.device("cuda", 1)) == "nccl"
    with pytest.raises(ValueError, match="TP timeout must be positive"):
        open_rendezvous("127.0.0.1", 2, 0)
    with pytest.raises(ValueError, match="is not host:port"):
        TPGroup(1, 2, "127.0.0.1", timeout_s=1)
    with pytest.raises(ValueError, match="rank 2 is not a rank of a TP group of 2"):
        TPGroup(2, 2, "127.0.0.1:1", timeout_s=1)
