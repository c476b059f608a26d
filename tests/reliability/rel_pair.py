"""Two real engines with real ZMQ connectors in this process (prefill P, decode D),
an optional FaultLink between them, and a colocated reference engine.

`Pair.run(...)` sends a request through the P/D flow the router uses (prefill
with max_tokens=1 and do_remote_decode, then decode with P's kv_transfer_params)
and returns what the user would see. Engines are stepped from the calling
thread; connector threads move the bytes. Every wait is bounded.
"""
from __future__ import annotations

import dataclasses
import socket
import time

import torch

from connectors.links.link_shape import LinkShape
from connectors.params import TransferParams
from connectors.links.fault_link import LINK_POINTS, FaultLink
from connectors.links.faults import FaultPlan
from connectors.zmq.connector import KVRole, ZmqConnector, ZmqConnectorConfig
from kvcache.audit import assert_all_free, check_invariants
from pd.engine.config import EngineConfig
from pd.engine.model.config import ModelConfig
from pd.engine.engine import Engine
from pd.engine.kv.layout import KVLayout
from pd.engine.sample.params import SamplingParams

torch.set_num_threads(1)

SECRET = b"reliability-secret-0123456789"
MODEL = ModelConfig(num_layers=2)
BLOCK_SIZE = 16
PREFILL_ONLY = SamplingParams(max_tokens=1, ignore_eos=True)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def prompt(n: int, start: int = 3) -> list[int]:
    return [(start + 7 * i) % 250 for i in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class Side:
    """Knobs of one engine of the pair."""

    engine_id: str
    num_blocks: int = 96
    max_num_seqs: int = 16
    lease_s: float = 30.0
    timeout_s: float = 2.0
    port: int = 0
    policy: str = "recompute"
    data_path: str = "tcp"  # tcp: page bytes cross a socket, so a FaultLink sees them
    heartbeat_s: float | None = None
    link: LinkShape | None = None  # P: consumers reach it through an emulated link of this shape


def make_engine(side: Side, role: KVRole | None) -> Engine:
    config = EngineConfig(model=MODEL, seed=5, block_size=BLOCK_SIZE, num_blocks=side.num_blocks,
                          max_num_batched_tokens=512, max_num_seqs=side.max_num_seqs,
                          kv_load_failure_policy=side.policy, engine_id=side.engine_id, attention_backend="torch")
    connector = None
    if role is not None:
        groups = KVLayout(MODEL, BLOCK_SIZE).kv_cache_groups()
        connector = ZmqConnector(ZmqConnectorConfig(
            engine_id=side.engine_id, role=role, secret=SECRET, model_id="tiny@5", port=side.port,
            lease_s=side.lease_s, handshake_timeout_s=side.timeout_s, transfer_timeout_s=side.timeout_s,
            io_timeout_s=side.timeout_s, data_path=side.data_path, heartbeat_interval_s=side.heartbeat_s,
            emulated_link=side.link), groups)
    return Engine(config, connector=connector)


_REFERENCE: dict[tuple, list[int]] = {}
_REF_ENGINE: list[Engine] = []


def reference(tokens: list[int], n: int) -> list[int]:
    """Greedy tokens of a colocated engine (same seed and model): the right answer."""
    key = (tuple(tokens), n)
    if key not in _REFERENCE:
        if not _REF_ENGINE:
            _REF_ENGINE.append(make_engine(Side("reference", num_blocks=256), None))
        eng = _REF_ENGINE[0]
        _REFERENCE[key] = eng.generate_sync({"ref": tokens}, greedy(n))["ref"]
        eng.kv_cache_manager.reset_prefix_cache()
        assert_all_free(eng.kv_cache_manager)
    return _REFERENCE[key]


@dataclasses.dataclass
class Outcome:
    tokens: list[int]
    finish_reason: str | None
    error: str | None
    seconds: float


class Pair:
    """P and D engines (+ optional FaultLink). Use as a context manager."""

    def __init__(self, p: Side | None = None, d: Side | None = None, faults: str | None = None):
        self.p_side = p or Side("prefill-0")
        self.d_side = d or Side("decode-0")
        self.p = make_engine(self.p_side, KVRole.PRODUCER)
        self.d = make_engine(self.d_side, KVRole.CONSUMER)
        self.link: FaultLink | None = None
        plan = FaultPlan.parse(faults, LINK_POINTS)
        if plan is not None:
            self.link = FaultLink("127.0.0.1", self.p.connector.port, plan).start()

    def __enter__(self) -> Pair:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        for eng in (self.p, self.d):
            if eng is not None:
                eng.shutdown()

    # -------------------------------------------------------------- driving
    def step_until(self, done, timeout_s: float = 20.0, engines=None) -> None:
        engines = [e for e in (engines or (self.p, self.d)) if e is not None]
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"not done within {timeout_s}s")
            busy = False
            for eng in engines:
                if eng.has_unfinished_requests():
                    eng.step()
                    busy = True
            if not busy or all(not eng.scheduler.has_runnable_work() for eng in engines):
                time.sleep(0.002)

    def prefill(self, rid: str, tokens: list[int]) -> TransferParams:
        """Runs the prefill on P; returns P's kv_transfer_params (pointed at the link if any)."""
        self.p.add_request(rid, tokens, PREFILL_ONLY, kv_transfer_params={"do_remote_decode": True})
        deadline = time.monotonic() + 20.0
        final = None
        while final is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefill of {rid} did not finish")
            final = next((o for o in self.p.step() if o.request_id == rid and o.finished), None)
        params = final.kv_transfer_params
        if self.link is not None:
            params = dataclasses.replace(params, remote_port=self.link.port)
        return params

    def add_decode(self, rid: str, tokens: list[int], params: TransferParams | None, n: int) -> dict:
        """Queues the decode on D; the returned dict collects its outputs."""
        got = {"tokens": [], "finished": False, "reason": None, "error": None, "cause": None}
        self.d.add_request(rid, tokens, greedy(n), kv_transfer_params=params)
        return got

    def collect(self, outs_by_rid: dict[str, dict], outputs) -> None:
        for o in outputs:
            got = outs_by_rid.get(o.request_id)
            if got is None:
                continue
            got["tokens"].extend(o.new_token_ids)
            if o.finished:
                got["finished"], got["reason"], got["error"], got["cause"] = True, o.finish_reason, o.error, o.error_cause

    def drive(self, outs_by_rid: dict[str, dict], timeout_s: float = 20.0, on_step=None) -> None:
        """Steps both engines until every request in `outs_by_rid` finished on D."""
        deadline = time.monotonic() + timeout_s
        while not all(g["finished"] for g in outs_by_rid.values()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests not finished within {timeout_s}s: "
                                   f"{[r for r, g in outs_by_rid.items() if not g['finished']]}")
            if self.p is not None and self.p.has_unfinished_requests():
                self.p.step()
            self.collect(outs_by_rid, self.d.step())
            if on_step is not None:
                on_step()
            if not self.d.scheduler.has_runnable_work():
                time.sleep(0.002)

    def run(self, rid: str, tokens: list[int], n: int = 8, timeout_s: float = 20.0) -> Outcome:
        t0 = time.monotonic()
        params = self.prefill(rid, tokens)
        outs = {rid: self.add_decode(rid, tokens, params, n)}
        self.drive(outs, timeout_s)
        g = outs[rid]
        return Outcome(g["tokens"], g["reason"], g["error"], time.monotonic() - t0)

    # -------------------------------------------------------------- audit
    def settle(self, timeout_s: float = 15.0) -> None:
        """Steps until neither engine holds anything (P's leases end when D reports, or expire)."""
        self.step_until(lambda: not any(e.has_unfinished_requests() for e in (self.p, self.d) if e is not None),
                        timeout_s)

    def assert_all_free(self, timeout_s: float = 15.0) -> None:
        self.settle(timeout_s)
        for eng in (self.p, self.d):
            if eng is None:
                continue
            eng.kv_cache_manager.reset_prefix_cache()
            check_invariants(eng.kv_cache_manager)
            assert_all_free(eng.kv_cache_manager)
