"""The CUDA data path (pinned staging + side stream); skipped where CUDA is missing."""
from __future__ import annotations

import pytest
import torch

from connectors.zmq.consumer.consumer import Consumer, RemoteAddr
from connectors.zmq.consumer.consumer_config import ConsumerConfig
from pd.engine.kv.page_pool import PagePool
from connectors.zmq.producer.producer import Producer, ProducerConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SECRET = b"cuda-test-secret-0123456789"


@pytest.mark.parametrize("path", ["tcp", "shm"])
def test_cuda_pages_land_byte_exact(path):
    src_pool = PagePool(40, 64 * 1024, device="cuda")
    dst_pool = PagePool(40, 64 * 1024, device="cuda")
    src_pool.buffer.random_(0, 256)
    prod = Producer(ProducerConfig(engine_id="P", secret=SECRET, compat_hash="c", shm_chunk_bytes=256 * 1024), src_pool)
    prod.start()
    cons = Consumer(ConsumerConfig(engine_id="D", secret=SECRET, compat_hash="c", data_path=path), dst_pool)
    cons.start()
    try:
        src = list(range(1, 33))
        dst = list(range(39, 7, -1))
        prod.add_lease("r", src)
        job = cons.load("r", RemoteAddr("P", "127.0.0.1", prod.port), "r", src, dst)
        assert job.done.wait(30) and job.result.ok, job.result
        assert torch.equal(dst_pool.buffer[dst], src_pool.buffer[src])
    finally:
        cons.shutdown()
        prod.shutdown()
