"""Two data-path rules a GPU would show, checked on the CPU with only the CUDA call faked:

- shm_staged: where CUDA refuses to page-lock the shared segment (`cudaHostRegister` fails), the
  stream copies through the pageable segment and says so once; the pages still land byte-exact;
- shm_mapped: a producer whose pool is not in shared memory says so in its ATTACHED answer, and
  the stream falls back to shm_staged on a new connection, logging why;
- cuda_ipc: a producer computes no page digest for a consumer that does not check device pages
  (`device_checksums` off), and the ones it sends a checking consumer are the pages' own.
"""
from __future__ import annotations

import logging
import socket
import threading
import time

import torch

from connectors.metrics import TransferMetrics
from connectors.zmq.consumer.consumer import Consumer, RemoteAddr
from connectors.zmq.consumer.consumer_config import ConsumerConfig, DataPath
from connectors.zmq.control import framing, wire
from connectors.zmq.control.session import ProducerSession
from connectors.zmq.control.wire import MsgType
from connectors.zmq.paths import cuda_staging, ipc_mapping, shm_segment
from connectors.zmq.paths.page_access import InPlacePages, digest
from connectors.zmq.producer.data_stream import DataStreams
from connectors.zmq.producer.leases import LeaseTable
from connectors.zmq.producer.producer import Producer, ProducerConfig
from pd.engine.kv.page_pool import PagePool

SECRET = b"path-fallback-secret-0123456789"
PAGE = 4096


def test_shm_staged_lands_byte_exact_when_cuda_refuses_to_page_lock(monkeypatch, caplog):
    tried: list[int] = []

    def refuse(ptr: int, nbytes: int) -> None:  # what cudaHostRegister says under a locked-memory limit
        tried.append(nbytes)
        raise RuntimeError("CUDA error: out of memory (cudaHostRegister)")

    monkeypatch.setattr(cuda_staging, "register_host_memory", refuse)
    monkeypatch.setattr(shm_segment, "wants_pin", lambda device: True)  # as for a CUDA pool: the pin is tried
    monkeypatch.setattr(shm_segment, "_refusal_logged", threading.Event())
    src_pool, dst_pool = PagePool(64, PAGE), PagePool(64, PAGE)
    src_pool.buffer.random_(0, 256, generator=torch.Generator().manual_seed(11))
    prod = Producer(ProducerConfig(engine_id="P", secret=SECRET, compat_hash="c", shm_chunk_bytes=3 * PAGE), src_pool)
    prod.start()
    cons = Consumer(ConsumerConfig(engine_id="D", secret=SECRET, compat_hash="c", data_path=DataPath.SHM_STAGED),
                    dst_pool)
    cons.start()
    try:
        with caplog.at_level(logging.WARNING, logger=shm_segment.__name__):
            for i, (src, dst) in enumerate([(list(range(1, 21)), list(range(40, 60))), ([5], [2])]):
                prod.add_lease(f"r{i}", src)  # 20 pages: seven chunks through both halves of the segment
                job = cons.load(f"r{i}", RemoteAddr("P", "127.0.0.1", prod.port), f"r{i}", src, dst)
                assert job.done.wait(20) and job.result.ok, job.result
                assert torch.equal(dst_pool.buffer[dst], src_pool.buffer[src])
        assert cons.data_paths()["P"] == ["shm_staged"]  # the stream lived on: no fallback, no dead stream
        assert len(tried) >= 2  # both sides tried to page-lock their mapping of the segment
        said = [r for r in caplog.records if "refused to page-lock" in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in said]  # once per process, however many segments
    finally:
        cons.shutdown()
        prod.shutdown()


def test_shm_on_a_pool_that_cannot_be_mapped_falls_back_to_the_staged_segment(caplog):
    src_pool, dst_pool = PagePool(32, PAGE, shareable=False), PagePool(32, PAGE)
    assert src_pool.shared_path is None
    src_pool.buffer.random_(0, 256, generator=torch.Generator().manual_seed(14))
    prod = Producer(ProducerConfig(engine_id="P", secret=SECRET, compat_hash="c"), src_pool)
    prod.start()
    cons = Consumer(ConsumerConfig(engine_id="D", secret=SECRET, compat_hash="c", data_path=DataPath.SHM), dst_pool)
    cons.start()
    try:
        with caplog.at_level(logging.INFO, logger="connectors.zmq"):
            src, dst = [3, 4, 5, 9], [20, 1, 2, 7]
            prod.add_lease("r", src)
            job = cons.load("r", RemoteAddr("P", "127.0.0.1", prod.port), "r", src, dst)
            assert job.done.wait(20) and job.result.ok, job.result
        assert torch.equal(dst_pool.buffer[dst], src_pool.buffer[src])
        assert cons.data_paths()["P"] == ["shm_staged"]
        said = [r.getMessage() for r in caplog.records]
        assert any("KV data path to P: shm_mapped (data_path shm: same host" in m for m in said), said
        assert any("data path shm_mapped" in m and "not in shared memory" in m
                   and m.endswith("falling back to shm_staged") for m in said), said
    finally:
        cons.shutdown()
        prod.shutdown()


class _SpyAccess(InPlacePages):
    """The pool's pages as the producer reads them, counting the pages it hashes."""

    hashed = 0

    def page_digests(self, block_ids: list[int]) -> list[int]:
        _SpyAccess.hashed += len(block_ids)
        return super().page_digests(block_ids)


def _pull_once(pool: PagePool, monkeypatch, checksums: bool) -> tuple[dict, dict, int]:
    """One cuda_ipc stream of a real producer stream loop, over a real socket: (ATTACHED, PAGES, pages
    hashed by the producer). Only the pool's IPC export is faked (a CPU pool has none)."""
    monkeypatch.setattr(ipc_mapping, "export_pool", lambda p: {"fake": b"export"})
    monkeypatch.setattr("connectors.zmq.producer.data_stream.page_access_for", lambda pool, staging: _SpyAccess(pool))
    _SpyAccess.hashed = 0
    leases = LeaseTable(30.0, TransferMetrics())
    leases.add("r", [3, 4, 7])  # not sealed: nothing ran `seal_pending` yet
    stop, metrics = threading.Event(), TransferMetrics()
    streams = DataStreams(ProducerConfig(engine_id="P", secret=SECRET, compat_hash="c"), pool, leases, metrics, stop)
    with socket.create_server(("127.0.0.1", 0)) as listener:  # a real TCP connection, as the listener hands over
        ours = socket.create_connection(listener.getsockname(), timeout=5)
        theirs, _ = listener.accept()
    session = ProducerSession(b"s" * 16, b"k" * 32, b"c", "D", time.monotonic())
    try:
        streams.on_attached(theirs, session, {"mode": "cuda_ipc", "checksums": checksums})
        ours.settimeout(5)
        attached = framing.recv_frame(ours)
        framing.send_frame_bytes(ours, wire.pull_frame(1, "r", [3, 4, 7]))
        pages = framing.recv_frame(ours)
        framing.send_frame(ours, wire.encode(MsgType.CREDIT, half=0))  # copied: the lease may go
        deadline = time.monotonic() + 5
        while metrics.blocks_sent < 3 and time.monotonic() < deadline:  # the pull is over on the producer
            time.sleep(0.01)
        assert metrics.blocks_sent == 3
        assert attached[0] is MsgType.ATTACHED and pages[0] is MsgType.PAGES
        return attached[1], pages[1], _SpyAccess.hashed
    finally:
        stop.set()
        ours.close()


def test_cuda_ipc_producer_computes_no_digest_for_a_consumer_that_does_not_check(monkeypatch):
    pool = PagePool(8, PAGE)
    pool.buffer.random_(0, 256, generator=torch.Generator().manual_seed(12))
    attached, pages, hashed = _pull_once(pool, monkeypatch, checksums=False)
    assert attached["ipc"] == {"fake": b"export"} and not attached.get("unavailable")
    assert pages["digests"] == [] and hashed == 0


def test_cuda_ipc_producer_sends_the_pages_digests_to_a_consumer_that_checks(monkeypatch):
    pool = PagePool(8, PAGE)
    pool.buffer.random_(0, 256, generator=torch.Generator().manual_seed(13))
    _, pages, hashed = _pull_once(pool, monkeypatch, checksums=True)
    want = [digest(pool.buffer[b].numpy()) for b in (3, 4, 7)]
    assert pages["digests"] == want and hashed == 3  # unsealed lease: hashed at the pull
