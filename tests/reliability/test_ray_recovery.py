"""Recovery from worker trouble on real Ray actors, over real HTTP and ZMQ (1P2D):
- a decode worker SIGKILLed while it streams: every stream moves to the other decode
  worker and completes with the tokens of an undisturbed run, no error event;
- a decode worker frozen (SIGSTOP) past the health limit: requests waiting on it are
  re-dispatched at once, and once it resumes (SIGCONT) it is re-admitted within
  `num_readmit_probes` probes and serves again.
Each test ends with every surviving pool all free.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import requests

from tests.helpers.e2e import e2e_config, wait_all_free, worker_reports

from pd.deploy.launch import Deployment
from pd.router.recovery import RecoverySettings

PROMPTS = [f"Stream number {i} tells the story of a fox and a dog, part {i}." for i in range(8)]


def worker_pid(dep: Deployment, worker_id: str) -> int:
    url = next(w.endpoint.url for w in dep.workers if w.endpoint.worker_id == worker_id)
    resp = requests.get(f"{url}/internal/health", headers={"Authorization": f"Bearer {dep.secret}"}, timeout=10)
    resp.raise_for_status()
    return int(resp.json()["pid"])


class Stream(threading.Thread):
    """One streamed completion, read to its end: token ids, error events, [DONE]."""

    def __init__(self, url: str, prompt: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                     "stream": True, "return_token_ids": True}
        self.url = url
        self.token_ids: list[int] = []
        self.errors: list[dict] = []
        self.done = False
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            with requests.post(f"{self.url}/v1/completions", json=self.body, stream=True, timeout=120) as resp:
                assert resp.status_code == 200, resp.text
                for line in resp.iter_lines():
                    if line == b"data: [DONE]":
                        self.done = True
                    elif line.startswith(b"data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            self.errors.append(event["error"])
                        for choice in event.get("choices", []):
                            self.token_ids.extend(choice.get("token_ids") or [])
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.failure = exc


def run_streams(url: str, max_tokens: int, on_progress=None) -> list[Stream]:
    streams = [Stream(url, p, max_tokens) for p in PROMPTS]
    for s in streams:
        s.start()
    if on_progress is not None:
        on_progress(streams)
    for s in streams:
        s.join(180)
    return streams


@pytest.mark.parametrize("num_tokens", [200, pytest.param(900, marks=pytest.mark.slow)])
def test_decode_worker_sigkilled_mid_stream_migrates(ray_instance, num_tokens, fault_record):
    config = e2e_config(topology__num_decode=2)
    with Deployment(config) as dep:
        want = [s.token_ids for s in run_streams(dep.url, num_tokens)]  # undisturbed run
        assert all(len(t) == num_tokens for t in want)
        victim = "decode-0"
        pid = worker_pid(dep, victim)
        killed_at: list[int] = []

        def kill_when_streaming(streams: list[Stream]) -> None:
            deadline = time.monotonic() + 60
            while min(len(s.token_ids) for s in streams) < 10 and time.monotonic() < deadline:
                time.sleep(0.01)
            killed_at.extend(len(s.token_ids) for s in streams)
            os.kill(pid, signal.SIGKILL)

        t0 = time.monotonic()
        streams = run_streams(dep.url, num_tokens, kill_when_streaming)
        seconds = time.monotonic() - t0
        for s, tokens in zip(streams, want):
            assert s.failure is None, s.failure
            assert s.errors == [] and s.done
            assert s.token_ids == tokens  # one uninterrupted stream, token-identical to the undisturbed run
        assert max(killed_at) < num_tokens  # the kill landed mid-stream
        reports = wait_all_free(dep.url)
        # out of the rotation, unless Ray already restarted it (a new process, re-admitted)
        assert reports[victim]["healthy"] is False or worker_pid(dep, victim) != pid
    fault_record(fault=f"D SIGKILLed during 8 streams of {num_tokens} tokens (1P2D)", where="D worker (Ray actor)",
                 user_saw=f"8/8 streams complete, token-identical, no error event ({seconds:.1f}s)",
                 pdkv_did=f"router migrated the streams to the other D (killed after {min(killed_at)}-"
                          f"{max(killed_at)} tokens)", pools="all free (surviving P, D)")


def test_frozen_decode_worker_is_readmitted(ray_instance, fault_record):
    config = e2e_config(topology__num_decode=2)
    probes = RecoverySettings().num_readmit_probes
    body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    with Deployment(config) as dep:
        want = [requests.post(f"{dep.url}/v1/completions", json=dict(body, prompt=p), timeout=60).json()
                for p in PROMPTS[:4]]
        victim = "decode-0"
        pid = worker_pid(dep, victim)
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            results: list = [None] * 4

            def call(i: int) -> None:
                results[i] = requests.post(f"{dep.url}/v1/completions", json=dict(body, prompt=PROMPTS[i]),
                                           timeout=60)

            threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            served_s = time.monotonic() - t0
            for got, ref in zip(results, want):  # the ones sent to the frozen worker were re-dispatched
                assert got is not None and got.status_code == 200, got and got.text
                assert got.json()["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
            assert served_s < config.router.request_timeout_s / 2
            assert worker_reports(dep.url)[victim]["healthy"] is False
        finally:
            os.kill(pid, signal.SIGCONT)
        t1 = time.monotonic()
        limit_s = probes * (config.router.health_interval_s + 2.0) + 10.0
        while not worker_reports(dep.url)[victim]["healthy"]:
            assert time.monotonic() - t1 < limit_s, f"{victim} not re-admitted within {limit_s:.0f}s"
            time.sleep(0.1)
        back_s = time.monotonic() - t1
        loads_before = worker_reports(dep.url)[victim]["stats"]["transfer"]["loads_ok"]
        for p, ref in zip(PROMPTS[:4], want):  # least-loaded spreads these over both decode workers again
            r = requests.post(f"{dep.url}/v1/completions", json=dict(body, prompt=p), timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
        reports = wait_all_free(dep.url)
        assert reports[victim]["healthy"] and reports[victim]["stats"]["transfer"]["loads_ok"] > loads_before
    fault_record(fault="D frozen (SIGSTOP) past the health limit, then resumed", where="D worker (Ray actor)",
                 user_saw=f"4/4 correct answers in {served_s:.1f}s while it was frozen",
                 pdkv_did=f"router re-dispatched its calls; re-admitted it {back_s:.1f}s after SIGCONT "
                          f"({probes} good probes)", pools="all free")
