"""The router <-> worker messages (`pd.cluster.messages`) at the worker's HTTP edge: strict types,
unknown keys refused naming the field, a prompt that can never run refused with 400 before the
engine sees it, and `num_cached_tokens` reported on a prefix hit, colocated and P/D."""
from __future__ import annotations

import contextlib

import pytest
import requests

from connectors.params import KV_PARAM_KEYS, TransferParams, make_remote_prefill_params
from pd.cluster.messages import GenerateRequest, KVTransferParams, Sampling, TokenEvent
from rel_deploy import SECRET, LocalDeployment, local_config

AUTH = {"Authorization": f"Bearer {SECRET}"}
GOOD = {"request_id": "good", "prompt_token_ids": [5, 6, 7], "sampling": {"max_tokens": 3, "ignore_eos": True}}
PROMPT = list(range(10, 50))  # 40 tokens: 2 full blocks of 16, then 8


def _with(**changes) -> dict:
    body = {**GOOD, "sampling": dict(GOOD["sampling"])}
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            body[section][field] = value
        else:
            body[section] = value
    return body


@pytest.mark.parametrize("body, message", [
    (_with(sampling__ignore_eos=1), "sampling.ignore_eos: expected bool, got int 1"),
    (_with(sampling__ignore_eos="true"), "sampling.ignore_eos: expected bool, got str 'true'"),
    (_with(sampling__top_k=-1), "sampling.top_k: input should be greater than or equal to 0"),
    (_with(sampling__max_tokens=2.0), "sampling.max_tokens: expected int, got float 2.0"),
    (_with(sampling__best_of=2), "sampling: unknown key(s) ['best_of']"),
    (_with(priority=1), "body: unknown key(s) ['priority']"),
    (_with(prompt_token_ids=[1, True]), "prompt_token_ids.1: expected int, got bool True"),
    (_with(prompt_token_ids=[1, -2]), "prompt_token_ids.1: input should be greater than or equal to 0"),
    (_with(prompt_token_ids=[]), "prompt_token_ids: list should have at least 1 item"),
    (_with(request_id=""), "request_id: string should have at least 1 character"),
    (_with(kv_transfer_params={"remote_port": "80"}), "kv_transfer_params.remote_port: expected int"),
    (_with(kv_transfer_params={"do_remote_prefill": 1}), "kv_transfer_params.do_remote_prefill: expected bool"),
    (_with(prompt_token_ids=list(range(3, 200)) * 3), "leaves no room under max_model_len=512"),
    ([GOOD], "body: expected mapping"),
])
def test_worker_edge_refuses_bad_messages_naming_the_field(colocated_dep, body, message):
    url = colocated_dep.workers["both-0"].url
    r = requests.post(f"{url}/internal/generate", json=body, headers=AUTH, timeout=10)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    good = requests.post(f"{url}/internal/generate", json=GOOD, headers=AUTH, timeout=30)
    lines = [TokenEvent.model_validate_json(line) for line in good.text.splitlines()]
    assert good.status_code == 200 and lines[-1].finished and sum(len(e.token_ids) for e in lines) == 3
    colocated_dep.wait_all_free()


def test_router_refuses_a_prompt_too_long_for_the_model_with_400(colocated_dep):
    r = requests.post(f"{colocated_dep.url}/v1/completions", timeout=10,
                      json={"prompt": list(range(3, 200)) * 3, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] in ("prompt_too_long", "context_length_exceeded")


def test_num_cached_tokens_on_a_prefix_hit(colocated_dep):
    dep = colocated_dep
    sampling = Sampling(max_tokens=3, ignore_eos=True)
    url = dep.workers["both-0"].url
    first = dep.run(_events(dep, url, GenerateRequest(request_id="c1", prompt_token_ids=PROMPT, sampling=sampling)))
    second = dep.run(_events(dep, url, GenerateRequest(request_id="c2", prompt_token_ids=PROMPT, sampling=sampling)))
    assert {e.num_cached_tokens for e in first} == {0}
    assert {e.num_cached_tokens for e in second} == {32}  # the two full blocks the first request cached
    assert [t for e in first for t in e.token_ids] == [t for e in second for t in e.token_ids]
    dep.wait_all_free()


def test_num_cached_tokens_in_pd_are_the_prefill_workers_cache_hits():
    """Through the router's dispatcher, a P/D request's cached tokens are what P did not compute
    (its prefix-cache hit), not the tokens D pulled: the prompt was computed once, on P."""
    with LocalDeployment(local_config()) as dep:
        sampling = Sampling(max_tokens=4, ignore_eos=True)
        first = dep.run(_stream(dep, "pd1", PROMPT, sampling))
        second = dep.run(_stream(dep, "pd2", PROMPT, sampling))
        assert first[-1].finished and first[-1].finish_reason == "length"
        assert {e.num_cached_tokens for e in first} == {0}
        assert {e.num_cached_tokens for e in second} == {32}  # the two full blocks P cached the first time
        assert [t for e in first for t in e.token_ids] == [t for e in second for t in e.token_ids]
        dep.wait_all_free()


def test_message_models_cover_the_connector_fields():
    assert set(KVTransferParams.model_fields) == set(KV_PARAM_KEYS)
    request = GenerateRequest(request_id="r", prompt_token_ids=[1], kv_transfer_params={"do_remote_decode": True})
    assert GenerateRequest.model_validate_json(request.model_dump_json(exclude_none=True)) == request
    assert request.kv_transfer_params.to_params() == TransferParams(do_remote_decode=True)
    answer = make_remote_prefill_params("P", "127.0.0.1", 5555, "r", [[1, 2], [3]], 20)
    wire = KVTransferParams.from_params(answer)
    assert KVTransferParams.model_validate_json(wire.model_dump_json(exclude_none=True)).to_params() == answer


@pytest.fixture(scope="module")
def colocated_dep():
    with LocalDeployment(local_config("colocated")) as dep:
        yield dep


async def _events(dep: LocalDeployment, url: str, request: GenerateRequest) -> list[TokenEvent]:
    async with contextlib.aclosing(dep.router.client.generate(url, request)) as stream:
        return [event async for event in stream]


async def _stream(dep: LocalDeployment, request_id: str, prompt: list[int], sampling: Sampling) -> list[TokenEvent]:
    async with contextlib.aclosing(dep.router.dispatcher.stream_tokens(request_id, prompt, sampling)) as stream:
        return [event async for event in stream]
