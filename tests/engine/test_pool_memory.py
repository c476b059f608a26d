"""Where the engine's page pool lives: shareable (memfd) only when a same-host peer may map it."""
import os

import pytest
import torch
from tests.helpers.engine_cases import MODELS, engine_config

from pd.engine.kv.page_pool import PagePool
from connectors.zmq.connector import KVRole, ZmqConnector, ZmqConnectorConfig
from pd.engine.engine import Engine
from pd.engine.kv.layout import KVLayout

SECRET = b"pool-memory-test-secret!"
HUGE = 1 << 21


def test_private_pool_is_zeroed_aligned_and_not_shareable():
    pool = PagePool(40, 64 * 1024, shareable=False)
    assert pool.shared_path is None
    assert pool.buffer.shape == (40, 64 * 1024) and pool.buffer.dtype == torch.uint8
    assert pool.buffer.data_ptr() % HUGE == 0  # huge pages need 2 MiB-aligned memory
    assert int(pool.buffer.sum()) == 0
    pool.page(7).fill_(3)
    assert int(pool.view(torch.float32, (16 * 1024,))[7].view(torch.uint8).sum()) == 3 * 64 * 1024
    assert int(pool.buffer.sum()) == 3 * 64 * 1024


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="no memfd on this OS")
def test_shareable_pool_is_a_memfd_a_peer_can_map():
    pool = PagePool(4, 4096)
    pool.page(2).fill_(9)
    with open(pool.shared_path, "rb") as f:  # what a same-host consumer opens
        f.seek(2 * 4096)
        assert f.read(4096) == bytes([9]) * 4096


def _connector(role: KVRole, allow_shm: bool = True) -> ZmqConnector:
    cfg = MODELS["full"]
    return ZmqConnector(ZmqConnectorConfig(engine_id=f"pool-{role.value}", role=role, secret=SECRET,
                                           model_id="pool-test", port=0, allow_shm=allow_shm),
                        KVLayout(cfg, 4).kv_cache_groups())


@pytest.mark.parametrize("role, allow_shm, shared", [
    (None, True, False),                 # colocated: nobody maps the pool
    (KVRole.CONSUMER, True, False),      # decode worker: maps the producer's pool, never shares its own
    (KVRole.PRODUCER, True, True),       # prefill worker: same-host consumers map it
    (KVRole.PRODUCER, False, False),     # producer with shared memory turned off
])
def test_engine_shares_its_pool_only_as_a_shm_producer(role, allow_shm, shared):
    connector = None if role is None else _connector(role, allow_shm)
    eng = Engine(engine_config(MODELS["full"]), connector=connector)
    try:
        assert (eng.page_pool.shared_path is not None) == shared
    finally:
        eng.shutdown()
