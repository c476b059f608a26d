"""Tensor-parallel workers served through Ray (`pd.deploy.launch.Deployment`, what `python -m pd.launch`
runs), over real HTTP, against a colocated TP 1 deployment of the same model: a colocated gang of 2 ranks
(gloo between two processes), deploy/local-tp.yaml (P at TP 2, D at TP 1) and P at TP 1 with D at TP 2
give its greedy tokens, every worker's health names its ranks, D loads the KV P computed (rank to rank:
blocks and bytes received, no failed load, so nothing recomputed), and the pool audit covers every rank
of every gang."""
from __future__ import annotations

import json

import psutil
import pytest
import ray

from pd.deploy.launch import Deployment
from tests.helpers.e2e import PROMPTS, complete, e2e_config

MAX_TOKENS = 16


def _tokens(url: str) -> list[list[int]]:
    return [complete(url, prompt, max_tokens=MAX_TOKENS, ignore_eos=True)["choices"][0]["token_ids"]
            for prompt in PROMPTS]


@pytest.fixture(scope="module")
def reference(ray_instance) -> list[list[int]]:
    config = e2e_config("local-tp.yaml", topology__mode="colocated", topology__prefill_tp=1)
    with Deployment(config) as dep:
        return _tokens(dep.url)


def _health(dep: Deployment) -> dict[str, dict]:
    return {w.endpoint.worker_id: json.loads(ray.get(w.actor.health.remote(), timeout=30)) for w in dep.workers}


def _transfer(dep: Deployment, worker_id: str) -> dict:
    (worker,) = [w for w in dep.workers if w.endpoint.worker_id == worker_id]
    return json.loads(ray.get(worker.actor.stats.remote(), timeout=30))["transfer"]


def _assert_d_loaded_the_kv(dep: Deployment) -> None:
    """D took every prompt's KV from P: loads landed, none failed (a failed load is recomputed on D)."""
    received = _transfer(dep, "decode-0")
    assert received["loads_ok"] >= 1 and received["blocks_recv"] > 0 and received["bytes_recv"] > 0, received
    assert received["failures_total"] == 0, received["failures"]
    sent = _transfer(dep, "prefill-0")  # P counts canonical pages (every rank's heads), as D does
    assert (sent["blocks_sent"], sent["bytes_sent"]) == (received["blocks_recv"], received["bytes_recv"])


def _audited_ranks(dep: Deployment) -> dict[str, list[dict]]:
    """Each worker's pool audit per rank; the deployment's report must be clean (every worker, every rank)."""
    report = dep.audit_pools(timeout_s=30)
    assert report.clean, report.lines()
    return {wid: audit.get("ranks", [{"rank": 0, **audit}]) for wid, audit in report.audits.items()}


def test_a_colocated_gang_of_two_gives_tp_one_greedy_tokens(ray_instance, reference):
    config = e2e_config("local-tp.yaml", topology__mode="colocated", topology__prefill_tp=1,
                        topology__colocated_tp=2)
    with Deployment(config) as dep:
        assert _tokens(dep.url) == reference
        (health,) = _health(dep).values()
        assert health["status"] == "ok" and health["tp"]["size"] == 2
        ranks = health["tp"]["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1] and all(r["alive"] for r in ranks)
        assert ranks[0]["pid"] == health["pid"] and ranks[1]["pid"] != health["pid"]
        assert psutil.pid_exists(ranks[1]["pid"])
        (audits,) = _audited_ranks(dep).values()
        assert [a["rank"] for a in audits] == [0, 1] and all(a.get("all_free", True) for a in audits)
        assert audits[1]["num_steps"] > 0  # the follower ran the steps (its shard took part)
        follower = ranks[1]["pid"]
    assert not psutil.pid_exists(follower) or psutil.Process(follower).status() == psutil.STATUS_ZOMBIE


def test_prefill_at_tp_two_and_decode_at_tp_one_serve_through_the_launcher(ray_instance, reference):
    config = e2e_config("local-tp.yaml")
    assert (config.topology.prefill_tp, config.topology.decode_tp) == (2, 1)
    with Deployment(config) as dep:
        assert _tokens(dep.url) == reference
        health = _health(dep)
        assert health["prefill-0"]["tp"]["size"] == 2 and "tp" not in health["decode-0"]
        _assert_d_loaded_the_kv(dep)  # each P rank served its heads, D's one rank took them all
        audits = _audited_ranks(dep)
        assert [a["rank"] for a in audits["prefill-0"]] == [0, 1] and len(audits["decode-0"]) == 1
        assert dep.audit_pools().lines() == ["KV pools after the run: all free (2 of 2 workers audited, 3 ranks)"]
        assert audits["prefill-0"][1]["num_steps"] > 0


def test_prefill_at_tp_one_and_decode_at_tp_two_move_the_kv_rank_to_rank(ray_instance, reference):
    config = e2e_config("local-tp.yaml", topology__prefill_tp=1, topology__decode_tp=2)
    with Deployment(config) as dep:
        assert _tokens(dep.url) == reference
        health = _health(dep)
        assert health["decode-0"]["tp"]["size"] == 2 and "tp" not in health["prefill-0"]
        _assert_d_loaded_the_kv(dep)  # each D rank pulled its own heads from P's one rank
        audits = _audited_ranks(dep)  # P's pool all free: D's DONE released every lease
        assert len(audits["prefill-0"]) == 1 and [a["rank"] for a in audits["decode-0"]] == [0, 1]
        assert audits["decode-0"][1]["num_steps"] > 0
        assert audits["decode-0"][1]["kv_bytes_received"] > 0  # D's rank 1 pulled its own heads


def test_a_prefill_rank_killed_mid_transfer_fails_the_load_and_d_recomputes(ray_instance, reference):
    """P's rank 1 dies as it answers its first slice pull (tcp: D's rank reads it over its own stream):
    D's load fails, the recompute policy prefills on D, the stream is served with the right tokens."""
    config = e2e_config("local-tp.yaml", transfer__data_path="tcp", transfer__kv_load_failure_policy="recompute",
                        faults__prefill="gang.rank1.slice:kill")
    with Deployment(config) as dep:
        out = complete(dep.url, PROMPTS[0], max_tokens=MAX_TOKENS, ignore_eos=True)
        assert out["choices"][0]["token_ids"] == reference[0]
        received = _transfer(dep, "decode-0")
        assert received["failures_total"] >= 1 and received["loads_ok"] == 0, received
