"""Schemathesis fuzzes the router's own OpenAPI document against a live deployment.

A real P/D deployment (real workers: engine, ZMQ connector, internal HTTP; the
real router, over loopback HTTP) serves `GET /openapi.json`; schemathesis
reads it and generates requests for `POST /v1/completions` and
`POST /v1/chat/completions`: bodies that fit the schema (positive) and bodies
that break it (negative), streamed and not. Every answer must be: never a
5xx; a 4xx carrying OpenAI error JSON; a status and a body the document
declares; a stream made of JSON events ending with `data: [DONE]`. The pools
are all free at the end.

The deployment's `max_model_len` is small (64) and the document writes it in
as `max_tokens`' maximum, so no generated request can ask for a long
generation: the run stays short without loosening any check for real users.
"""
from __future__ import annotations

import collections
import json

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from rel_deploy import LocalDeployment, local_config

PATHS = ("/v1/completions", "/v1/chat/completions")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
NUM_POSITIVE, NUM_NEGATIVE = 20, 10  # per endpoint and stream mode: 120 requests in the default suite
NUM_POSITIVE_SLOW, NUM_NEGATIVE_SLOW = 1500, 500


@pytest.fixture(scope="module")
def deployment():
    with LocalDeployment(local_config(scheduler__max_model_len=64)) as dep:
        yield dep


@pytest.fixture(scope="module")
def fuzzed(deployment):
    response = requests.get(f"{deployment.url}/openapi.json", timeout=30)
    assert response.status_code == 200, response.text[:300]
    return deployment, schemathesis.openapi.from_dict(response.json())


def assert_openai_error(status: int, text: str) -> None:
    body = json.loads(text)
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str) and error["message"], body
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error"), body


def assert_event_stream(text: str) -> None:
    """Every `data:` line is a JSON chunk or an error event, and the last is `[DONE]`."""
    events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", text[-300:]
    for event in events[:-1]:
        body = json.loads(event)
        assert "error" in body or "choices" in body, event


def _fuzz(dep, schema, path: str, stream: bool, mode: GenerationMode, num_examples: int, derandomize: bool,
          tally: collections.Counter) -> None:
    operation = schema[path]["POST"]
    session = requests.Session()

    @settings(max_examples=num_examples, deadline=None, derandomize=derandomize, database=None,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        if mode is GenerationMode.POSITIVE and isinstance(case.body, dict):
            case.body["stream"] = stream  # both forms of every endpoint, whatever the draw
            if not stream:
                case.body.pop("stream_options", None)
        response = case.call(base_url=dep.url, session=session, timeout=60)
        tally[(mode.value, response.status_code)] += 1
        assert response.status_code < 500, (response.status_code, case.body, response.text[:500])
        case.validate_response(response, checks=CHECKS)
        if 400 <= response.status_code < 500:
            assert_openai_error(response.status_code, response.text)
        elif response.headers.get("Content-Type", "").startswith("text/event-stream"):
            assert_event_stream(response.text)

    run()


def fuzz_api(fuzzed, path: str, stream: bool, num_positive: int, num_negative: int, derandomize: bool,
             fault_record) -> collections.Counter:
    dep, schema = fuzzed
    tally: collections.Counter = collections.Counter()
    _fuzz(dep, schema, path, stream, GenerationMode.POSITIVE, num_positive, derandomize, tally)
    _fuzz(dep, schema, path, stream, GenerationMode.NEGATIVE, num_negative, derandomize, tally)
    statuses = dict(sorted(tally.items()))
    assert not [k for k in tally if k[1] >= 500], statuses
    assert tally[("positive", 200)] > 0, statuses  # the fuzz reached the workers, not only the validator
    assert requests.get(f"{dep.url}/health", timeout=10).status_code == 200
    dep.wait_all_free()
    num = sum(tally.values())
    fault_record(fault=f"schemathesis over /openapi.json: {num} requests to {path} "
                       f"({'streamed' if stream else 'not streamed'})", where="router",
                 user_saw=f"HTTP statuses {statuses}", pdkv_did="no 5xx; every 4xx OpenAI error JSON",
                 pools="all free")
    return tally


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("path", PATHS)
def test_schemathesis_finds_no_5xx(fuzzed, path, stream, fault_record):
    fuzz_api(fuzzed, path, stream, NUM_POSITIVE, NUM_NEGATIVE, True, fault_record)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("path", PATHS)
def test_schemathesis_finds_no_5xx_long(fuzzed, path, stream, fault_record):
    fuzz_api(fuzzed, path, stream, NUM_POSITIVE_SLOW, NUM_NEGATIVE_SLOW, False, fault_record)


def test_openapi_document_is_open_and_describes_both_endpoints(fuzzed):
    dep, schema = fuzzed
    doc = requests.get(f"{dep.url}/openapi.json", timeout=30).json()
    for path in PATHS:
        post = doc["paths"][path]["post"]
        assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].startswith("#/components/")
        for status in ("400", "401", "404", "413", "500", "503"):
            assert post["responses"][status]["content"]["application/json"]["schema"]["$ref"] \
                == "#/components/schemas/ErrorResponse"
    completion = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert completion["max_tokens"]["maximum"] == 63  # max_model_len - 1: the deployment's own limit


LONE = "hi \ud800 there"  # valid JSON ("\\ud800"), valid in a Python str, but no UTF-8 form
SURROGATE_BODIES = [
    ("completions", {"prompt": LONE}, "prompt"),
    ("completions", {"prompt": ["fine", LONE]}, "prompt[1]"),
    ("completions", {"prompt": LONE, "stream": True}, "prompt"),
    ("completions", {"prompt": "fine", "stop": LONE}, "stop"),
    ("completions", {"prompt": "fine", "stop": ["ok", LONE]}, "stop[1]"),
    ("completions", {"prompt": "fine", "user": LONE}, "user"),
    ("completions", {"prompt": "fine", "model": LONE}, "model"),
    ("chat/completions", {"messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b",
                                                                          "name": LONE}]}, "messages[1].name"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}],
                          "stream": True}, "messages[0].content[0].text"),
]


def test_lone_surrogates_get_a_400_naming_the_field(deployment, fault_record):
    """Every string a client sends is refused with a 400 naming it when it holds a lone surrogate, in
    every form (single prompt, list, stream, chat content and names, stop, user): never a 500."""
    statuses = []
    for path, body, param in SURROGATE_BODIES:
        body = dict(body, max_tokens=4)
        # json.dumps writes the surrogate as the escape "\\ud800", which is how a client sends it
        response = requests.post(f"{deployment.url}/v1/{path}", data=json.dumps(body), timeout=30,
                                 headers={"Content-Type": "application/json"})
        statuses.append(response.status_code)
        assert response.status_code == 400, (body, response.status_code, response.text[:300])
        error = response.json()["error"]
        assert error["param"] == param, (body, error)
        assert "surrogate" in error["message"] and error["type"] == "invalid_request_error", error
    good = requests.post(f"{deployment.url}/v1/completions", json={"prompt": "hi \u00e9 there", "max_tokens": 4},
                         timeout=30)
    assert good.status_code == 200, good.text[:300]
    assert requests.get(f"{deployment.url}/health", timeout=10).status_code == 200
    deployment.wait_all_free()
    fault_record(fault="lone surrogate (\\ud800) in prompt / prompt list / stream / chat content and name / stop / "
                       "user / model", where="router (request validation)",
                 user_saw=f"{len(statuses)} x 400 naming the field; a good request after them 200",
                 pdkv_did="refused at the edge (pydantic validators), nothing reached a worker", pools="all free")
