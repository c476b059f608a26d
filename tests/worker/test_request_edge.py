"""A request is checked once at each edge and keeps one typed form: a worker's HTTP edge parses the
kv_transfer_params into `TransferParams` once, and that same object reaches the connector (through
`Engine.stream` and the KV cache's `Request`); the capacity rule runs once per request at the
worker's edge and once at a library caller's (`Engine.add_request`), never twice on one path.
Real workers (HTTP API on a port, aiohttp client), real engines; the connector records what it reads."""
from __future__ import annotations

import asyncio
import dataclasses
import json

import aiohttp
import pytest

from connectors.noop import NoopConnector, NoopConnectorScheduler
from connectors.params import TransferParams, wants_remote_decode
from kvcache.audit import assert_all_free
from pd.cluster.config import DeployConfig
from pd.cluster.messages import KVTransferParams
from pd.cluster.roles import Role
from pd.engine import engine as engine_module
from pd.engine.engine import Engine
from pd.engine.sample.params import SamplingParams
from pd.worker import wiring
from pd.worker.worker import Worker, WorkerSpec

ARCH = {"vocab_size": 260, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4,
        "num_kv_heads": 2}
SECRET = "request-edge-secret-0123456789"
PROMPT = list(range(3, 23))


class RecordingScheduler(NoopConnectorScheduler):
    """Computes everything locally; notes the params object each hook saw, and answers a remote-decode
    request with a typed answer (as a producer would)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, object]] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.seen.append(("matched", request.kv_transfer_params))
        return 0, False

    def request_finished(self, request, block_ids):
        self.seen.append(("finished", request.kv_transfer_params))
        if not wants_remote_decode(request.kv_transfer_params):
            return False, None
        return False, TransferParams(do_remote_prefill=True, remote_engine_id="P", remote_host="127.0.0.1",
                                     remote_port=5555, remote_request_id=request.request_id,
                                     remote_block_ids=((1, 2),), remote_num_tokens=len(PROMPT))


class RecordingConnector(NoopConnector):
    def __init__(self) -> None:
        super().__init__()
        self.scheduler = RecordingScheduler()
        self.released: list[TransferParams] = []

    def release_remote(self, kv_transfer_params: TransferParams) -> bool:
        self.released.append(kv_transfer_params)
        return True


def _spec(role: Role, max_model_len: int = 256) -> WorkerSpec:
    mode = "colocated" if role is Role.BOTH else "disaggregated"
    config = DeployConfig.from_dict({"model": {"architecture": ARCH}, "cache": {"block_size": 4, "kv_memory_mb": 1},
                                     "scheduler": {"max_model_len": max_model_len}, "topology": {"mode": mode}})
    return WorkerSpec(f"{role.value}-0", role, config, SECRET)


@pytest.fixture
def fit_checks(monkeypatch) -> list[int]:
    """Counts the capacity rule's runs (`pd.engine.kv.capacity.check_fits`, as the engine calls it)."""
    calls: list[int] = []
    real = engine_module.check_fits

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "check_fits", counted)
    return calls


async def _serve(role: Role, monkeypatch, body: dict) -> tuple[int, list[dict], Worker, RecordingConnector, list]:
    """Starts a worker whose engine has a recording connector, posts `body`, returns
    (status, NDJSON events or the error, worker, connector, the jobs its edge parsed)."""
    connector = RecordingConnector()
    spec = _spec(role)
    monkeypatch.setattr(wiring, "build_engine",
                        lambda s: (Engine(wiring.engine_config_for(s), connector=connector), connector))
    worker = Worker(spec)
    jobs: list = []
    parse = worker.parse_job

    def spy(raw):
        job = parse(raw)
        jobs.append(job)
        return job

    monkeypatch.setattr(worker, "parse_job", spy)
    url = await worker.start()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            async with http.post(f"{url}/internal/generate", json=body,
                                 headers={"Authorization": f"Bearer {SECRET}"}) as r:
                text = await r.text()
                events = [json.loads(line) for line in text.splitlines()] if r.status == 200 else [json.loads(text)]
                status = r.status
        assert_all_free(worker._require_engine().kv_cache_manager)
    finally:
        await worker.stop()
    return status, events, worker, connector, jobs


@pytest.mark.parametrize("role, params", [
    (Role.PREFILL, {"do_remote_decode": True}),
    (Role.DECODE, {"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "127.0.0.1",
                   "remote_port": 5555, "remote_request_id": "r", "remote_block_ids": [[1, 2, 3, 4, 5]],
                   "remote_num_tokens": len(PROMPT)}),
])
def test_params_parsed_once_at_the_worker_reach_the_connector_as_the_same_object(role, params, monkeypatch,
                                                                                  fit_checks):
    body = {"request_id": "r", "prompt_token_ids": PROMPT, "sampling": {"max_tokens": 3, "ignore_eos": True},
            "kv_transfer_params": params}
    status, events, _, connector, jobs = asyncio.run(_serve(role, monkeypatch, body))
    assert status == 200 and events[-1]["finished"], events
    [job] = jobs
    typed = job.kv_transfer_params
    assert isinstance(typed, TransferParams) and typed == KVTransferParams.model_validate(params).to_params()
    hooks = [hook for hook, _ in connector.scheduler.seen]
    assert hooks[0] == "matched" and hooks[-1] == "finished"
    assert all(seen is typed for _, seen in connector.scheduler.seen)  # no copy, no dict on the way
    assert job.prompt_token_ids == PROMPT
    assert len(fit_checks) == 1  # the worker's edge; the engine took the checked request as it was
    answer = events[-1].get("kv_transfer_params")
    if role is Role.PREFILL:  # the connector's typed answer, on the wire in vLLM's names
        assert answer == {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "P",
                          "remote_host": "127.0.0.1", "remote_port": 5555, "remote_request_id": "r",
                          "remote_block_ids": [[1, 2]], "remote_num_tokens": len(PROMPT)}
    else:
        assert answer is None


def test_a_refused_request_releases_its_producer_with_typed_params(monkeypatch, fit_checks):
    params = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "127.0.0.1", "remote_port": 5555,
              "remote_request_id": "r", "remote_block_ids": [[1]], "remote_num_tokens": 4}
    body = {"request_id": "r", "prompt_token_ids": list(range(3, 200)) * 2, "kv_transfer_params": params}
    status, events, _, connector, jobs = asyncio.run(_serve(Role.DECODE, monkeypatch, body))
    assert status == 400 and "leaves no room under max_model_len=256" in events[0]["error"]["message"]
    assert jobs == [] and len(fit_checks) == 1
    assert connector.released == [KVTransferParams.model_validate(params).to_params()]


def test_a_library_caller_gets_one_check_and_a_clear_error(fit_checks):
    spec = _spec(Role.BOTH, max_model_len=8192)  # longer than the pool holds: the pool's rule can refuse
    engine, other = Engine(wiring.engine_config_for(spec)), Engine(wiring.engine_config_for(spec))
    pool_tokens = (engine.page_pool.num_blocks - 1) * engine.config.block_size
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("a", PROMPT, greedy)
    assert len(fit_checks) == 1
    with pytest.raises(ValueError, match="request big: prompt of 8192 tokens leaves no room"):
        engine.add_request("big", [5] * 8192, greedy)
    with pytest.raises(ValueError, match=r"request huge: needs \d+ KV blocks .* the pool has \d+"):
        engine.add_request("huge", PROMPT, SamplingParams(max_tokens=pool_tokens, ignore_eos=True))
    with pytest.raises(ValueError, match="outside vocabulary of size 260"):
        engine.add_request("oov", [1, 260], greedy)
    checked = engine.check_request("b", PROMPT, greedy)
    before = len(fit_checks)
    engine.submit(checked)
    assert len(fit_checks) == before  # submitted as checked: not checked again
    for unchecked in (checked, dataclasses.replace(checked, request_id="c", checked_by=None)):
        with pytest.raises(ValueError, match="not checked by this engine"):
            other.submit(unchecked)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert {rid: len(ids) for rid, ids in out.items()} == {"a": 4, "b": 4}
    assert_all_free(engine.kv_cache_manager)
    assert_all_free(other.kv_cache_manager)
