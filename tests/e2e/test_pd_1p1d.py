"""1P1D on a local Ray instance against the colocated baseline, over real HTTP.

One Ray instance for the module; two deployments share it: `colocated`
(one worker does everything) and `pd` (1 prefill + 1 decode worker with the
ZMQ connector). Greedy outputs must be identical token for token.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import time

import pytest
import requests

from pd.deploy.launch import Deployment
from tests.helpers.e2e import (PROMPTS, complete, e2e_config, stream_events, wait_all_free,
                                worker_reports)
from dashboard_checks import check_dashboard_queries, check_render_tool
from tests.helpers.metrics_lint import VLLM_SAMPLES, assert_counters_grew, lint, promtool_problems


@pytest.fixture(scope="module")
def colocated(ray_instance):
    with Deployment(e2e_config("local-colocated.yaml")) as dep:
        yield dep.url


@pytest.fixture(scope="module")
def pd(ray_instance):
    with Deployment(e2e_config("local.yaml")) as dep:
        yield dep.url


def test_health_models_and_topology(pd):
    health = requests.get(f"{pd}/health", timeout=10).json()
    assert health["status"] == "ok", health
    models = requests.get(f"{pd}/v1/models", timeout=10).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "pdkv-tiny"
    roles = sorted(r["role"] for r in worker_reports(pd).values())
    assert roles == ["decode", "prefill"]


def test_greedy_outputs_match_colocated(pd, colocated):
    for prompt in PROMPTS + [[256, 1, 2, 3, 4, 5, 6, 7, 8, 9] * 4]:
        want = complete(colocated, prompt, max_tokens=16, ignore_eos=True)["choices"][0]
        got = complete(pd, prompt, max_tokens=16, ignore_eos=True)["choices"][0]
        assert got["token_ids"] == want["token_ids"], prompt
        assert got["text"] == want["text"]
        assert got["finish_reason"] == "length"


def test_seeded_sampling_matches_colocated(pd, colocated):
    for seed in (7, 8):
        want = complete(colocated, PROMPTS[1], temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True)
        got = complete(pd, PROMPTS[1], temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True)
        assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]


def test_worker_api_requires_the_deployment_secret(pd):
    for report in worker_reports(pd).values():
        worker_url = report["url"]
        assert requests.get(f"{worker_url}/internal/stats", timeout=10).status_code == 401
        wrong = {"Authorization": "Bearer " + "0" * 64}
        assert requests.post(f"{worker_url}/internal/generate", json={}, headers=wrong, timeout=10).status_code == 401


def test_batch_prompts_in_one_request(pd, colocated):
    want = complete(colocated, PROMPTS[:3], ignore_eos=True)
    got = complete(pd, PROMPTS[:3], ignore_eos=True)
    assert [c["token_ids"] for c in got["choices"]] == [c["token_ids"] for c in want["choices"]]
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]


def test_streaming_matches_non_streaming(pd):
    prompt = PROMPTS[1]
    whole = complete(pd, prompt, max_tokens=20, ignore_eos=True)
    events = stream_events(pd, prompt, max_tokens=20, ignore_eos=True)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 20
    chunks = events[:-2]
    assert len(chunks) > 1  # really streamed, not one blob
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == whole["choices"][0]["token_ids"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_client_disconnect_aborts_the_request(pd):
    aborted_before = worker_reports(pd)["decode-0"]["stats"]["num_aborted"]
    body = {"prompt": PROMPTS[4], "max_tokens": 700, "temperature": 0, "stream": True, "ignore_eos": True}
    with requests.post(f"{pd}/v1/completions", json=body, stream=True, timeout=60) as resp:
        assert resp.status_code == 200, resp.text
        lines = resp.iter_lines()
        got = [line for line, _ in zip(lines, range(6)) if line.startswith(b"data: ")]
        assert got  # streaming had started; leaving the block closes the connection
    reports = wait_all_free(pd)  # D aborted the request and freed its blocks
    assert reports["decode-0"]["stats"]["num_aborted"] == aborted_before + 1
    assert all(r["num_in_flight"] == 0 for r in reports.values())  # the router released its count too


def test_stop_string_cuts_output(pd):
    full = complete(pd, PROMPTS[0], max_tokens=24, ignore_eos=True)["choices"][0]["text"]
    visible = full.replace("\ufffd", "")
    if len(visible) < 3:
        pytest.skip("random model produced no printable text to stop on")
    stop = visible[1:3]
    cut = complete(pd, PROMPTS[0], max_tokens=24, ignore_eos=True, stop=[stop])["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert stop not in cut["text"] and full.startswith(cut["text"])


def test_client_kv_transfer_params_are_ignored(pd, colocated):
    bogus = {"do_remote_prefill": True, "remote_host": "10.255.255.1", "remote_port": 1,
             "remote_engine_id": "evil", "remote_block_ids": [[1, 2, 3]], "remote_request_id": "x"}
    want = complete(colocated, PROMPTS[3], ignore_eos=True)["choices"][0]["token_ids"]
    got = complete(pd, PROMPTS[3], ignore_eos=True, kv_transfer_params=bogus)["choices"][0]["token_ids"]
    assert got == want


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": [1, 2, 99999]}, 400, "prompt"),
    ({"max_tokens": 4}, 400, "prompt"),
    ({"prompt": "x", "model": "gpt-17"}, 404, "model"),
    ({"prompt": "x" * 1100, "max_tokens": 4}, 400, "max_tokens"),
])
def test_bad_requests_get_openai_errors(pd, body, status, param):
    resp = requests.post(f"{pd}/v1/completions", json=body, timeout=10)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]


def test_not_json_and_unknown_route(pd):
    resp = requests.post(f"{pd}/v1/completions", data=b"{nope", timeout=10)
    assert resp.status_code == 400 and "error" in resp.json()
    resp = requests.get(f"{pd}/v1/nothing", timeout=10)
    assert resp.status_code == 404 and "error" in resp.json()


def test_openai_client_library(pd, colocated):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{pd}/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["pdkv-tiny"]
    result = client.completions.create(model="pdkv-tiny", prompt=PROMPTS[2], max_tokens=10, temperature=0)
    want = complete(colocated, PROMPTS[2], max_tokens=10)["choices"][0]["text"]
    assert result.choices[0].text == want and result.usage.completion_tokens <= 10
    pieces, usage = [], None
    for chunk in client.completions.create(model="pdkv-tiny", prompt=PROMPTS[2], max_tokens=10, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == want and usage.prompt_tokens == len(PROMPTS[2].encode()) + 1
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="pdkv-tiny", prompt="x", max_tokens=-1)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_curl(pd):
    body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0})
    out = subprocess.run(["curl", "-sS", "--max-time", "60", f"{pd}/v1/completions", "-H",
                          "Content-Type: application/json", "-d", body], capture_output=True, check=True, text=True)
    assert json.loads(out.stdout)["usage"]["completion_tokens"] >= 1
    out = subprocess.run(["curl", "-sSN", "--max-time", "60", f"{pd}/v1/completions", "-H",
                          "Content-Type: application/json", "-d", body[:-1] + ', "stream": true}'],
                         capture_output=True, check=True, text=True)
    assert out.stdout.rstrip().endswith("data: [DONE]") and out.stdout.count("data: ") >= 3


def _scrape(url: str) -> str:
    resp = requests.get(f"{url}/metrics", timeout=10)
    assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/plain"), resp.text[:200]
    return resp.text


def _by_worker(samples: dict, name: str) -> dict[str, float]:
    return {dict(labels)["worker"]: v for (n, labels), v in samples.items() if n == name}


def test_metrics_scrape_lints_clean_and_counters_grow(pd):
    complete(pd, PROMPTS[0])
    worker_reports(pd)  # a poll now: /metrics shows the workers' figures as of the last poll
    before_text = _scrape(pd)
    before = lint(before_text, "pdkv-tiny")
    for prompt in PROMPTS[:3]:
        complete(pd, prompt)
    stream_events(pd, PROMPTS[1])
    worker_reports(pd)
    after_text = _scrape(pd)
    after = lint(after_text, "pdkv-tiny")
    assert assert_counters_grew(before, after, before_text) > 10
    names = {name for name, _ in after}
    missing = [name for name in VLLM_SAMPLES if name not in names]
    assert not missing, missing
    received = _by_worker(after, "pdkv_kv_transfer_bytes_recv_total")
    sent = _by_worker(after, "pdkv_kv_transfer_bytes_sent_total")
    assert received["decode-0"] > 0 and sent["prefill-0"] > 0  # KV really moved P -> D
    assert _by_worker(after, "pdkv_kv_transfer_load_seconds_count")["decode-0"] >= 4
    assert sum(v for (n, _), v in after.items() if n == "pdkv_kv_transfer_failures_total") == 0
    assert _by_worker(after, "pdkv_worker_prefix_cache_hits_total")["prefill-0"] > 0  # shared prefixes hit P
    engines = {dict(labels)["engine"] for (n, labels) in after if n == "vllm:kv_cache_usage_perc"}
    assert engines == {"prefill-0", "decode-0"}
    problems = promtool_problems(after_text)
    if problems is None:
        pytest.skip("promtool not on PATH (apt package `prometheus`): the lint above ran, promtool did not")
    assert not problems, problems


def test_metrics_scrape_never_waits_on_a_frozen_worker(pd):
    """A scrape serves the last poll's figures: with the decode worker's process stopped
    (SIGSTOP), /metrics still answers at once, its figures included."""
    psutil = pytest.importorskip("psutil")
    complete(pd, PROMPTS[3])
    port = int(worker_reports(pd)["decode-0"]["url"].rsplit(":", 1)[1])
    pids = {c.pid for c in psutil.net_connections(kind="tcp") if c.laddr and c.laddr.port == port
            and c.status == psutil.CONN_LISTEN and c.pid}
    assert len(pids) == 1, pids
    frozen = psutil.Process(pids.pop())
    frozen.suspend()
    try:
        t0 = time.monotonic()
        samples = lint(_scrape(pd), "pdkv-tiny")  # the old synchronous poll waited 10 s here
        waited = time.monotonic() - t0
        assert waited < 2.0, waited
        assert _by_worker(samples, "pdkv_worker_num_running")["decode-0"] == 0
        assert _by_worker(samples, "pdkv_worker_up")["decode-0"] == 1.0
    finally:
        frozen.resume()
    assert worker_reports(pd)["decode-0"]["healthy"]  # the pause was shorter than the health limit


def test_loadgen_writes_json_and_png(pd, tmp_path):
    from pd.tools.loadgen import cli as loadgen

    result_json, plot = tmp_path / "result.json", tmp_path / "latency.png"
    rc = loadgen.main(["--base-url", pd, "--dataset-name", "prefix_repetition", "--num-prompts", "8",
                       "--request-rate", "20", "--prefix-repetition-prefix-len", "24",
                       "--prefix-repetition-suffix-len", "24", "--prefix-repetition-num-prefixes", "2",
                       "--output-len", "6", "--max-concurrency", "4", "--seed", "1", "--temperature", "0",
                       "--ignore-eos", "--goodput", "ttft:60000", "--percentile-metrics", "ttft,tpot,itl,e2el",
                       "--metric-percentiles", "50,99", "--save-result", "--result-filename", str(result_json),
                       "--plot", str(plot), "--disable-tqdm"])
    assert rc == 0
    result = json.loads(result_json.read_text())
    assert result["completed"] == 8 and result["failed"] == 0 and result["total_output_tokens"] == 48
    assert result["p99_ttft_ms"] > 0 and result["median_e2el_ms"] > 0 and result["request_goodput"] > 0
    assert result["pdkv_kv_bytes_recv"] > 0  # the workers' KV transfer figures sit beside vLLM's keys
    assert 0 <= result["itl_gaps_under_1ms"] <= result["num_itl_gaps"] == 8 * 5
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_dashboard_query_names_a_metric_the_live_router_exports(pd):
    check_dashboard_queries(pd)


def test_the_dashboard_render_tool_scrapes_the_live_router(pd, tmp_path):
    check_render_tool(pd, tmp_path)


def test_zz_every_pool_is_all_free_after_the_run(pd, colocated):
    for url in (pd, colocated):
        reports = wait_all_free(url)
        assert all(r["healthy"] for r in reports.values())
