"""Faults seen through the router's HTTP API, on an in-process deployment
(real workers, real router, real ZMQ and HTTP; no Ray): client disconnects,
aborts while prefill runs, decode admission refused for lack of blocks,
request limits, client-supplied kv_transfer_params."""
from __future__ import annotations

import json
import time

import pytest
import requests

from rel_deploy import LocalDeployment, local_config

BODY = {"prompt": "The quick brown fox jumps over the lazy dog. " * 3, "max_tokens": 12, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def colocated_tokens():
    with LocalDeployment(local_config("colocated")) as dep:
        r = requests.post(f"{dep.url}/v1/completions", json=BODY, timeout=30)
        assert r.status_code == 200
        yield r.json()["choices"][0]["token_ids"]


def test_client_disconnects_mid_stream(fault_record):
    with LocalDeployment(local_config()) as dep:
        body = dict(BODY, max_tokens=200, stream=True)
        with requests.post(f"{dep.url}/v1/completions", json=body, stream=True, timeout=30) as resp:
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(4)]
            assert any(line.startswith(b"data: ") for line in got)
        # the connection is closed: D must abort the request and free its blocks
        freed = dep.wait_all_free(timeout_s=10)
        assert dep.stats("decode-0")["num_aborted"] >= 1
    fault_record(fault="client disconnects mid-stream", where="router -> D worker",
                 user_saw="(gone)", pdkv_did="router closed the D stream; D aborted the request",
                 pools=f"all free ({freed:.1f}s)")


@pytest.mark.parametrize("point", ["worker.request_received", "worker.prefill_done"])
def test_request_aborted_at_the_router_while_prefill_runs(point, fault_record):
    # P stalls 2 s at `point`; the client gives up after 0.5 s. P's lease is 30 s: blocks must not wait for it.
    config = local_config(faults={"prefill": f"{point}:delay:2"}, transfer__lease_s=30.0)
    with LocalDeployment(config) as dep:
        with pytest.raises(requests.exceptions.ReadTimeout):
            requests.post(f"{dep.url}/v1/completions", json=BODY, timeout=0.5)
        time.sleep(2.5)  # past the stall: the prefill (if it ran) has finished and holds a lease
        freed = dep.wait_all_free(timeout_s=5)
        p_stats = dep.stats("prefill-0")
        assert p_stats["transfer"]["leases_ended"].get("done", 0) == 0
        ok = requests.post(f"{dep.url}/v1/completions", json=BODY, timeout=30)  # still serving
        assert ok.status_code == 200
        dep.wait_all_free()
    fault_record(fault=f"client gives up while P is at {point}", where="router -> P worker",
                 user_saw="(gone)", pdkv_did=f"P aborted; leases ended {p_stats['transfer']['leases_ended'] or '{}'}",
                 pools=f"all free ({freed:.1f}s after the stall, lease 30s)")


def test_decode_refuses_a_request_its_pool_can_never_hold(fault_record):
    config = local_config(cache__kv_memory_mb=0.25, transfer__lease_s=30.0)  # 32 blocks of 16 tokens
    with LocalDeployment(config) as dep:
        body = dict(BODY, prompt=[65] * 300, max_tokens=200)  # fits P (301 tokens), never D (500)
        t0 = time.monotonic()
        r = requests.post(f"{dep.url}/v1/completions", json=body, timeout=30)
        seconds = time.monotonic() - t0
        assert r.status_code == 400 and "KV blocks" in r.json()["error"]["message"], r.text
        freed = dep.wait_all_free(timeout_s=5)  # P's lease released by D's refusal, not by expiry (30 s)
        assert dep.stats("decode-0")["num_rejected"] == 1
        ok = requests.post(f"{dep.url}/v1/completions", json=dict(body, max_tokens=8), timeout=30)
        assert ok.status_code == 200
        dep.wait_all_free()
    fault_record(fault="decode admission refused: pool too small for the request", where="D worker",
                 user_saw=f"HTTP 400 naming the KV block shortfall in {seconds:.1f}s",
                 pdkv_did="D refused before admission and told P to release", pools=f"all free ({freed:.1f}s)")


def test_request_limits(colocated_tokens, fault_record):
    config = local_config(router__max_body_bytes=64 * 1024, router__max_prompt_tokens=300,
                          router__max_prompts_per_request=4)
    with LocalDeployment(config) as dep:
        url = f"{dep.url}/v1/completions"
        big = requests.post(url, data=json.dumps(dict(BODY, prompt="x" * 100_000)), timeout=30,
                            headers={"Content-Type": "application/json"})
        assert big.status_code == 413, big.text
        long = requests.post(url, json=dict(BODY, prompt="y" * 301), timeout=30)
        assert long.status_code == 400 and long.json()["error"]["code"] == "prompt_too_long"
        for max_tokens in (0, -1, 1 << 21, 1.5, "9", True):
            r = requests.post(url, json=dict(BODY, max_tokens=max_tokens), timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", (max_tokens, r.text)
        ctx = requests.post(url, json=dict(BODY, max_tokens=500), timeout=30)  # prompt + max_tokens > 512
        assert ctx.status_code == 400 and ctx.json()["error"]["code"] == "context_length_exceeded"
        many = requests.post(url, json=dict(BODY, prompt=["a"] * 5), timeout=30)
        assert many.status_code == 400
        good = requests.post(url, json=BODY, timeout=30)
        assert good.status_code == 200 and good.json()["choices"][0]["token_ids"] == colocated_tokens
        dep.wait_all_free()
    fault_record(fault="oversized body / prompt / max_tokens / batch", where="router",
                 user_saw="413 (body), 400 naming the parameter", pdkv_did="refused before any worker was touched",
                 pools="all free")


def test_client_supplied_kv_transfer_params_are_stripped(colocated_tokens, fault_record):
    with LocalDeployment(local_config()) as dep:
        evil = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_host": "10.255.255.1", "remote_port": 9,
                "remote_request_id": "someone-elses", "remote_block_ids": [[1, 2, 3]], "remote_num_tokens": 48}
        r = requests.post(f"{dep.url}/v1/completions", json=dict(BODY, kv_transfer_params=evil), timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == colocated_tokens
        transfer = dep.stats("decode-0")["transfer"]
        assert transfer["failures_total"] == 0 and transfer["loads_ok"] == 1  # it pulled from P, nowhere else
        dep.wait_all_free()
    fault_record(fault="client-supplied kv_transfer_params (SSRF / foreign blocks)", where="router",
                 user_saw="correct tokens", pdkv_did="params dropped; D pulled only from the router-chosen P",
                 pools="all free")
