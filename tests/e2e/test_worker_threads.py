"""`topology.threads_per_worker` reaches the worker processes that Ray starts.

Ray starts an actor whose `num_cpus` is below 1 with OMP_NUM_THREADS=1, so before this
setting every worker computed on one thread. Here real worker actors (a tiny model, one
prefill and one decode worker) report the thread count their engine loop computes with
in their health answer; 3 is what neither Ray nor torch would pick on its own here.
"""
from __future__ import annotations

import json
import secrets

import ray

from tests.helpers.e2e import e2e_config
from pd.deploy.placement import start_workers, stop_workers


def _thread_counts(config) -> dict[str, int]:
    started = start_workers(config, secrets.token_hex(16))
    try:
        answers = ray.get([w.actor.health.remote() for w in started], timeout=60)
    finally:
        stop_workers([w.actor for w in started])
    return {w.endpoint.worker_id: json.loads(a)["num_threads"] for w, a in zip(started, answers, strict=True)}


def test_workers_compute_with_the_configured_threads(ray_instance):
    counts = _thread_counts(e2e_config(topology__threads_per_worker=3))
    assert len(counts) == 2 and set(counts.values()) == {3}, counts


def test_unset_follows_the_cpus_ray_reserves(ray_instance):
    config = e2e_config(topology__cpus_per_worker=0.1)
    assert config.topology.threads_per_worker is None
    counts = _thread_counts(config)
    assert set(counts.values()) == {config.topology.resolved_threads_per_worker} == {1}, counts
