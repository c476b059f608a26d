"""Helpers for the end-to-end tests: real Ray actors, real HTTP, real ZMQ.

Each test module owns one Ray instance (the module-scoped `ray_instance` fixture of tests/conftest.py,
started with `ray_init_kwargs`) and the deployments it starts; these helpers build configs, talk HTTP
and kill workers.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import ray
import requests

from pd.cluster.config import DeployConfig, load_deploy_config

REPO = Path(__file__).resolve().parents[2]
HTTP_TIMEOUT_S = 60

# Prompts with shared prefixes (two and three blocks of 16 byte-tokens) and odd lengths.
SHARED = "The quick brown fox jumps over the lazy dog while "
PROMPTS = [
    SHARED + "the cat sleeps.",
    SHARED + "the bird sings loudly in the morning sun.",
    SHARED + SHARED + "again and again",
    "short",
    "A completely different prompt that shares nothing with the others at all, " * 2,
    SHARED + "the cat sleeps. And then",
]


def e2e_config(name: str = "local.yaml", **overrides) -> DeployConfig:
    """A deploy/ config with test-friendly settings: any free port, short leases and timeouts."""
    config = load_deploy_config(REPO / "deploy" / name)
    settings = {"router__port": 0, "router__request_timeout_s": 30.0, "router__health_interval_s": 0.5,
                "transfer__lease_s": 5.0, "transfer__timeout_s": 5.0, "topology__cpus_per_worker": 0.1}
    settings.update(overrides)
    return config.replace(**settings)


def ray_init_kwargs() -> dict:
    # address="local": always a fresh instance, never a cluster named by RAY_ADDRESS or a stale session file
    return {"address": "local", "num_cpus": 2, "object_store_memory": 100 * 1024 * 1024, "include_dashboard": False}


def complete(url: str, prompt, **body) -> dict:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True, **body}
    resp = requests.post(f"{url}/v1/completions", json=body, timeout=HTTP_TIMEOUT_S)
    assert resp.status_code == 200, resp.text
    return resp.json()


def stream_events(url: str, prompt, **body) -> list[dict]:
    """All SSE `data:` payloads of a streamed completion (the last one is "[DONE]", the one before
    it the usage chunk, unless `stream_options` says otherwise)."""
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}, **body}
    events = []
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=HTTP_TIMEOUT_S) as resp:
        assert resp.status_code == 200, resp.text
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith(b"data: "):
                data = line[6:]
                events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events


def worker_reports(url: str, admin_key: str | None = None) -> dict:
    """`/pd/workers?refresh=1` (with `router.admin_key`, where the deployment has one)."""
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    resp = requests.get(f"{url}/pd/workers", params={"refresh": "1"}, headers=headers, timeout=HTTP_TIMEOUT_S)
    resp.raise_for_status()
    return resp.json()


def wait_all_free(url: str, timeout_s: float = 30.0, admin_key: str | None = None) -> dict:
    """Polls the workers' pool audits until every healthy worker's pool is all free.

    P workers free their blocks when D reports the pull done, which lands a
    moment after the client saw its last token, hence the polling.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        reports = worker_reports(url, admin_key)
        audits = {wid: r["stats"].get("audit", {}) for wid, r in reports.items() if r["healthy"]}
        if audits and all(a.get("all_free") for a in audits.values()):
            assert all(a.get("consistent") for a in audits.values()), audits
            return reports
        if time.monotonic() > deadline:
            pytest.fail(f"pools not all free after {timeout_s}s: {json.dumps(audits, indent=1)[:3000]}")
        time.sleep(0.2)


def kill_actor(actor) -> None:
    """Kills a worker's process and returns once Ray reports it dead (ray.kill is asynchronous)."""
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(actor.health.remote(), timeout=5)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return
        time.sleep(0.05)
    pytest.fail("killed actor still answers")
