"""GPU path end to end (skipped where CUDA is missing): CUDA pools on both
sides of the ZMQ connector, in two processes.

- pages move GPU -> pinned staging -> wire -> pinned staging -> GPU byte for
  byte, over tcp and same-host shared memory, scattered and contiguous ids,
  more pages than one staging half;
- 1P1D on the GPU (P engine in another process, D here) gives the same
  greedy tokens as one colocated engine on the same GPU, and both pools end
  all free.
"""
from __future__ import annotations

import random
import time

import pytest
import torch

from tests.helpers.gpu_cases import (DEVICE, SECRET, SKIP_REASON, PeerProc, engine_config, model_config,
                                     pull_and_check_pages)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason=SKIP_REASON)]

from connectors.zmq.consumer.consumer import Consumer
from connectors.zmq.consumer.consumer_config import ConsumerConfig  # noqa: E402
from pd.engine.kv.page_pool import PagePool  # noqa: E402

NUM_BLOCKS = 256
PAGE_BYTES = 64 * 1024  # a staging half holds 64 such pages: 150 pages cross chunks on tcp


@pytest.mark.parametrize("path", ["tcp", "shm"])
def test_gpu_to_gpu_pages_are_byte_exact_between_processes(path):
    rng = random.Random(5)
    src = list(range(10, 90)) + rng.sample(range(100, NUM_BLOCKS), 70)  # one long run + scattered ids
    dst = rng.sample(range(1, NUM_BLOCKS), len(src))
    peer = PeerProc(mode="pages", num_blocks=NUM_BLOCKS, page_bytes=PAGE_BYTES, seed=11, block_ids=src)
    pool = PagePool(NUM_BLOCKS, PAGE_BYTES, device=DEVICE)
    cons = Consumer(ConsumerConfig(engine_id="D", secret=SECRET, compat_hash="gpu-test", data_path=path), pool)
    cons.start()
    try:
        port = peer.read()["port"]
        pull_and_check_pages(cons, pool, port, src, dst, seed=11)
    finally:
        cons.shutdown()
        assert peer.quit()["audit"] == "ok"


def _prompts(n: int, vocab: int) -> dict[str, list[int]]:
    rng = random.Random(3)
    return {f"r{i}": [rng.randrange(3, vocab) for _ in range(rng.randint(20, 150))] for i in range(n)}


def _run_to_end(engine, timeout_s: float = 120.0) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "engine did not finish in time"
        outs = engine.step()
        for out in outs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if not outs:
            time.sleep(0.001)  # only remote loads pending: let the connector threads run
    return tokens


@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "full+swa"])
def test_1p1d_on_gpu_gives_colocated_greedy_tokens(hybrid):
    from connectors.zmq.connector import KVRole, ZmqConnector, ZmqConnectorConfig
    from kvcache.audit import assert_all_free
    from pd.engine.engine import Engine
    from pd.engine.kv.layout import KVLayout
    from pd.engine.sample.params import SamplingParams

    model = model_config(hybrid)
    prompts = _prompts(6, model.vocab_size)
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)

    colocated = Engine(engine_config(model, "colocated"))
    reference = colocated.generate_sync(prompts, greedy)
    assert_all_free(colocated.kv_cache_manager)

    peer = PeerProc(mode="prefill", hybrid=hybrid, prompts=prompts)
    cfg = engine_config(model, "D")
    conn = ZmqConnector(ZmqConnectorConfig(engine_id="D", role=KVRole.CONSUMER, secret=SECRET, model_id="gpu-test"),
                        KVLayout(cfg.model, cfg.block_size).kv_cache_groups())
    decode = Engine(cfg, connector=conn)
    try:
        info = peer.read(timeout_s=180)
        assert {rid: toks[:1] for rid, toks in reference.items()} == info["first"]
        for rid, ids in prompts.items():
            decode.add_request(rid, ids, greedy, kv_transfer_params=info["params"][rid])
        got = _run_to_end(decode)
        assert got == reference
        stats = conn.stats()
        assert stats["loads_ok"] == len(prompts) and not stats["failures"], stats
        assert_all_free(decode.kv_cache_manager)
    finally:
        decode.shutdown()
        conn.shutdown()
        assert peer.quit()["audit"] == "ok"
