"""Router-side recovery without Ray: the pool's re-admission after good probes, the
per-role rotation, and a call stalled on a worker that the pool takes out stopping at
once (real router, real 1P1D workers over real HTTP; the worker stalls by fault plan)."""
from __future__ import annotations

import asyncio
import json
import time

import pytest
import requests

from rel_deploy import LocalDeployment, local_config

from pd.router.choice import LeastLoaded, Role, WorkerEndpoint, WorkerPool
from pd.cluster.messages import GenerateRequest, KVTransferParams, Sampling
from pd.router.recovery import RecoverySettings, continuation

BODY = {"prompt": "The quick brown fox jumps over the lazy dog. " * 2, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True}


def test_a_dead_worker_is_readmitted_after_n_good_probes_in_a_row():
    pool = WorkerPool(LeastLoaded(), num_readmit_probes=3)
    pool.add(WorkerEndpoint("d0", Role.DECODE, "http://d0"))
    lost = pool.get("d0").lost
    pool.mark_dead("d0", "test")
    assert lost.is_set() and pool.healthy(Role.DECODE) == []
    assert [pool.record_probe("d0", ok) for ok in (True, True, False, True, True)] == [False] * 5  # a bad one resets
    assert pool.record_probe("d0", True) is True
    assert pool.healthy(Role.DECODE) and not pool.get("d0").lost.is_set()  # a fresh event for the new life
    assert pool.record_probe("d0", True) is False  # healthy: probes count nothing
    with pytest.raises(ValueError, match="num_readmit_probes"):
        WorkerPool(num_readmit_probes=0)


def test_rotation_is_kept_per_role():
    # one P and two D: a counter shared by both roles moved by 2 per request and always picked the same D
    pool = WorkerPool(LeastLoaded())
    pool.add(WorkerEndpoint("p0", Role.PREFILL, "http://p0"))
    for i in range(2):
        pool.add(WorkerEndpoint(f"d{i}", Role.DECODE, f"http://d{i}"))
    picked = []
    for _ in range(4):
        pool.release(pool.acquire(Role.PREFILL))
        load = pool.acquire(Role.DECODE)
        picked.append(load.endpoint.worker_id)
        pool.release(load)
    assert sorted(picked) == ["d0", "d0", "d1", "d1"]


def test_recovery_settings_and_continuation():
    assert RecoverySettings().migration_limit == 2
    with pytest.raises(ValueError, match="migration_limit"):
        RecoverySettings(migration_limit=-1)
    with pytest.raises(ValueError, match="first_byte_timeout_s"):
        RecoverySettings(first_byte_timeout_s=0)
    request = GenerateRequest(request_id="r", prompt_token_ids=[1, 2], sampling=Sampling(max_tokens=10, seed=5),
                              kv_transfer_params=KVTransferParams(do_remote_decode=True))
    nxt = continuation(request, [7, 8, 9], 1)
    assert nxt == GenerateRequest(request_id="r-m1", prompt_token_ids=[1, 2, 7, 8, 9],
                                  sampling=Sampling(max_tokens=7, seed=5), kv_transfer_params=None)


def test_a_call_stalled_on_a_worker_taken_out_stops_at_once(fault_record):
    # D stalls 8 s on the request; the pool takes D out after 1 s, as the health loop does for a frozen worker.
    config = local_config(faults={"decode": "worker.request_received:stall:8"}, router__request_timeout_s=60.0)
    with LocalDeployment(config) as dep:
        async def take_out_later():
            await asyncio.sleep(1.0)
            dep.router.pool.mark_dead("decode-0", "test: health checks failed")

        dep._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(take_out_later()))
        t0 = time.monotonic()
        r = requests.post(f"{dep.url}/v1/completions", json=BODY, timeout=30)
        seconds = time.monotonic() - t0
        assert r.status_code in (502, 503), r.text
        assert seconds < 6, seconds  # not the 8 s stall, nor request_timeout_s
        assert "decode" in r.json()["error"]["message"]
        # the router closed the call (D's handler is cancelled) and aborted P's lease
        dep.wait_all_free(timeout_s=10)
        assert dep.stats("prefill-0")["transfer"]["leases_ended"] == {"aborted": 1}
    fault_record(fault="D stalled on a request, then taken out of the rotation", where="router -> D worker",
                 user_saw=f"HTTP {r.status_code} in {seconds:.1f}s (no other D to re-dispatch to)",
                 pdkv_did="router stopped waiting when the pool took D out", pools="all free")


def _stream(url: str, body: dict, on_token=None) -> tuple[list[int], list[dict]]:
    """A streamed completion: its token ids and its error events; `on_token(n)` after each chunk."""
    tokens, errors = [], []
    with requests.post(f"{url}/v1/completions", json=dict(body, stream=True, return_token_ids=True),
                       stream=True, timeout=60) as resp:
        assert resp.status_code == 200, resp.text
        for line in resp.iter_lines():
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                errors.extend([event["error"]] if "error" in event else [])
                for choice in event.get("choices", []):
                    tokens.extend(choice.get("token_ids") or [])
                if on_token is not None:
                    on_token(len(tokens))
    return tokens, errors


def _serving_decode(dep: LocalDeployment) -> str:
    return next(w.endpoint.worker_id for w in dep.router.pool.all() if w.num_in_flight and w.healthy
                and w.endpoint.role is Role.DECODE)


@pytest.mark.parametrize("migration_limit", [2, 1])
def test_a_stream_moves_to_another_decode_worker_until_the_limit(migration_limit, fault_record):
    # 1P2D in-process; D's tokens are paced so the stream is long-lived. Taking the serving D out
    # mid-stream makes the router continue on the other D; a second loss spends a limit of 1.
    config = local_config(topology__num_decode=2, faults={"decode": "worker.decode_token:delay:0.03:times=all"})
    body = dict(BODY, max_tokens=150)
    with LocalDeployment(config, RecoverySettings(migration_limit=migration_limit)) as dep:
        want, errors = _stream(dep.url, body)
        assert len(want) == 150 and not errors
        taken_out: list[str] = []

        def take_out(num_tokens: int) -> None:
            if num_tokens >= 10 * (len(taken_out) + 1) and len(taken_out) < 2:
                deadline = time.monotonic() + 15
                while taken_out and not dep.router.pool.get(taken_out[0]).healthy:  # probes re-admit it
                    assert time.monotonic() < deadline, "not re-admitted"
                    time.sleep(0.05)
                worker_id = dep.run(_async(_serving_decode, dep))
                taken_out.append(worker_id)
                dep.run(_async(dep.router.pool.mark_dead, worker_id, "test: health checks failed"))

        got, errors = _stream(dep.url, body, take_out)
        assert len(taken_out) == 2 and taken_out[0] != taken_out[1]
        if migration_limit == 2:
            assert errors == [] and got == want  # one uninterrupted stream, identical tokens
        else:
            assert [e["code"] for e in errors] == ["migration_limit_reached"]
            assert got == want[:len(got)] and 20 <= len(got) < 150  # a clean error, nothing wrong before it
        dep.wait_all_free()
    fault_record(fault=f"serving D taken out twice mid-stream (migration_limit={migration_limit})",
                 where="router -> D workers", user_saw="identical tokens, no error" if not errors else
                 f"{len(got)} correct tokens, then a migration_limit_reached error event",
                 pdkv_did="router continued the stream on the other D from prompt + sent tokens",
                 pools="all free")


async def _async(fn, *args):
    return fn(*args)


def test_first_byte_timeout_fails_a_silent_worker_fast():
    # A listener that accepts and never answers: what a frozen (SIGSTOPped) worker looks like.
    import socket

    from pd.router.worker_client import CallCause, ClientTimeouts, WorkerCallError, WorkerClient

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"

        async def call() -> tuple[str, float]:
            client = WorkerClient("s" * 32, ClientTimeouts(stall_s=60.0, total_s=60.0))
            await client.open()
            t0 = time.monotonic()
            try:
                request = GenerateRequest(request_id="r", prompt_token_ids=[1], sampling=Sampling(max_tokens=1))
                async for _ in client.generate(url, request, first_byte_s=0.5):
                    pass
            except WorkerCallError as exc:
                return exc.cause, time.monotonic() - t0
            finally:
                await client.close()
            return "none", time.monotonic() - t0

        cause, seconds = asyncio.run(call())
    assert cause is CallCause.CONNECT and seconds < 5  # retried elsewhere as unreachable, long before stall_s


def test_abort_endpoint_is_authenticated_and_checks_its_body():
    from rel_deploy import SECRET

    with LocalDeployment(local_config()) as dep:
        url = dep.workers["prefill-0"].url + "/internal/abort"
        auth = {"Authorization": f"Bearer {SECRET}"}
        assert requests.post(url, json={"request_id": "r1"}, timeout=10).status_code == 401
        assert requests.post(url, json={"request_id": "r1"}, timeout=10,
                             headers={"Authorization": "Bearer wrong"}).status_code == 401
        for bad in ({}, {"request_id": ""}, {"request_id": 5}, [1], {"request_id": "x" * 300}):
            r = requests.post(url, json=bad, headers=auth, timeout=10)
            assert r.status_code == 400 and "request_id" in r.json()["error"]["message"], bad
        r = requests.post(url, json={"request_id": "never-seen"}, headers=auth, timeout=10)
        assert r.status_code == 200 and r.json() == {"aborted": "never-seen"}  # harmless for an unknown id
        dep.wait_all_free()
