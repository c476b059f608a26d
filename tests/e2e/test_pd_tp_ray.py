"""Tensor-parallel workers served through Ray (`pd.deploy.launch.Deployment`, what `python -m pd.launch`
runs), over real HTTP, against a colocated TP 1 deployment of the same model: a colocated gang of 2 ranks
(gloo between two processes) and deploy/local-tp.yaml (P at TP 2, D at TP 1) give its greedy tokens, every
worker's health names its ranks, and the pool audit covers every rank of every gang."""
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
        # until KV moves rank to rank, no KV leaves a gang: D prefills what a TP 2 P computed
        assert health["prefill-0"]["kv_transfer"] == health["decode-0"]["kv_transfer"] == "recompute"
        audits = _audited_ranks(dep)
        assert [a["rank"] for a in audits["prefill-0"]] == [0, 1] and len(audits["decode-0"]) == 1
        assert dep.audit_pools().lines() == ["KV pools after the run: all free (2 of 2 workers audited, 3 ranks)"]
        assert audits["prefill-0"][1]["num_steps"] > 0


def test_with_a_decode_gang_prefill_keeps_nothing_and_decode_prefills_itself(ray_instance, reference):
    config = e2e_config("local-tp.yaml", topology__prefill_tp=1, topology__decode_tp=2,
                        transfer__lease_s=60.0)  # a block P kept for D would outlive the audit's wait
    with Deployment(config) as dep:
        assert _tokens(dep.url) == reference
        health = _health(dep)
        assert health["decode-0"]["tp"]["size"] == 2 and "tp" not in health["prefill-0"]
        assert health["prefill-0"]["kv_transfer"] == health["decode-0"]["kv_transfer"] == "recompute"
        audits = _audited_ranks(dep)  # P's pool all free: it kept no block for D
        assert len(audits["prefill-0"]) == 1 and [a["rank"] for a in audits["decode-0"]] == [0, 1]
        assert audits["decode-0"][1]["num_steps"] > 0
