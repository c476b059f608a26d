"""A TP gang is the unit of health and restart, on real Ray actors over real HTTP (a colocated worker of
2 ranks, gloo between two processes): SIGKILL of either rank while requests stream takes the worker out
of the router's rotation within 5 s, every stream ends (with an error: no other worker could take it),
Ray restarts the whole gang with a fresh rendezvous, the next request succeeds with the undisturbed
tokens, and no process of the old gang is left (the killed one, its peer, any follower). A follower that
hangs (SIGSTOP) does the same once a collective waited `tp_timeout_s` for it."""
from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest
import ray

from pd.deploy.launch import Deployment
from tests.helpers.e2e import PROMPTS, complete, e2e_config
from tests.reliability.test_ray_recovery import Stream

UNHEALTHY_WITHIN_S = 5.0
BACK_WITHIN_S = 150.0  # a new rank 0 process, then a new follower: each imports torch and builds its shard
NUM_TOKENS = 400  # long enough that the kill lands mid-decode on two busy cores
TP_TIMEOUT_S = 5.0  # a hung rank is seen at the collective timeout (a dead one at once)


@pytest.fixture(scope="module")
def gang(ray_instance):
    config = e2e_config("local-tp.yaml", topology__mode="colocated", topology__prefill_tp=1,
                        topology__colocated_tp=2, topology__tp_timeout_s=TP_TIMEOUT_S,
                        router__request_timeout_s=60.0)
    with Deployment(config) as dep:
        want = complete(dep.url, PROMPTS[0], max_tokens=8, ignore_eos=True)["choices"][0]["token_ids"]
        yield dep, want


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _followers() -> list[int]:
    """Every live process of a ShardActor on this machine (Ray names a worker process after its actor)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if cmdline.startswith("ray::ShardActor") and _running(proc.info["pid"]):
            found.append(proc.info["pid"])
    return found


def _tp_health(dep: Deployment) -> dict:
    health = json.loads(ray.get(dep.workers[0].actor.health.remote(), timeout=30))
    assert health["status"] == "ok" and all(r["alive"] for r in health["tp"]["ranks"]), health
    return health


def _wait(predicate, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.mark.parametrize("rank, how", [(1, signal.SIGKILL), (0, signal.SIGKILL), (1, signal.SIGSTOP)],
                         ids=["kill-rank-1", "kill-rank-0", "hang-rank-1"])
def test_a_rank_lost_mid_decode_takes_the_gang_out_and_it_comes_back(gang, rank, how, fault_record):
    dep, want = gang
    load = dep.router.pool.get("both-0")
    _wait(lambda: load.healthy, BACK_WITHIN_S, "the worker in rotation")
    health = _tp_health(dep)
    old = [r["pid"] for r in health["tp"]["ranks"]]
    assert _followers() == old[1:]  # one follower process, the gang's
    streams = [Stream(dep.url, prompt, NUM_TOKENS) for prompt in PROMPTS[:2]]
    for s in streams:
        s.start()
    _wait(lambda: all(len(s.token_ids) >= 4 for s in streams), 60, "tokens streaming")

    os.kill(old[rank], how)
    within = UNHEALTHY_WITHIN_S + (TP_TIMEOUT_S if how == signal.SIGSTOP else 0.0)
    took = _wait(lambda: not load.healthy, within, f"rank {rank} {how.name}: the worker out of rotation")
    for s in streams:
        s.join(60)
        assert not s.is_alive(), "a stream did not end"
        assert len(s.token_ids) < NUM_TOKENS and (s.errors or s.failure is not None), (s.errors, s.failure)
    # the whole old gang is gone: the killed rank, and the other one (its process exits, or Ray ends it)
    _wait(lambda: not any(_running(pid) for pid in old), 30, "the old gang's processes gone")

    back = _wait(lambda: load.healthy, BACK_WITHIN_S, "the gang restarted and back in rotation")
    assert complete(dep.url, PROMPTS[0], max_tokens=8, ignore_eos=True)["choices"][0]["token_ids"] == want
    health = _tp_health(dep)
    new = [r["pid"] for r in health["tp"]["ranks"]]
    assert not set(new) & set(old) and _followers() == new[1:]  # a fresh gang, no orphan follower
    fault_record(fault=f"{how.name} of TP rank {rank} mid-decode", where="colocated gang of 2 (gloo)",
                 user_saw="the streams end with an error", pdkv_did=f"out of rotation in {took:.1f} s, "
                 f"the whole gang restarted by Ray (back in {back:.0f} s), no process left", pools="new gang")
