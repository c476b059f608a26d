"""GPU faults simulated on the CPU, served through the real router and real 1P2D workers over HTTP
(no Ray: the process restart is test_engine_survival.py's): a step that raises what torch raises
for an illegal memory access fails its request with a 503 and Retry-After (streamed: an error event
and [DONE], never a 500), the worker reports itself unhealthy and the router takes it out at once,
and every pool ends all free. A CUDA error outside a step (where no isolation runs) ends the loop; the
worker's in-flight streams then end unfinished, as a lost worker's do, never as a failure of theirs."""
from __future__ import annotations

import json

import pytest
import requests
import torch
from rel_deploy import LocalDeployment, local_config

BODY = {"prompt": "A GPU fault costs one request, never the worker's silence.", "max_tokens": 8,
        "temperature": 0, "ignore_eos": True}


def _faulted(dep: LocalDeployment) -> set[str]:
    return {wid for wid, w in dep.workers.items() if w.health()["status"] != "ok"}


def test_device_fault_is_a_503_with_retry_after_and_the_worker_leaves_the_rotation(fault_record):
    # each decode worker's first request faults in its step (an illegal memory access, as torch raises it)
    config = local_config(topology__num_decode=2, faults={"decode": "engine.device_error:kill"})
    with LocalDeployment(config) as dep:
        resp = requests.post(f"{dep.url}/v1/completions", json=BODY, timeout=60)
        assert resp.status_code == 503, resp.text
        assert resp.headers.get("Retry-After") == "1"
        error = resp.json()["error"]
        assert error["code"] == "worker_device_fault" and error["type"] == "server_error", error
        assert "illegal memory access" in error["message"] and "retry" in error["message"]
        [first] = _faulted(dep)
        health = dep.workers[first].health()
        assert health["status"] == "error" and "DeviceFault" in health["engine_error"]
        assert not dep.router.pool.get(first).healthy  # taken out at once, not after failed polls
        # routed around: the next request goes to the other decode worker (whose first request faults too,
        # streamed this time: a clear error event, then [DONE])
        events = []
        with requests.post(f"{dep.url}/v1/completions", json=dict(BODY, stream=True), stream=True,
                           timeout=60) as streamed:
            assert streamed.status_code == 200
            for line in streamed.iter_lines():
                if line.startswith(b"data: "):
                    events.append("[DONE]" if line == b"data: [DONE]" else json.loads(line[6:]))
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "worker_device_fault", events
        assert _faulted(dep) == {"decode-0", "decode-1"}
        freed = dep.wait_all_free()
    fault_record(fault="CUDA illegal memory access in a decode step (fault plan engine.device_error), 1P2D",
                 where="D engine step", user_saw="HTTP 503 worker_device_fault with Retry-After: 1; streamed: "
                 "an error event and [DONE]", pdkv_did="failed the step's request, freed its blocks, worker "
                 "answered 503 on health, router took it out at once and sent the next request to the other D",
                 pools=f"all free ({freed:.1f}s)")


def test_prefill_device_fault_fails_its_request_and_decode_workers_prefill_meanwhile(fault_record):
    # the prefill worker's first request runs out of device memory in its step
    config = local_config(faults={"prefill": "engine.device_oom:kill"})
    with LocalDeployment(config) as dep:
        resp = requests.post(f"{dep.url}/v1/completions", json=BODY, timeout=60)
        assert resp.status_code == 503 and resp.headers.get("Retry-After") == "1", resp.text
        assert resp.json()["error"]["code"] == "worker_device_fault" and "OutOfMemoryError" in resp.text
        assert _faulted(dep) == {"prefill-0"} and not dep.router.pool.get("prefill-0").healthy
        health = requests.get(f"{dep.url}/health", timeout=10).json()
        assert health["status"] == "degraded" and health["missing_roles"] == ["prefill"], health
        again = [requests.post(f"{dep.url}/v1/completions", json=dict(BODY, prompt=f"{i} {BODY['prompt']}"),
                               timeout=60) for i in range(2)]
        assert [r.status_code for r in again] == [200, 200], [r.text for r in again]  # D prefills them itself
        freed = dep.wait_all_free()
    fault_record(fault="CUDA out of memory in a prefill step (fault plan engine.device_oom), 1P1D", where="P engine "
                 "step", user_saw="HTTP 503 worker_device_fault with Retry-After: 1; 2/2 requests after it "
                 "answered 200", pdkv_did="failed the step's request, P unhealthy and out of the rotation at once; "
                 "D prefilled locally meanwhile", pools=f"all free ({freed:.1f}s)")


@pytest.mark.skipif(not hasattr(torch, "AcceleratorError"), reason="torch.AcceleratorError is new in torch 2.8")
def test_a_device_error_outside_a_step_loses_the_requests_with_the_worker_never_fails_them():
    # a CUDA error where no step isolation runs (KV copies, scheduling) ends the engine's loop: the worker's
    # streams then end unfinished, with no error event, as a lost worker's do, so the router serves them elsewhere
    from rel_deploy import SECRET

    from pd.worker.worker import Worker

    config = local_config("colocated")
    with LocalDeployment(config) as dep:
        worker: Worker = dep.workers["both-0"]
        engine = worker._engine
        real_schedule = engine.scheduler.schedule

        def schedule():
            if engine.scheduler.has_runnable_work():  # the first step with work fails on the "device"
                raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
            return real_schedule()

        engine.scheduler.schedule = schedule
        body = {"request_id": "r1", "prompt_token_ids": [5, 6, 7, 8], "sampling": {"max_tokens": 4}}
        with requests.post(f"{worker.url}/internal/generate", json=body, stream=True, timeout=30,
                           headers={"Authorization": f"Bearer {SECRET}"}) as resp:
            assert resp.status_code == 200
            events = [json.loads(line) for line in resp.iter_lines() if line]
        assert events == [], events  # no error event, no finish: the router retries it elsewhere
        assert worker.health()["status"] == "error" and "AcceleratorError" in worker.health()["engine_error"]
        dep.wait_all_free()  # (it failed before any block was allocated)
