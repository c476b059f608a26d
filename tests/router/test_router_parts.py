"""The router's pure parts, without Ray or sockets: config validation, OpenAI
request parsing, stop strings, routing, Prometheus text, load-generator maths."""
from __future__ import annotations

from pathlib import Path

import pytest

from pd.router import openai_api as oa
from pd.cluster.config import ConfigError, DeployConfig, Mode, load_deploy_config
from pd.tools.loadgen.cli import arrival_delays
from pd.tools.loadgen.report import RequestRecord, compute_metrics, transfer_figures
from pd.tools.percentile import percentile
from pd.router.metrics import RouterMetrics, WorkerFigures
from pd.router.choice import LeastLoaded, NoWorkerAvailable, Role, WorkerEndpoint, WorkerPool
from pd.router.text_stream import TextStream
from pd.engine.text.tokenizer import ByteTokenizer
from tests.helpers.metrics_lint import assert_counters_grew, lint, promtool_problems


@pytest.mark.parametrize("data, message", [
    ({"topology": {"num_prefill": 0}}, "topology.num_prefill"),
    ({"topology": {"mode": "sideways"}}, "topology.mode: must be one of"),
    ({"cache": {"block_size": 12}}, "cache.block_size"),
    ({"cache": {"kv_memory_mb": "lots"}}, "cache.kv_memory_mb: expected float"),
    ({"router": {"port": 70000}}, "router.port"),
    ({"routr": {}}, "unknown key(s) ['routr']"),
    ({"model": {"dtype": "int3"}}, "model.dtype"),
    ({"transfer": {"kv_load_failure_policy": "pray"}}, "transfer.kv_load_failure_policy"),
])
def test_deploy_config_errors_name_the_key(data, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        DeployConfig.from_dict(data)


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[2] / "deploy").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_every_shipped_deploy_config_is_valid(path):
    import yaml

    if path.name.startswith("kuberay"):  # Kubernetes manifests: checked in tests/deploy/test_manifests.py
        docs = list(yaml.safe_load_all(path.read_text()))
        assert docs[0]["kind"] in ("RayJob", "RayService", "PersistentVolumeClaim")
        return
    config = load_deploy_config(path)
    assert config.topology.num_workers >= 1


def test_deploy_config_round_trips_through_json():
    config = DeployConfig.from_dict({"topology": {"mode": "colocated", "num_colocated": 3}})
    again = DeployConfig.from_json(config.to_json())
    assert again == config and again.topology.mode is Mode.COLOCATED and again.topology.num_workers == 3
    assert config.replace(router__port=0).router.port == 0


def test_parse_completion_request_defaults_and_stripping():
    req = oa.parse_completion_request({"prompt": "hi", "kv_transfer_params": {"remote_host": "evil"}},
                                      served_model="m", vocab_size=260)
    assert req.prompts == ("hi",) and req.max_tokens == 16 and not req.stream
    assert not hasattr(req, "kv_transfer_params")
    req = oa.parse_completion_request({"prompt": [[1, 2], [3]], "stop": "x"}, served_model="m", vocab_size=260)
    assert req.prompts == ((1, 2), (3,)) and req.stop == ("x",)
    with pytest.raises(oa.APIError) as err:
        oa.parse_completion_request({"prompt": ["a", "b"], "stream": True}, served_model="m", vocab_size=260)
    assert err.value.status == 400 and err.value.param == "prompt"


def test_text_stream_hides_stop_strings_and_cut_characters():
    tok = ByteTokenizer()
    stream = TextStream(tok, stop=["END"])
    shown = "".join(stream.push([b]) for b in "hello EN".encode())
    assert shown == "hello " and not stream.stopped  # "EN" held back: it may become "END"
    assert stream.push(list(b"D more")) == "" and stream.stopped
    stream = TextStream(tok)
    euro = "€".encode()
    assert stream.push([euro[0]]) == "" and stream.push(list(euro[1:])) == "€"
    assert stream.push(list(b"ab")) == "ab" and stream.flush() == ""


def test_least_loaded_routing_and_dead_workers():
    pool = WorkerPool(LeastLoaded())
    for i in range(2):
        pool.add(WorkerEndpoint(f"d{i}", Role.DECODE, f"http://d{i}"))
    pool.add(WorkerEndpoint("p0", Role.PREFILL, "http://p0"))
    first, second = pool.acquire(Role.DECODE), pool.acquire(Role.DECODE)
    assert {first.endpoint.worker_id, second.endpoint.worker_id} == {"d0", "d1"}
    pool.release(first)
    assert pool.acquire(Role.DECODE) is first
    pool.mark_dead("d0", "test")
    pool.mark_dead("d1", "test")
    with pytest.raises(NoWorkerAvailable):
        pool.pick(Role.DECODE)
    assert pool.pick(Role.PREFILL).endpoint.worker_id == "p0"


def _worker_figures(bytes_sent: int, loads: int) -> list[WorkerFigures]:
    transfer = {"bytes_sent": bytes_sent, "bytes_recv": 2 * bytes_sent, "failures": {"timeout": 1},
                "loads_ok": loads, "load_seconds": 0.004 * loads,
                "load_latency_buckets": [[0.001, 0], [0.005, loads], [0.01, loads]],
                "handshakes_refused": {'bad "peer"\n': 1}, "recv_gbps": 9.0, "load_latency_p99_s": 0.004}
    stats = {"kv_usage": 0.5, "num_running": 1, "num_waiting": 0, "prefix_cache_queries": 10 * loads,
             "prefix_cache_hits": 4 * loads, "num_preemptions": 0, "model_s": 0.1, "transfer": transfer,
             "num_blocks": True}  # a boolean is not a figure: skipped
    return [WorkerFigures("p0", "prefill", True, stats), WorkerFigures("d0", "decode", False, {"kv_usage": 0.9})]


def test_metrics_render_lint_and_loadgen_figures():
    figures = _worker_figures(4096, 2)
    metrics = RouterMetrics("tiny", lambda: figures)
    metrics.record_outcome("ok")
    metrics.record_prompt_tokens(5)
    metrics.record_tokens(1, 0.02, first=True)
    metrics.record_tokens(2, 0.01, first=False)
    metrics.record_request_end("length", 0.05)
    metrics.record_worker_failure("d0", "timeout")
    before = metrics.render().decode()
    samples = lint(before, "tiny")
    assert samples[("pdkv_requests_total", (("model_name", "tiny"), ("outcome", "ok")))] == 1.0
    assert samples[("vllm:time_to_first_token_seconds_count", (("model_name", "tiny"),))] == 1.0
    assert samples[("vllm:generation_tokens_total", (("model_name", "tiny"),))] == 3.0
    assert samples[("vllm:request_success_total", (("finished_reason", "length"), ("model_name", "tiny")))] == 1.0
    p0 = (("model_name", "tiny"), ("role", "prefill"), ("worker", "p0"))
    assert samples[("pdkv_kv_transfer_bytes_sent_total", p0)] == 4096.0
    assert samples[("pdkv_kv_transfer_load_seconds_bucket", (("le", "0.005"),) + p0)] == 2.0
    assert samples[("vllm:kv_cache_usage_perc", (("engine", "p0"), ("model_name", "tiny"), ("role", "prefill")))] == 0.5
    assert not any(name == "pdkv_worker_num_blocks" for name, _ in samples)
    # a worker out of the rotation exports only its up gauge, not its stale figures
    assert samples[("pdkv_worker_up", (("model_name", "tiny"), ("role", "decode"), ("worker", "d0")))] == 0.0
    assert not any(dict(labels).get("worker") == "d0" for name, labels in samples if name != "pdkv_worker_up"
                   and not name.startswith("pdkv_worker_failures"))
    problems = promtool_problems(before)
    assert not problems, problems  # None (no promtool) passes here; the e2e test reports the skip

    figures[:] = _worker_figures(5120, 3)
    after = metrics.render().decode()
    assert assert_counters_grew(samples, lint(after, "tiny"), before) > 0
    report = transfer_figures(before, after)
    assert report["bytes_sent"] == 1024.0 and report["loads"] == 1.0 and report["failures"] == 0.0
    assert report["load_latency_mean_ms"] == {"p0": pytest.approx(4.0)}
    assert 1.0 < report["load_latency_p50_ms"]["p0"] <= 5.0
    assert report["prefix_hit_rate"] == {"p0": pytest.approx(0.4)} and report["kv_usage"] == {"p0": 0.5}


def test_loadgen_datasets(tmp_path):
    from pd.tools.loadgen.cli import parse_args
    from pd.tools.loadgen.data import ByteLengths, make_dataset

    tok = ByteLengths()
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "hello", "output_tokens": 3}\n\n{"prompt": "bye"}\n')
    rows = make_dataset(parse_args(["--dataset-name", "custom", "--dataset-path", str(data), "--num-prompts", "3",
                                    "--random-output-len", "5"]), tok)
    assert [(r.prompt, r.expected_output_len) for r in rows] == [("hello", 3), ("bye", 5), ("hello", 3)]
    rows = make_dataset(parse_args(["--dataset-name", "prefix_repetition", "--num-prompts", "4",
                                    "--prefix-repetition-prefix-len", "20", "--prefix-repetition-suffix-len", "19",
                                    "--prefix-repetition-num-prefixes", "2"]), tok)
    prefixes = {r.prompt[:19] for r in rows}
    assert len(prefixes) == 2 and len({r.prompt for r in rows}) == 4
    assert all(r.prompt_len == tok.count(r.prompt) == 41 for r in rows)  # BOS + 20 + space + 19
    rows = make_dataset(parse_args(["--num-prompts", "50", "--random-input-len", "20", "--random-range-ratio", "0.5",
                                    "--random-output-len", "10", "--seed", "3"]), tok)
    assert all(10 <= r.prompt_len - 1 <= 30 and 5 <= r.expected_output_len <= 15 for r in rows)
    assert len({r.prompt_len for r in rows}) > 5  # lengths really vary


def test_loadgen_maths():
    delays = arrival_delays(2000, rate=50.0, burstiness=1.0, seed=0)
    assert delays == sorted(delays) and 30 < delays[-1] < 50  # ~2000/50 s
    assert arrival_delays(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
    assert percentile([1, 2, 3, 4], 50) == 2.5
    recs = [RequestRecord(10, 4, True, "", 4, 0.1, 0.4, [0.1, 0.0005, 0.1], chunk_times=[0.1, 0.2, 0.2005, 0.3005]),
            RequestRecord(10, 4, error="HTTP 502")]
    m = compute_metrics(recs, 1.0, {"ttft": 50}, ("ttft", "tpot", "itl"), (50.0, 99.9))
    assert m["completed"] == 1 and m["failed"] == 1 and m["request_goodput"] == 0.0
    assert m["mean_tpot_ms"] == pytest.approx(100.0) and m["median_ttft_ms"] == pytest.approx(100.0)
    assert "p99.9_itl_ms" in m and "p50_tpot_ms" in m and "mean_e2el_ms" not in m
    assert m["itl_gaps_under_1ms"] == 1 and m["itl_gaps_under_1ms_share"] == pytest.approx(1 / 3)
    assert m["total_output_tokens"] == 4 and m["mean_tokens_per_chunk"] == 1.0


def test_router_api_key_and_no_workers_over_real_http():
    import asyncio

    import aiohttp

    from pd.cluster.admin_key import generate_admin_key
    from pd.router.server import Router

    async def scenario() -> None:
        config = DeployConfig.from_dict({"router": {"port": 0, "api_key": "k" * 20}})
        router = Router(config, [], "s" * 32)
        url = await router.start()
        try:
            async with aiohttp.ClientSession() as http:
                body = {"prompt": "hi", "max_tokens": 2}
                async with http.post(f"{url}/v1/completions", json=body) as resp:
                    assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
                auth = {"Authorization": "Bearer " + "k" * 20}
                async with http.post(f"{url}/v1/completions", json=body, headers=auth) as resp:
                    error = (await resp.json())["error"]
                    assert resp.status == 503 and error["code"] == "no_worker_available", error
                async with http.get(f"{url}/health") as resp:
                    assert resp.status == 503
                async with http.get(f"{url}/metrics") as resp:  # API keys set: /metrics takes the admin key,
                    assert resp.status == 403 and "metrics_auth" in await resp.text()  # and there is none
        finally:
            await router.stop()
        opened = Router(config.replace(router__metrics_auth=False), [], "s" * 32)  # explicitly open
        url = await opened.start()
        try:
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{url}/metrics") as resp:
                    assert resp.status == 200 and "pdkv_requests_total" in await resp.text()
        finally:
            await opened.stop()
        admin_key = generate_admin_key()
        guarded = Router(config.replace(router__admin_key=admin_key), [], "s" * 32, metrics_require_key=True)
        url = await guarded.start()
        try:
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{url}/metrics") as resp:
                    assert resp.status == 401
                async with http.get(f"{url}/metrics", headers={"Authorization": "Bearer " + "k" * 20}) as resp:
                    assert resp.status == 403  # an API key is not the admin key
                async with http.get(f"{url}/metrics", headers={"Authorization": "Bearer " + admin_key}) as resp:
                    assert resp.status == 200 and "vllm:num_requests_running" in await resp.text()
        finally:
            await guarded.stop()

    asyncio.run(scenario())
