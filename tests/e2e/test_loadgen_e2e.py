"""`python -m pd.loadgen` against a real 1P1D deployment whose router requires an API key.

One Ray instance and one deployment (`router.api_key` set) for the module; the
load generator runs as its own process, as a user runs it, and writes vLLM's
flat result JSON.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import requests

from pd.cluster.admin_key import generate_admin_key
from pd.deploy.launch import Deployment
from tests.helpers.e2e import REPO, e2e_config

API_KEY = "loadgen-test-key-" + "k" * 16
ADMIN_KEY = generate_admin_key()  # the metrics scrape's refresh (/pd/workers) takes it alone


@pytest.fixture(scope="module")
def keyed(ray_instance):
    # the keyless runs fail a dozen authentications from this address: a roomy auth throttle lets the
    # keyed runs that follow in at once (the throttle has tests of its own: test_auth_throttle.py)
    with Deployment(e2e_config("local.yaml", router__api_key=API_KEY, router__admin_key=ADMIN_KEY,
                               router__auth_throttle={"burst": 64})) as dep:
        yield dep


def _loadgen(args: list[str], env_key: str | None = None, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "PDKV_ADMIN_KEY")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    if env_key:
        env["OPENAI_API_KEY"] = env_key
    return subprocess.run([sys.executable, "-m", "pd.loadgen", *args], env=env, capture_output=True, text=True,
                          timeout=timeout_s, cwd=REPO)


def _assert_all_free(dep: Deployment) -> None:
    """Every worker's KV pool all free and consistent after the run (the router's /pd/workers needs the key)."""
    audits = dep.pool_audits()
    assert audits and all(a.get("all_free") and a.get("consistent") for a in audits.values()), audits


def _small(url: str, result: str, *extra: str) -> list[str]:
    return ["--base-url", url, "--num-prompts", "6", "--random-input-len", "40", "--random-output-len", "5",
            "--max-concurrency", "3", "--temperature", "0", "--disable-tqdm", "--save-result", "--save-detailed",
            "--result-filename", result, *extra]


def test_loadgen_with_api_key_flag_and_env(keyed, tmp_path):
    url = keyed.url
    refused = _loadgen(_small(url, str(tmp_path / "none.json")))  # no key: even /v1/models is refused
    assert refused.returncode == 2 and "HTTP 401" in refused.stderr, refused.stdout + refused.stderr
    refused = _loadgen(_small(url, str(tmp_path / "none.json"), "--model", "pdkv-tiny"))
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "HTTP 401" in refused.stdout  # every request refused, and the report says why

    # each run its own prompts (seed): a repeat would be served from D's prefix cache, with nothing to pull
    for seed, (name, args, env_key) in enumerate((("flag", ["--api-key", API_KEY, "--admin-key", ADMIN_KEY], None),
                                                  ("env", ["--admin-key", ADMIN_KEY], API_KEY))):
        out = tmp_path / f"{name}.json"
        run = _loadgen(_small(url, str(out), "--num-warmups", "1", "--seed", str(100 + seed), *args), env_key=env_key)
        assert run.returncode == 0, run.stdout + run.stderr
        result = json.loads(out.read_text())
        assert result["completed"] == 6 and result["failed"] == 0
        assert result["total_output_tokens"] == 30  # random dataset: ignore_eos, 5 tokens each
        for key in ("median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms", "request_throughput",
                    "output_throughput", "total_token_throughput", "itl_gaps_under_1ms", "pdkv_kv_bytes_recv"):
            assert key in result, key
        assert result["model_id"] == "pdkv-tiny" and result["pdkv_kv_bytes_recv"] > 0
        assert len(result["itls"]) == 6 and all(len(itl) == 4 for itl in result["itls"])
        # the router's TTFT breakdown, in the saved result and the printed report (1P1D: P's first token goes
        # to the client, so TTFT ends on P and D's pull comes after it)
        breakdown = result["pdkv_ttft_breakdown"]
        assert breakdown["num_requests"] == 6 and "prefill_compute_s" in breakdown["stages_p50_s"], breakdown
        assert "kv_transfer_s" not in breakdown["stages_p50_s"], breakdown
        assert "TTFT breakdown (the router's pdkv_timing" in run.stdout
    _assert_all_free(keyed)


def test_loadgen_multi_turn_resends_history(keyed, tmp_path):
    url = keyed.url
    out = tmp_path / "mt.json"
    run = _loadgen(["--base-url", url, "--api-key", API_KEY, "--dataset-name", "multi_turn",
                    "--multi-turn-num-turns", "3", "--num-prompts", "6", "--random-input-len", "20",
                    "--random-output-len", "4", "--ignore-eos", "--temperature", "0", "--disable-tqdm",
                    "--save-result", "--save-detailed", "--result-filename", str(out)])
    assert run.returncode == 0, run.stdout + run.stderr
    lens = json.loads(out.read_text())["input_lens"]  # server-counted prompt tokens, in dataset order
    for conversation in (lens[0:3], lens[3:6]):
        assert conversation[0] < conversation[1] < conversation[2], lens  # each turn carries the history
    _assert_all_free(keyed)


def test_loadgen_chat_backend(keyed, tmp_path):
    url = keyed.url
    probe = requests.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=30)
    if probe.status_code == 404:
        pytest.skip("this router has no /v1/chat/completions yet")
    out = tmp_path / "chat.json"
    run = _loadgen(_small(url, str(out), "--backend", "openai-chat", "--api-key", API_KEY))
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["completed"] == 6 and result["total_output_tokens"] == 30 and result["backend"] == "openai-chat"
    _assert_all_free(keyed)
