"""The same-node device path (CUDA IPC) as far as a machine without a GPU can check it:
the handshake's path choice, the export's validation, and the fallback to the host path
through a real handshake on real sockets when the producer's pool cannot be mapped."""
from __future__ import annotations

import logging
import socket
import time

import pytest
import torch

from connectors.zmq.paths import ipc_mapping
from connectors.zmq.control import framing, wire
from connectors.zmq.consumer.consumer import Consumer, RemoteAddr
from connectors.zmq.consumer.consumer_config import ConsumerConfig, DataPath
from connectors.zmq.paths.choice import choose_path
from connectors.zmq.producer.producer import Producer, ProducerConfig
from connectors.zmq.transfer_settings import TransferSettings
from connectors.zmq.control.wire import MsgType
from connectors.links.link_shape import LinkShape
from pd.engine.kv.page_pool import PagePool

SECRET = b"device-path-secret-0123456789"
HOST = "host-a"


def _cfg(path: str) -> ConsumerConfig:
    return ConsumerConfig(engine_id="D", secret=SECRET, compat_hash="c", data_path=DataPath(path))


def _welcome(host: str = HOST, device: bool | None = True, shm: bool = True) -> dict:
    msg = {"host_id": host, "shm": shm}
    if device is not None:  # an older producer sends no "device" at all
        msg["device"] = device
    return msg


@pytest.mark.parametrize("path, welcome, pool, want", [
    ("auto", _welcome(), "cuda", "cuda_ipc"),  # same node, both on GPUs
    ("auto", _welcome(), "cpu", "shm_mapped"),  # our pool is on the CPU: nothing to copy device to device
    ("auto", _welcome(device=False), "cuda", "shm_staged"),  # the producer offers no device pool
    ("auto", _welcome(device=None), "cuda", "shm_staged"),  # an older producer
    ("auto", _welcome(host="host-b"), "cuda", "tcp"),  # another node
    ("cuda_ipc", _welcome(device=False), "cuda", "cuda_ipc"),  # asked for: tried, and falls back if it fails
    ("cuda_ipc", _welcome(host="host-b"), "cuda", "tcp"),  # another node: no device path at all
    ("tcp", _welcome(), "cuda", "tcp"),
    ("shm", _welcome(), "cuda", "shm_staged"),  # the user's shm: staged for a GPU pool ...
    ("shm", _welcome(), "cpu", "shm_mapped"),  # ... the producer's pool mapped for a CPU one
    ("shm", _welcome(shm=False), "cpu", "tcp"),  # the producer offers no shared memory
    ("shm_staged", _welcome(), "cpu", "shm_staged"),
])
def test_the_handshake_picks_the_device_path_only_on_one_node(path, welcome, pool, want):
    choice = choose_path(DataPath(path), welcome, HOST, pool, 4, 1)
    assert choice.path.value == want and choice.streams == (4 if want == "tcp" else 1) and choice.why


def test_transfer_settings_accept_cuda_ipc_but_not_behind_an_emulated_link():
    assert TransferSettings(data_path="cuda_ipc").data_path == "cuda_ipc"
    with pytest.raises(ValueError, match="carries tcp only"):
        TransferSettings(data_path="cuda_ipc", emulated_link=LinkShape(bandwidth_mbps=100))


def _export(**over) -> dict:
    ex = {"device_uuid": "GPU-0", "handle": b"h" * 64, "storage_bytes": 10 * 4096, "storage_offset": 0,
          "ref_handle": b"r", "ref_offset": 0, "event_handle": b"e", "event_sync": True, "buffer_offset": 0,
          "num_blocks": 10, "page_bytes": 4096}
    ex.update(over)
    return ex


@pytest.mark.parametrize("export, reason", [
    ({}, "exported no pool"),
    ("not a map", "exported no pool"),
    (_export(handle="text"), "'handle' is str"),
    (_export(num_blocks=True), "'num_blocks' is bool"),
    (_export(page_bytes=8192), "pages of 8192 bytes"),
    (_export(num_blocks=11), "does not fit its allocation"),
    (_export(buffer_offset=-1), "does not fit its allocation"),
])
def test_a_bad_export_is_refused_with_its_reason(export, reason):
    with pytest.raises(ipc_mapping.DeviceUnavailable, match=reason):
        ipc_mapping.check_export(export, PagePool(10, 4096))
    assert ipc_mapping.check_export(_export(), PagePool(10, 4096))["num_blocks"] == 10


def test_a_cpu_pool_is_never_exported_or_mapped():
    pool = PagePool(4, 256)
    with pytest.raises(ipc_mapping.DeviceUnavailable, match="not a GPU"):
        ipc_mapping.export_pool(pool)
    if not torch.cuda.is_available():
        with pytest.raises(ipc_mapping.DeviceUnavailable, match="CUDA is not available"):
            ipc_mapping.MappedPool(_export(page_bytes=256, storage_bytes=4 * 256, num_blocks=4), pool)


def test_paired_runs_need_both_sides_consecutive():
    assert ipc_mapping.paired_runs([4, 5, 6, 9], [10, 11, 20, 21]) == [(4, 10, 2), (6, 20, 1), (9, 21, 1)]


def test_an_unmappable_device_path_falls_back_to_the_host_path_byte_exact(caplog):
    """D asks for cuda_ipc; P's pool cannot be exported (here: it is on the CPU). After a real,
    authenticated handshake the stream says why in the log and moves the pages on the host path."""
    src_pool, dst_pool = PagePool(40, 4096), PagePool(40, 4096)
    src_pool.buffer.random_(0, 256, generator=torch.Generator().manual_seed(3))
    prod = Producer(ProducerConfig(engine_id="P", secret=SECRET, compat_hash="c"), src_pool)
    prod.start()
    cons = Consumer(ConsumerConfig(engine_id="D", secret=SECRET, compat_hash="c", data_path=DataPath.CUDA_IPC),
                    dst_pool)
    cons.start()
    try:
        with caplog.at_level(logging.WARNING, logger="connectors.zmq.consumer.pull_stream"):
            src, dst = list(range(1, 21)), list(range(39, 19, -1))
            prod.add_lease("r", src)
            job = cons.load("r", RemoteAddr("P", "127.0.0.1", prod.port), "r", src, dst)
            assert job.done.wait(20) and job.result.ok, job.result
        assert torch.equal(dst_pool.buffer[dst], src_pool.buffer[src])
        why = [r.getMessage() for r in caplog.records if "data path cuda_ipc" in r.getMessage()]
        assert why and "not a GPU" in why[0] and why[0].endswith("falling back to shm_mapped"), why
        assert cons.data_paths()["P"] == ["shm_mapped"]  # same host, CPU pools: the mapped host path
        released: set[str] = set()
        deadline = time.monotonic() + 10
        while "r" not in released and time.monotonic() < deadline:  # D's DONE ends P's lease
            released |= prod.take_released()
            time.sleep(0.02)
        assert released == {"r"}
    finally:
        cons.shutdown()
        prod.shutdown()


def test_a_connection_without_a_session_never_gets_an_attached_answer():
    """The export rides only the ATTACHED answer, and a forged ATTACH gets none: it is dropped."""
    prod = Producer(ProducerConfig(engine_id="P", secret=SECRET, compat_hash="c", handshake_timeout_s=1.0),
                    PagePool(8, 256))
    prod.start()
    try:
        with socket.create_connection(("127.0.0.1", prod.data_port), timeout=5) as sock:
            msg_type, msg = framing.recv_frame(sock)
            assert msg_type is MsgType.NONCE
            framing.send_frame(sock, wire.encode(MsgType.ATTACH, session=b"s" * 16, mode="cuda_ipc", mac=b"m" * 32))
            sock.settimeout(5)
            with pytest.raises((ConnectionError, OSError, wire.MalformedMessage)):
                framing.recv_frame(sock)  # closed: no ATTACHED, no export
    finally:
        prod.shutdown()
