"""The same-node device path: a producer's CUDA page pool, mapped by its consumer through CUDA IPC.

Producer: `export_pool` makes the pool's IPC description once per pool (a
cudaIpcMemHandle of its allocation plus offsets, every field bytes, int, str
or bool, so it travels as msgpack, never pickle). It is handed out only in
the ATTACHED answer of a data connection whose ATTACH carried a valid session
MAC (`session.py`): only a peer that passed the authenticated handshake ever
sees it. Before answering a pull the producer waits (`wait_for_writes`) for
the forward that wrote the pages, so the consumer never reads half-written
KV; the lease stays pinned until the consumer CREDITs the pull.

Consumer: `MappedPool` opens the handle once per data stream (torch keeps one
mapping per handle per process) on the device whose UUID the producer named
(`CUDA_VISIBLE_DEVICES` may number it differently here), refuses with a reason
(`DeviceUnavailable`) where that cannot work, and copies pages device to
device, gathered by block id, on its own side stream; the compute stream is
fenced on the copy like on any host-to-device landing. `close` drops the
mapping (torch closes the IPC handle when the last view goes).
"""
from __future__ import annotations

import logging
import threading
import weakref

import torch

from connectors.pages import KVPages
from connectors.zmq.paths.base import PathUnavailable
from connectors.zmq.paths.cuda_staging import MAX_RUN_COPIES, fences_for

logger = logging.getLogger(__name__)

# the export's fields and their types (checked on arrival: a peer's msgpack, never trusted)
EXPORT_FIELDS: dict[str, type] = {
    "device_uuid": str, "handle": bytes, "storage_bytes": int, "storage_offset": int, "ref_handle": bytes,
    "ref_offset": int, "event_handle": bytes, "event_sync": bool, "buffer_offset": int, "num_blocks": int,
    "page_bytes": int}
INDEX_CHUNK_PAGES = 64  # many scattered pages: gathered by index in chunks (bounded temporary)


class DeviceUnavailable(PathUnavailable):
    """The device path cannot serve this pair; the message says why (the caller falls back)."""


_EXPORTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_EXPORTS_LOCK = threading.Lock()


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def export_pool(pool: KVPages) -> dict:
    """The pool's IPC description (made once per pool; raises DeviceUnavailable for a CPU pool)."""
    if pool.device.type != "cuda":
        raise DeviceUnavailable(f"the producer's pool is on {pool.device}, not a GPU: nothing to export")
    with _EXPORTS_LOCK:
        export = _EXPORTS.get(pool)
        if export is None:
            buf = pool.buffer
            (dev, handle, size, offset, ref_handle, ref_offset, event_handle,
             event_sync) = buf.untyped_storage()._share_cuda_()
            export = _EXPORTS[pool] = {
                "device_uuid": device_uuid(int(dev)), "handle": bytes(handle), "storage_bytes": int(size),
                "storage_offset": int(offset), "ref_handle": bytes(ref_handle), "ref_offset": int(ref_offset),
                "event_handle": bytes(event_handle or b""), "event_sync": bool(event_sync),
                "buffer_offset": buf.storage_offset() * buf.element_size(), "num_blocks": pool.num_blocks,
                "page_bytes": pool.page_size_bytes}
        return export


def wait_for_writes(pool: KVPages, stream: torch.cuda.Stream) -> None:
    """Producer, before answering a pull: returns once the latest forward that wrote the pool is done."""
    if pool.device.type != "cuda":
        return
    fences_for(pool).order_after_writes(stream)
    stream.synchronize()


def check_export(export: object, pool: KVPages) -> dict:
    """The export as a dict of the expected field types that fits this consumer's pages."""
    if not isinstance(export, dict) or not export:
        raise DeviceUnavailable("the producer exported no pool")
    for name, kind in EXPORT_FIELDS.items():
        value = export.get(name)
        if type(value) is not kind:
            raise DeviceUnavailable(f"export field {name!r} is {type(value).__name__}, expected {kind.__name__}")
    if export["page_bytes"] != pool.page_size_bytes:
        raise DeviceUnavailable(f"producer pages of {export['page_bytes']} bytes, ours {pool.page_size_bytes}")
    end = export["buffer_offset"] + export["num_blocks"] * export["page_bytes"]
    if min(export["num_blocks"], export["storage_bytes"]) <= 0 or export["buffer_offset"] < 0 \
            or end > export["storage_bytes"]:
        raise DeviceUnavailable("the exported pool does not fit its allocation")
    return export


def _local_index(uuid: str) -> int | None:
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    return None


class MappedPool:
    """A producer's page pool, mapped into this process (read only by convention: this side only
    ever copies out of it). Guarantees: `copy_pages` returns after the copied bytes are in the
    local pool (and the compute stream is fenced on them); `close` unmaps."""

    def __init__(self, export: object, pool: KVPages):
        if not torch.cuda.is_available():
            raise DeviceUnavailable("CUDA is not available in this process")
        if pool.device.type != "cuda":
            raise DeviceUnavailable(f"this consumer's pool is on {pool.device}, not a GPU")
        ex = check_export(export, pool)
        src_index = _local_index(ex["device_uuid"])
        if src_index is None:
            raise DeviceUnavailable(f"the producer's GPU {ex['device_uuid']} is not visible to this process "
                                    "(CUDA_VISIBLE_DEVICES)")
        dst_index = pool.device.index if pool.device.index is not None else torch.cuda.current_device()
        if src_index != dst_index and not torch.cuda.can_device_access_peer(dst_index, src_index):
            raise DeviceUnavailable(f"no peer access from cuda:{dst_index} to the producer's cuda:{src_index}")
        try:
            storage = torch.UntypedStorage._new_shared_cuda(
                src_index, ex["handle"], ex["storage_bytes"], ex["storage_offset"], ex["ref_handle"],
                ex["ref_offset"], ex["event_handle"], ex["event_sync"])
        except Exception as e:  # noqa: BLE001 -- cudaIpcOpenMemHandle fails in several ways; each one means "fall back"
            raise DeviceUnavailable(f"opening the IPC handle failed: {type(e).__name__}: {e}") from None
        src = torch.empty(0, dtype=torch.uint8, device=f"cuda:{src_index}")
        src.set_(storage, ex["buffer_offset"], (ex["num_blocks"], ex["page_bytes"]))
        self.src: torch.Tensor | None = src
        self.pool = pool
        self.same_device = src_index == dst_index
        self.num_blocks = ex["num_blocks"]
        self.stream = torch.cuda.Stream(device=pool.device)
        self.fences = fences_for(pool)
        logger.info("KV device path: producer pool mapped from cuda:%d into cuda:%d (%d pages)", src_index,
                    dst_index, self.num_blocks)

    def copy_pages(self, src_ids: list[int], dst_ids: list[int]) -> None:
        """dst page dst_ids[i] = producer page src_ids[i], device to device on the side stream."""
        src = self.src
        if src is None:
            raise DeviceUnavailable("the mapping is closed")
        if len(src_ids) != len(dst_ids) or any(not 0 <= b < self.num_blocks for b in src_ids):
            raise ValueError("source block ids do not fit the producer's pool")
        dst = self.pool.buffer
        runs = paired_runs(src_ids, dst_ids)
        with torch.cuda.device(self.pool.device), torch.cuda.stream(self.stream):
            if self.same_device and len(runs) > MAX_RUN_COPIES:  # one gather + one scatter kernel per chunk
                for a in range(0, len(src_ids), INDEX_CHUNK_PAGES):
                    s = torch.tensor(src_ids[a : a + INDEX_CHUNK_PAGES], dtype=torch.long).to(dst.device)
                    d = torch.tensor(dst_ids[a : a + INDEX_CHUNK_PAGES], dtype=torch.long).to(dst.device)
                    dst.index_copy_(0, d, src.index_select(0, s))
            else:  # a copy per run of pages consecutive on both sides (peer copies where devices differ)
                for s0, d0, n in runs:
                    dst[d0 : d0 + n].copy_(src[s0 : s0 + n], non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(self.stream)
        self.fences.add_landed(landed)
        landed.synchronize()  # a resolved part has no write in flight

    def close(self) -> None:
        self.src = None  # the last view of the mapping: torch closes the IPC handle
        torch.cuda.ipc_collect()


def paired_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """(first source, first destination, count) for runs consecutive in both lists."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
