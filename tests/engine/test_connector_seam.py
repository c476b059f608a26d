"""The engine's one seam to the KV connector (`pd/engine/runner/kv_connector.py`) and the no-op
connector that stands in where there is none (`connectors/noop.py`), on a real engine, model and pool;
and the step's one failure rule (`Scheduler.fail_chunks`): requests sharing the blocks a failed chunk
was writing fail with it."""
from __future__ import annotations

import logging
import pathlib

import torch

from connectors.base import (ConnectorMetadata, ConnectorOutput, KVConnector, KVConnectorScheduler,
                             KVConnectorWorker)
from connectors.metrics import FailureCause
from connectors.noop import NoopConnector, NoopConnectorScheduler, NoopConnectorWorker, or_noop
from kvcache import Request
from kvcache.audit import assert_all_free, check_invariants
from pd.engine.config import EngineConfig
from pd.engine.engine import Engine
from pd.engine.kv.page_pool import PagePool
from pd.engine.model.config import ModelConfig
from pd.engine.outputs import FinishReason
from pd.engine.runner.kv_connector import ConnectorSeam
from pd.engine.sample.params import SamplingParams
from pd.engine.sched.output import ScheduledChunk, SchedulerOutput
from pd.engine.sched.scheduler import SHARED_BLOCKS_ERROR
from pd.engine.step_isolation import execute_isolated

REPO = pathlib.Path(__file__).resolve().parents[2]
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)


def _config() -> EngineConfig:
    return EngineConfig(model=ModelConfig(num_layers=2), seed=11, block_size=4, num_blocks=64,
                        max_num_batched_tokens=512, max_num_seqs=8)


def _finish(engine: Engine) -> dict[str, object]:
    last = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in last, "two final outputs"
                last[out.request_id] = out
    return last


def _public(cls: type) -> set[str]:
    return {name for name in vars(cls) if not name.startswith("_")}


# ---------------------------------------------------------------------------------- the no-op connector
def test_noop_implements_every_method_of_both_halves_and_the_seam():
    """Each half defines every public name of its half of the contract itself (no base default left),
    and the connector every one `KVConnector` adds to the halves."""
    assert _public(KVConnectorScheduler) - _public(NoopConnectorScheduler) == set()
    assert _public(KVConnectorWorker) - _public(NoopConnectorWorker) == set()
    own = _public(KVConnector) - _public(KVConnectorScheduler) - _public(KVConnectorWorker)
    assert {"release_remote", "abort_lease", "report_leases", "stats"} <= own
    assert own - _public(NoopConnector) == set()
    assert not NoopConnector.__abstractmethods__


def test_noop_moves_nothing_keeps_nothing_reports_nothing():
    c = NoopConnector()
    req = Request("r", [1, 2, 3, 4, 5], max_tokens=2)
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)
    assert c.request_finished(req, ([1, 2],)) == (False, None)
    assert c.prefill_stream_chunk(req) is None and c.layer_hook([(req, ([1, 2],), 5, True)]) is None
    assert c.build_connector_meta() == ConnectorMetadata()
    c.register_kv_caches(PagePool(4, 64))
    c.bind_connector_metadata(ConnectorMetadata())
    c.start_load_kv()
    c.wait_for_save()
    assert c.get_finished() == (set(), set())
    assert c.get_block_ids_with_load_errors() == set() and c.get_load_failures() == {}
    assert c.report_leases(lambda report: None) is False and c.stats() == {}
    assert c.stream_source() is None and c.listen_ports() is None and c.shares_page_pool is False
    c.shutdown()
    assert or_noop(c) is c and isinstance(or_noop(None), NoopConnector) and or_noop(None) is not or_noop(None)


def test_engine_without_a_connector_holds_the_noop_and_warns_about_transfer_params(caplog):
    engine = Engine(_config())
    assert type(engine.connector) is NoopConnector and engine.kv_connector.connector is engine.connector
    assert engine.scheduler.connector is engine.connector
    with caplog.at_level(logging.WARNING, logger="connectors.noop"):
        engine.add_request("remote", list(range(3, 20)), PARAMS,
                           kv_transfer_params={"do_remote_prefill": True, "remote_engine_id": "p"})
        last = _finish(engine)
    assert "request remote carries kv_transfer_params but no connector is configured" in caplog.text
    assert last["remote"].finish_reason is FinishReason.LENGTH  # computed locally, in full
    assert_all_free(engine.kv_cache_manager)


# ---------------------------------------------------------------------------------- the seam
class _LoggingWorker(NoopConnectorWorker):
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        assert isinstance(metadata, ConnectorMetadata)
        self.log.append("bind")

    def start_load_kv(self) -> None:
        self.log.append("start_load")

    def wait_for_save(self) -> None:
        self.log.append("wait_for_save")

    def get_finished(self) -> tuple[set[str], set[str]]:
        self.log.append("get_finished")
        return set(), set()


class _LoggingConnector(NoopConnector):
    def __init__(self, log: list[str]) -> None:
        KVConnector.__init__(self, NoopConnectorScheduler(), _LoggingWorker(log))


def test_each_step_calls_the_connector_once_before_and_once_after_the_forward_and_gets_one_output():
    log: list[str] = []
    engine = Engine(_config(), connector=_LoggingConnector(log))
    next_tokens = engine.runner.next_tokens

    def forward(chunks, on_layer=None):
        log.append("forward")
        return next_tokens(chunks, on_layer)

    engine.runner.next_tokens = forward  # (the real forward, with a note in the log)
    update = engine.scheduler.update_from_output
    outputs: list[ConnectorOutput] = []

    def update_from_output(sched, sampled, connector_output):
        outputs.append(connector_output)
        return update(sched, sampled, connector_output)

    engine.scheduler.update_from_output = update_from_output
    for i in range(3):
        engine.add_request(f"r{i}", list(range(5 + i, 17 + i)), PARAMS)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    per_step = ["bind", "start_load", "forward", "wait_for_save", "get_finished"]
    assert log == per_step * steps
    assert len(outputs) == steps and all(out == ConnectorOutput() for out in outputs)
    assert_all_free(engine.kv_cache_manager)


class _FailedLoadWorker(NoopConnectorWorker):
    def get_block_ids_with_load_errors(self) -> set[int]:
        return {3}

    def get_load_failures(self) -> dict[str, FailureCause]:
        return {"r": FailureCause.CHECKSUM}


def test_after_forward_zeroes_the_pages_of_failed_loads_and_reports_them():
    pool = PagePool(6, 64)
    pool.buffer.fill_(7)
    connector = NoopConnector()
    connector.worker = _FailedLoadWorker()
    seam = ConnectorSeam(connector, pool)
    seam.before_forward(SchedulerOutput(chunks=[]))
    out = seam.after_forward()
    assert out.invalid_block_ids == {3} and out.load_failures == {"r": FailureCause.CHECKSUM}
    assert not out.finished_recving and not out.finished_sending
    assert int(pool.buffer[3].count_nonzero()) == 0
    others = torch.cat([pool.buffer[b].flatten() for b in (0, 1, 2, 4, 5)])
    assert bool((others == 7).all())


class _HookScheduler(NoopConnectorScheduler):
    def __init__(self) -> None:
        self.asked: list[list] = []
        self.layers: list[int] = []

    def layer_hook(self, steps):
        self.asked.append(steps)
        return self.layers.append


def test_the_seam_asks_once_per_streamed_step_and_hooks_only_a_forward_of_the_whole_step():
    half = _HookScheduler()
    connector = NoopConnector()
    connector.scheduler = half
    seam = ConnectorSeam(connector, PagePool(4, 64))
    req = Request("s", list(range(8)), max_tokens=1)
    chunks = [ScheduledChunk("s", list(range(4)), 0, ([1],), False), ScheduledChunk("t", [9], 0, ([2],), True)]
    seam.before_forward(SchedulerOutput(chunks=chunks, stream_steps=[(req, ([1],), 4, False)]))
    hook = seam.layer_hook(chunks)
    assert hook is not None and half.asked == [[(req, ([1],), 4, False)]]
    hook(0)
    assert half.layers == [0]
    assert seam.layer_hook(chunks[:1]) is None  # a chunk retried alone: the others' layers are not its own
    assert seam.layer_hook(chunks) is hook and len(half.asked) == 1
    seam.after_forward()
    assert seam.layer_hook(chunks) is None
    seam.before_forward(SchedulerOutput(chunks=chunks))  # nothing streamed: the connector is not asked
    assert seam.layer_hook(chunks) is None and len(half.asked) == 1
    seam.after_forward()


# ---------------------------------------------------------------------------------- the failure rule
def test_a_request_sharing_a_failed_chunks_blocks_fails_with_it_and_nothing_stale_stays_cached():
    """`b`, admitted in the same pass as `a` with the same prompt, takes a prefix hit on the blocks `a` is
    writing. `a`'s chunk fails: `b` read garbage and fails too (its own chunk ran fine); their pages
    leave the prefix cache, so the prompt served again is computed afresh, with the undisturbed tokens."""
    prompt = list(range(3, 21))
    want = Engine(_config()).generate_sync({"a": prompt}, PARAMS)["a"]
    engine = Engine(_config())
    engine.add_request("a", prompt, PARAMS)
    engine.add_request("b", prompt, PARAMS)
    engine.fault_marks.mark("a", "step")
    last = _finish(engine)
    assert last["a"].finish_reason is FinishReason.ERROR and "engine.step failed" in last["a"].error
    assert last["b"].finish_reason is FinishReason.ERROR and last["b"].error == SHARED_BLOCKS_ERROR
    check_invariants(engine.kv_cache_manager)
    assert_all_free(engine.kv_cache_manager)
    engine.add_request("again", prompt, PARAMS)
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            if out.finished:
                assert out.finish_reason is FinishReason.LENGTH and out.num_cached_tokens == 0
    assert tokens == want
    assert engine.stats()["num_errors"] == 2 and engine.dead is None
    assert_all_free(engine.kv_cache_manager)


def test_step_isolation_names_only_the_causes():
    """Which requests share blocks is the scheduler's to know: isolation reports the chunks that fail alone."""
    chunks = [ScheduledChunk("a", [1, 2], 0, ([1],), True), ScheduledChunk("b", [1, 2], 0, ([1],), True)]

    def run(part):
        if any(c.request_id == "a" for c in part):
            raise ValueError("bad input")
        return {c.request_id: 5 for c in part}

    sampled, failed = execute_isolated(run, chunks)
    assert sampled == {"b": 5} and list(failed) == ["a"] and "ValueError: bad input" in failed["a"]


def test_the_failure_rule_is_written_once():
    sources = [p.read_text() for root in ("pd", "connectors") for p in (REPO / root).rglob("*.py")]
    assert sum(src.count(f'"{SHARED_BLOCKS_ERROR}"') for src in sources) == 1
    assert sum(src.count("def fail_chunks") for src in sources) == 1
