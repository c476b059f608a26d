"""Tracing across real processes: the router (this process) and Ray worker actors export OTLP/HTTP to
an in-test receiver; requests carry the client's `traceparent`.

Two deployments on one Ray instance: `pd` (1 prefill + 2 decode workers, decode tokens paced so a
stream is long enough to migrate) and `colocated` (one worker, one request in flight at most and no
queue, so a second concurrent request is refused with 429).
"""
from __future__ import annotations

import json
import secrets

import pytest
import requests

from pd.cluster.roles import Role
from pd.deploy.launch import Deployment
from tests.helpers.e2e import HTTP_TIMEOUT_S, e2e_config, wait_all_free
from otlp_receiver import OTLPReceiver, ReceivedSpan

SECRET_TEXT = "zebra quokka marmalade"  # must never appear in a span attribute
PACED = "worker.decode_token:delay:0.02:times=all"


@pytest.fixture(scope="module")
def receiver():
    with OTLPReceiver() as r:
        yield r


def _tracing(receiver: OTLPReceiver) -> dict:
    return {"exporter": "otlp", "endpoint": receiver.endpoint, "batch_delay_s": 0.2}


@pytest.fixture(scope="module")
def pd(ray_instance, receiver):
    config = e2e_config("local.yaml", tracing=_tracing(receiver), topology__num_decode=2,
                        faults={"prefill": "", "decode": PACED, "colocated": ""})
    with Deployment(config) as dep:
        yield dep


@pytest.fixture(scope="module")
def colocated(ray_instance, receiver):
    config = e2e_config("local-colocated.yaml", tracing=_tracing(receiver), router__max_in_flight_per_worker=1,
                        router__max_queued_requests=0, faults={"prefill": "", "decode": "", "colocated": PACED})
    with Deployment(config) as dep:
        yield dep


def _parent() -> tuple[str, str, dict]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, {"traceparent": f"00-{trace_id}-{span_id}-01"}


def _one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [s.name for s in spans])
    return found[0]


def _children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> set[str]:
    return {s.name for s in spans if s.parent_id == parent.span_id}


def _no_content(spans: list[ReceivedSpan], prompt_ids: list[int] | None = None) -> None:
    for span in spans:
        assert "pdkv.prompt_token_ids" not in span.attributes
        for key, value in list(span.attributes.items()) + [kv for _, e in span.events for kv in e.items()]:
            assert SECRET_TEXT not in json.dumps(value), (span.name, key)
            if prompt_ids and isinstance(value, list) and len(value) >= len(prompt_ids):
                assert value[:len(prompt_ids)] != prompt_ids, (span.name, key)


def _closed(spans: list[ReceivedSpan]) -> None:
    for span in spans:  # the SDK exports ended spans only; an end before the start would be a bug of ours
        assert 0 < span.start_ns <= span.end_ns, span.name


def _stream_lines(url: str, body: dict, headers: dict, num_lines: int | None = None) -> list[dict]:
    out = []
    with requests.post(f"{url}/v1/chat/completions", json={**body, "stream": True}, headers=headers, stream=True,
                       timeout=HTTP_TIMEOUT_S) as resp:
        assert resp.status_code == 200, resp.text
        for line in resp.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                out.append(json.loads(line[6:]))
                if num_lines is not None and len(out) >= num_lines:
                    break  # leaving the `with` closes the connection: the request is aborted
    return out


def _chat(prompt: str, max_tokens: int = 8) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}


def test_one_trace_per_request_with_router_p_d_links(pd, receiver):
    for stream in (False, True):
        trace_id, client_span, headers = _parent()
        body = _chat(f"{SECRET_TEXT} number {int(stream)}")
        if stream:
            chunks = _stream_lines(pd.url, {**body, "stream_options": {"include_usage": True}}, headers)
            usage, prompt_ids = chunks[-1]["usage"], chunks[0]["prompt_token_ids"]
        else:
            resp = requests.post(f"{pd.url}/v1/chat/completions", json=body, headers=headers, timeout=HTTP_TIMEOUT_S)
            assert resp.status_code == 200, resp.text
            usage, prompt_ids = resp.json()["usage"], resp.json()["prompt_token_ids"]
        spans = receiver.wait_for(trace_id, {"chat pdkv-tiny", "pdkv.prefill", "pdkv.decode", "pdkv.kv_pull",
                                             "pdkv.decode.steps", "pdkv.router.route", "pdkv.prefill.lease",
                                             "pdkv.kv_serve"})
        root, p, d = _one(spans, "chat pdkv-tiny"), _one(spans, "pdkv.prefill"), _one(spans, "pdkv.decode")
        assert (root.service, p.service, d.service) == ("pdkv-router", "pdkv-prefill", "pdkv-decode")
        assert root.parent_id == client_span and p.parent_id == root.span_id and d.parent_id == p.span_id
        assert {"pdkv.router.parse", "pdkv.router.tokenize", "pdkv.router.admission",
                "pdkv.router.route"} <= _children(spans, root)
        assert {"pdkv.prefill.queue", "pdkv.prefill.compute"} <= _children(spans, p)
        assert {"pdkv.decode.queue", "pdkv.kv_pull", "pdkv.decode.first_token", "pdkv.decode.steps"} \
            <= _children(spans, d)
        pull = _one(spans, "pdkv.kv_pull")
        assert pull.attributes["pdkv.kv.num_blocks"] > 0 and pull.attributes["pdkv.kv.num_bytes"] > 0
        assert pull.attributes["pdkv.kv.data_path"] in ("auto", "tcp", "shm")
        _check_lease_and_serve(spans, p, pull)
        assert root.attributes["gen_ai.request.model"] == "pdkv-tiny"
        assert root.attributes["gen_ai.request.max_tokens"] == 8
        assert root.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert root.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 8
        # D's steps made all but the first token, which P's prefill gave (pd.router.first_token)
        assert _one(spans, "pdkv.decode.steps").attributes["gen_ai.usage.output_tokens"] == 7
        assert _one(spans, "pdkv.router.route").attributes["pdkv.route.decision"] in ("remote", "remote_prefix")
        assert all(s.status != "ERROR" for s in spans)
        _closed(spans)
        _no_content(spans, prompt_ids)
    wait_all_free(pd.url)


def _check_lease_and_serve(spans: list[ReceivedSpan], p: ReceivedSpan, pull: ReceivedSpan) -> None:
    """P kept its blocks for D (the lease span, under P's) and served D's pull (a child of D's pull span,
    across processes: D sent its context in the PULL frames), with the figures D measured."""
    lease, serve = _one(spans, "pdkv.prefill.lease"), _one(spans, "pdkv.kv_serve")
    assert lease.service == serve.service == "pdkv-prefill"
    assert lease.parent_id == p.span_id and lease.attributes["pdkv.lease.outcome"] == "done"
    assert serve.parent_id == pull.span_id and serve.trace_id == pull.trace_id == p.trace_id
    assert lease.attributes["pdkv.kv.num_blocks"] >= lease.attributes["pdkv.kv.num_blocks_sent"] > 0
    assert (serve.attributes["pdkv.kv.num_blocks"], serve.attributes["pdkv.kv.num_bytes"]) == \
        (pull.attributes["pdkv.kv.num_blocks"], pull.attributes["pdkv.kv.num_bytes"]) == \
        (lease.attributes["pdkv.kv.num_blocks_sent"], lease.attributes["pdkv.kv.num_bytes_sent"])
    assert serve.attributes["pdkv.kv.data_path"] in ("tcp", "shm_mapped", "shm_staged")
    assert serve.attributes["pdkv.kv.num_pulls"] == lease.attributes["pdkv.kv.num_pulls"] >= 1
    assert lease.start_ns <= serve.start_ns <= serve.end_ns <= lease.end_ns


def test_an_aborted_pd_request_ends_its_lease_span(pd, receiver):
    trace_id, _, headers = _parent()
    chunks = _stream_lines(pd.url, _chat(f"{SECRET_TEXT} abort me", 40), headers, num_lines=3)
    # the client left after three chunks (the role, P's first token, D's first): D's spans end as errors,
    # P's lease ended (pulled: done; else aborted)
    spans = receiver.wait_for(trace_id, {"chat pdkv-tiny", "pdkv.prefill", "pdkv.decode", "pdkv.prefill.lease"})
    lease, p = _one(spans, "pdkv.prefill.lease"), _one(spans, "pdkv.prefill")
    assert lease.parent_id == p.span_id and lease.attributes["pdkv.lease.outcome"] in ("done", "aborted")
    assert _one(spans, "pdkv.decode").status == "ERROR" and _one(spans, "chat pdkv-tiny").status == "ERROR"
    _closed(spans)
    _no_content(spans, chunks[0].get("prompt_token_ids"))
    wait_all_free(pd.url)


async def _mark_serving_decode_dead(dep: Deployment) -> str:
    worker_id = next(w.endpoint.worker_id for w in dep.router.pool.all()
                     if w.num_in_flight and w.healthy and w.endpoint.role is Role.DECODE)
    dep.router.pool.mark_dead(worker_id, "test: health checks failed")
    return worker_id


def test_a_migrated_request_keeps_one_trace_and_closes_every_span(pd, receiver):
    trace_id, _, headers = _parent()
    tokens, taken_out = [], []
    with requests.post(f"{pd.url}/v1/chat/completions", json={**_chat("migrate me", 40), "stream": True},
                       headers=headers, stream=True, timeout=HTTP_TIMEOUT_S) as resp:
        for line in resp.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                tokens.extend(chunk["choices"][0].get("token_ids") or [] if chunk["choices"] else [])
                if len(tokens) >= 5 and not taken_out:
                    taken_out.append(pd.run_coro(_mark_serving_decode_dead(pd), 10))
    assert len(tokens) == 40 and taken_out
    # the lost D's span (it pulled P's KV), ended by the abort, and the continuation's on the other D
    spans = receiver.wait_for(trace_id, {"chat pdkv-tiny", "pdkv.prefill", "pdkv.decode", "pdkv.generate"})
    root = _one(spans, "chat pdkv-tiny")
    migrations = [attrs for name, attrs in root.events if name == "migration"]
    assert len(migrations) == 1 and migrations[0]["cause"] and migrations[0]["role"] == "decode"
    lost, continued = _one(spans, "pdkv.decode"), _one(spans, "pdkv.generate")
    assert lost.status == "ERROR" and continued.status == "UNSET" and root.status == "UNSET"
    assert lost.attributes["pdkv.worker_id"] == taken_out[0] != continued.attributes["pdkv.worker_id"]
    _closed(spans)
    wait_all_free(pd.url)


def test_colocated_trace_an_aborted_request_and_a_429(colocated, receiver):
    trace_id, client_span, headers = _parent()
    chunks = _stream_lines(colocated.url, _chat(SECRET_TEXT), headers)
    spans = receiver.wait_for(trace_id, {"chat pdkv-tiny", "pdkv.generate", "pdkv.decode.steps"})
    root, worker = _one(spans, "chat pdkv-tiny"), _one(spans, "pdkv.generate")
    assert root.parent_id == client_span and worker.parent_id == root.span_id and worker.service == "pdkv-both"
    assert {"pdkv.prefill.queue", "pdkv.prefill.compute", "pdkv.decode.steps"} <= _children(spans, worker)
    assert not {"pdkv.kv_pull", "pdkv.prefill", "pdkv.decode"} & {s.name for s in spans}
    _no_content(spans, chunks[0]["prompt_token_ids"])

    aborted_id, _, aborted_headers = _parent()
    refused_id, _, refused_headers = _parent()
    with requests.post(f"{colocated.url}/v1/chat/completions", json={**_chat("long one", 200), "stream": True},
                       headers=aborted_headers, stream=True, timeout=HTTP_TIMEOUT_S) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith(b"data: "))  # it runs: the one slot is taken
        refused = requests.post(f"{colocated.url}/v1/chat/completions", json=_chat("no room"),
                                headers=refused_headers, timeout=HTTP_TIMEOUT_S)
        assert refused.status_code == 429, refused.text
    # leaving the `with` closed the connection mid-stream: the request is aborted
    refused_root = _one(receiver.wait_for(refused_id, {"chat pdkv-tiny"}), "chat pdkv-tiny")
    assert refused_root.status == "ERROR" and refused_root.attributes["http.response.status_code"] == 429
    spans = receiver.wait_for(aborted_id, {"chat pdkv-tiny", "pdkv.generate", "pdkv.decode.steps"})
    assert _one(spans, "chat pdkv-tiny").status == "ERROR"
    assert _one(spans, "pdkv.generate").status == "ERROR" and _one(spans, "pdkv.decode.steps").status == "ERROR"
    assert _one(spans, "pdkv.decode.steps").attributes["gen_ai.usage.output_tokens"] < 200
    _closed(spans)
    refused_spans = receiver.trace(refused_id)  # refused before any worker was touched: the router's spans only
    assert {s.service for s in refused_spans} == {"pdkv-router"} and "pdkv.router.route" not in \
        {s.name for s in refused_spans}
    _closed(refused_spans)
    wait_all_free(colocated.url)


def test_router_honours_a_sampled_out_parent(colocated, receiver):
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    resp = requests.post(f"{colocated.url}/v1/chat/completions", json=_chat("not sampled"),
                         headers={"traceparent": f"00-{trace_id}-{span_id}-00"}, timeout=HTTP_TIMEOUT_S)
    assert resp.status_code == 200
    marker_id, _, headers = _parent()  # a sampled request after it: once its spans are in, the first's would be
    assert requests.post(f"{colocated.url}/v1/chat/completions", json=_chat("sampled"), headers=headers,
                         timeout=HTTP_TIMEOUT_S).status_code == 200
    receiver.wait_for(marker_id, {"chat pdkv-tiny", "pdkv.generate"})
    assert receiver.trace(trace_id) == []
