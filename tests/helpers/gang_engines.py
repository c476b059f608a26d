"""P and D engines of any TP degree with the real ZMQ connector, each gang its own processes
(`tests/helpers/tp_gang.Gang`: gloo on 127.0.0.1), for the hetero-TP transfer tests.

How a gang is wired (what a worker's wiring does): rank 0 binds the gang's control socket
(`GangControl`, in a directory the followers know) before it builds its engine; the connector gets
the canonical KV groups (every head: what the compat hash and the wire describe) and a `GangSide`
(rank 0's heads and page geometry); every follower builds its `Follower` (a shareable pool on a
prefill gang: same-host D ranks map it) and starts a `RankAgent` on that pool. Rank 0's agent is
started by the connector when the engine registers its pool, which waits until every rank's agent
registered. P and D talk through files in a shared directory: P writes each request's
kv_transfer_params, D writes `done` once its requests finished (P then shuts down).
"""
from __future__ import annotations

import json
import os
import time

import torch

from connectors.params import make_stream_params
from connectors.zmq.connector import KVRole, ZmqConnector, ZmqConnectorConfig
from connectors.zmq.gang.gang_control import GangControl
from connectors.zmq.gang.gang_side import GangSide
from connectors.zmq.gang.head_plan import HeadGeometry, RankHeads
from connectors.zmq.gang.rank_agent import RankAgent
from kvcache.audit import assert_all_free
from pd.engine.config import EngineConfig
from pd.engine.engine import Engine
from pd.engine.kv.layout import KVLayout
from pd.engine.parallel.follower import Follower
from pd.engine.parallel.tp import TPShape
from pd.engine.sample.params import SamplingParams

SECRET = b"gang-engines-secret-0123456789"
PREFILL_ONLY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
WAIT_S = 120.0
STREAM_CHUNK = 4  # streamed prefills: one block per step, each published (and pulled) on its own


def _heads(config: EngineConfig, tp: int, rank: int) -> tuple[RankHeads, HeadGeometry]:
    model = config.model
    shape = TPShape(tp, model.num_kv_heads)
    heads = shape.heads_of(rank)
    return (RankHeads(rank, heads.start, len(heads)),
            HeadGeometry(len(heads), model.resolved_head_dim, torch.float32))


def _wait_file(path: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.02)


def _write(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def _engine(group, config: EngineConfig, role: KVRole, side: str, data_path: str, shared: str,
            streaming: bool = False) -> Engine:
    tp = group.world_size
    control = GangControl(tp, parent_dir=shared) if tp > 1 else None
    if control is not None:
        _write(os.path.join(shared, f"{side}-control"), {"address": control.address})
    gang = None
    if tp > 1:
        heads, geometry = _heads(config, tp, 0)
        gang = GangSide(tp, heads, geometry, control, load_timeout_s=30.0)
    connector = ZmqConnector(ZmqConnectorConfig(
        engine_id=f"{side}-gang", role=role, secret=SECRET, model_id="tiny-tp", lease_s=30.0, data_path=data_path,
        transfer_timeout_s=30.0, streaming="chunk" if streaming else "off", stream_chunk_tokens=STREAM_CHUNK),
        KVLayout(config.model, config.block_size).kv_cache_groups(), gang=gang)
    return Engine(config, connector=connector, tp=group)


def _step_until(engine: Engine, done, timeout_s: float = WAIT_S) -> dict[str, list]:
    outs: dict[str, list] = {}
    deadline = time.monotonic() + timeout_s
    while not done(outs):
        if time.monotonic() > deadline:
            raise TimeoutError("the engine did not finish its requests")
        stepped = False
        for o in engine.step():
            stepped = True
            outs.setdefault(o.request_id, []).append(o)
        if not stepped:
            time.sleep(0.002)
    return outs


def _finished(rids):
    return lambda outs: all(r in outs and outs[r][-1].finished for r in rids)


def prefill_rank0(group, config: EngineConfig, prompts: dict, data_path: str, shared: str,
                  streaming: bool = False) -> dict:
    engine = _engine(group, config, KVRole.PRODUCER, "p", data_path, shared, streaming)
    if streaming:  # D gets only our address; we prefill once it watches every request (each part reaches it)
        _write(os.path.join(shared, "params"), {rid: make_stream_params("p-gang", "127.0.0.1", engine.connector.port,
                                                                        rid).to_dict() for rid in prompts})
        publisher, deadline = engine.connector.worker.producer.stream, time.monotonic() + WAIT_S
        while not all(publisher.is_watched(rid) for rid in prompts):
            if time.monotonic() > deadline:
                raise TimeoutError("D never watched the streamed requests")
            time.sleep(0.01)
    for rid, tokens in prompts.items():
        engine.add_request(rid, tokens, PREFILL_ONLY,
                           kv_transfer_params={"do_remote_decode": True, "streaming": True} if streaming else
                           {"do_remote_decode": True})
    outs = _step_until(engine, _finished(prompts))
    if not streaming:
        _write(os.path.join(shared, "params"), {rid: outs[rid][-1].kv_transfer_params.to_dict() for rid in prompts})
    _wait_file(os.path.join(shared, "done"))
    deadline = time.monotonic() + 30  # D's DONE releases the leases: then every block is free
    while True:
        engine.step()
        try:
            assert_all_free(engine.kv_cache_manager)
            break
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    agent = engine.connector.worker._gang_in_use._agent if group.world_size > 1 else None
    stats = {"served": [agent.server.served_slices] if agent else [], "received": agent.received_bytes if agent else 0}
    engine.shutdown()
    return stats


def decode_rank0(group, config: EngineConfig, params: SamplingParams, prompts: dict, data_path: str,
                 shared: str, streaming: bool = False) -> dict:
    engine = _engine(group, config, KVRole.CONSUMER, "d", data_path, shared, streaming)
    _wait_file(os.path.join(shared, "params"))
    with open(os.path.join(shared, "params")) as f:
        sent = json.load(f)
    for rid, tokens in prompts.items():
        engine.add_request(rid, tokens, params, kv_transfer_params=sent[rid])
    outs = _step_until(engine, _finished(prompts))
    errors = {rid: outs[rid][-1].error for rid in prompts if outs[rid][-1].error}
    tokens = {rid: [t for o in outs[rid] for t in o.new_token_ids] for rid in prompts}
    stats = engine.connector.stats()
    assert_all_free(engine.kv_cache_manager)
    gang = engine.connector.worker._gang_in_use
    agent = gang._agent if gang is not None else None
    _write(os.path.join(shared, "done"), {})
    result = {"tokens": tokens, "errors": errors, "blocks_recv": stats["blocks_recv"], "bytes_recv": stats["bytes_recv"],
              "stream_parts": stats.get("stream_parts_received", 0),
              "failures": stats["failures"], "paths": engine.connector.worker.consumer.data_paths(),
              "received": agent.received_bytes if agent else -1,
              "received_from": {str(k): v for k, v in agent.received_from.items()} if agent else {}}
    engine.shutdown()
    return result


def _lie(slices: int) -> None:
    """This rank's first `slices` slice answers carry wrong checksums (as if its bytes were damaged)."""
    from connectors.zmq.gang import slice_server

    real, answered = slice_server.SliceServer._answer, [0]

    def answer(self, who, payload):
        answered[0] += 1
        if answered[0] > slices:
            return real(self, who, payload)
        digest = slice_server.digest
        slice_server.digest = lambda view: digest(view) ^ 1
        try:
            return real(self, who, payload)
        finally:
            slice_server.digest = digest

    slice_server.SliceServer._answer = answer


def follower(group, config: EngineConfig, side: str, shared: str, lie_slices: int = 0) -> dict:
    if lie_slices:
        _lie(lie_slices)
    f = Follower(config, group, shareable_pool=side == "p")
    _wait_file(os.path.join(shared, f"{side}-control"))
    with open(os.path.join(shared, f"{side}-control")) as fh:
        address = json.load(fh)["address"]
    heads, geometry = _heads(config, group.world_size, group.rank)
    agent = RankAgent(address, f.page_pool, geometry, heads, serve=side == "p")
    f.run()
    agent.join(timeout=20)  # rank 0's connector stops every agent when it shuts down
    out = {"received": agent.received_bytes, "received_from": {str(k): v for k, v in agent.received_from.items()},
           "served_slices": agent.server.served_slices if agent.server else 0,
           "forwarded": agent.server.served_bytes if (agent.server and side == "d") else 0}
    f.close()
    return out


def p_rank(group, config, prompts, data_path, shared, lie_slices=0, streaming=False):
    return prefill_rank0(group, config, prompts, data_path, shared, streaming) if group.rank == 0 else \
        follower(group, config, "p", shared, lie_slices)


def d_rank(group, config, params, prompts, data_path, shared, streaming=False):
    return decode_rank0(group, config, params, prompts, data_path, shared, streaming) if group.rank == 0 else \
        follower(group, config, "d", shared)
