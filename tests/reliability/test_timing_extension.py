"""The opt-in `pdkv_timing` extension (header `x-pdkv-timing: 1`), the `pdkv_ttft_stage_seconds`
histogram, tracing off (no span at all) and the `include_content` switch, on an in-process 1P1D
deployment (real workers, ZMQ connector, router, loopback HTTP)."""
from __future__ import annotations

import json
import secrets

import pytest
import requests

from pd.router.timeline import STAGES
from rel_deploy import LocalDeployment, local_config

HEADERS = {"x-pdkv-timing": "1"}
# the stages are rounded to the microsecond each; the worker's StepTiming figures are measured on its
# own clock reads: allow a little slack for both, never a speed
SUM_SLACK_S = 0.002
# P's first token goes to the client (router.first_token_from_prefill, the default): TTFT ends on P
P_D_STAGES = {"parse_s", "tokenize_s", "admission_s", "route_s", "prefill_queue_s", "prefill_compute_s"}
# a seeded request keeps D's first token: D's pull, queue and first step are in its TTFT
D_FIRST_STAGES = P_D_STAGES | {"kv_transfer_s", "decode_queue_s", "decode_compute_s"}


@pytest.fixture(scope="module")
def dep():
    with LocalDeployment(local_config()) as d:
        yield d


def _body(prompt: str, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}


def _sse(url: str, body: dict, headers: dict) -> list[dict]:
    with requests.post(f"{url}/v1/completions", json={**body, "stream": True}, headers=headers, stream=True,
                       timeout=30) as resp:
        assert resp.status_code == 200, resp.text
        return [json.loads(line[6:]) for line in resp.iter_lines()
                if line.startswith(b"data: ") and line != b"data: [DONE]"]


def _check(timing: dict, want: set[str]) -> None:
    stages = timing["stages"]
    assert set(stages) == want and set(stages) <= set(STAGES)
    assert all(v >= 0 for v in stages.values())
    assert sum(stages.values()) <= timing["ttft_s"] + SUM_SLACK_S, timing


def test_the_header_asks_for_the_extension(dep):
    plain = requests.post(f"{dep.url}/v1/completions", json=_body("one two three"), timeout=30).json()
    assert "pdkv_timing" not in plain
    assert all("pdkv_timing" not in c for c in _sse(dep.url, _body("one two three"), {}))
    off = requests.post(f"{dep.url}/v1/completions", json=_body("one two three"), headers={"x-pdkv-timing": "0"},
                        timeout=30).json()
    assert "pdkv_timing" not in off

    timed = requests.post(f"{dep.url}/v1/completions", json=_body("one two three"), headers=HEADERS, timeout=30)
    assert timed.status_code == 200
    _check(timed.json()["pdkv_timing"], P_D_STAGES)  # not streamed: no first chunk
    seeded = requests.post(f"{dep.url}/v1/completions", json=_body("one two three", seed=7), headers=HEADERS,
                           timeout=30)
    assert seeded.status_code == 200
    _check(seeded.json()["pdkv_timing"], D_FIRST_STAGES)
    assert seeded.json()["choices"][0]["text"] == timed.json()["choices"][0]["text"]  # greedy both ways
    dep.wait_all_free()


def test_the_streams_last_chunk_carries_it_with_or_without_usage(dep):
    with_usage = _sse(dep.url, _body("four five six", stream_options={"include_usage": True}), HEADERS)
    last = with_usage[-1]
    assert last["choices"] == [] and "usage" in last
    _check(last["pdkv_timing"], P_D_STAGES | {"first_chunk_s"})
    assert all("pdkv_timing" not in c for c in with_usage[:-1])

    without = _sse(dep.url, _body("four five six"), HEADERS)
    last = without[-1]  # a chunk of its own, shaped as the usage chunk, without usage
    assert last["choices"] == [] and "usage" not in last and last["object"] == "text_completion"
    assert last["id"] == without[0]["id"]
    _check(last["pdkv_timing"], P_D_STAGES | {"first_chunk_s"})
    seeded = _sse(dep.url, _body("four five six", seed=3), HEADERS)
    _check(seeded[-1]["pdkv_timing"], D_FIRST_STAGES | {"first_chunk_s"})
    dep.wait_all_free()


def test_cached_tokens_and_the_stage_histogram(dep):
    prompt = "a prompt long enough to fill two blocks of sixteen tokens, and then some more " * 2
    before = {stage: _stage_count(dep.url, stage) for stage in ("prefill_compute", "kv_transfer")}
    first = requests.post(f"{dep.url}/v1/completions", json=_body(prompt), headers=HEADERS, timeout=30).json()
    second = requests.post(f"{dep.url}/v1/completions", json=_body(prompt, seed=1), headers=HEADERS,
                           timeout=30).json()
    assert first["pdkv_timing"]["num_cached_tokens"] == 0
    assert second["pdkv_timing"]["num_cached_tokens"] == second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert _stage_count(dep.url, "prefill_compute") == before["prefill_compute"] + 2
    assert _stage_count(dep.url, "kv_transfer") == before["kv_transfer"] + 1  # the seeded one's
    dep.wait_all_free()


def _stage_count(url: str, stage: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("pdkv_ttft_stage_seconds_count{") and f'stage="{stage}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_with_tracing_off_no_span_is_created(dep):
    trace_id = secrets.token_hex(16)
    headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    assert requests.post(f"{dep.url}/v1/completions", json=_body("traced?"), headers=headers, timeout=30).ok
    _sse(dep.url, _body("traced?"), headers)
    tracings = [dep.router.endpoints._tracing] + [w._tracing for w in dep.workers.values()]
    assert [t.enabled for t in tracings] == [False] * 3
    assert [t.num_spans_started for t in tracings] == [0] * 3
    dep.wait_all_free()


def test_include_content_is_the_only_way_token_ids_enter_a_span(tmp_path):
    prompt = "secret words here"
    for include in (False, True):
        out = tmp_path / str(include)
        config = local_config(mode="colocated", tracing={"exporter": "file", "file_dir": str(out),
                                                         "include_content": include, "batch_delay_s": 0.1})
        with LocalDeployment(config) as d:
            body = _body(prompt, return_token_ids=True)
            ids = requests.post(f"{d.url}/v1/completions", json=body, timeout=30).json()["choices"][0][
                "prompt_token_ids"]
            d.wait_all_free()
        spans = [json.loads(line) for f in out.glob("*.jsonl") for line in f.read_text().splitlines()]
        assert {s["resource"]["attributes"]["service.name"] for s in spans} == {"pdkv-router", "pdkv-both"}
        attributes = [s["attributes"] for s in spans]
        assert not any(prompt in json.dumps(a) for a in attributes)
        carrying = [a for a in attributes if a.get("pdkv.prompt_token_ids") == ids]
        assert len(carrying) == (1 if include else 0)


def test_tracing_settings_from_yaml_and_otel_variables():
    from pd.cluster.config import ConfigError, DeployConfig
    from pd.cluster.tracing_config import TracingSection, resolve_tracing

    assert not resolve_tracing(TracingSection(), {}).enabled  # off by default
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_TRACES_SAMPLER_ARG": "0.25"}
    on = resolve_tracing(TracingSection(), env)
    assert (on.exporter, on.sample_ratio, on.include_content) == ("otlp", 0.25, False)
    yaml_wins = resolve_tracing(TracingSection(exporter="console", sample_ratio=0.5), env)
    assert (yaml_wins.exporter, yaml_wins.sample_ratio) == ("console", 0.5)
    assert not resolve_tracing(TracingSection(exporter="console"), {"OTEL_SDK_DISABLED": "true"}).enabled
    with pytest.raises(ConfigError, match="tracing.file_dir"):
        DeployConfig.from_dict({"tracing": {"exporter": "file"}})
    with pytest.raises(ConfigError, match="tracing.endpoint"):
        DeployConfig.from_dict({"tracing": {"exporter": "otlp", "endpoint": "collector:4318"}})
