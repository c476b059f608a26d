"""The cuda_ipc data path (same node, both pools on GPUs): the consumer maps the producer's CUDA
pool through CUDA IPC (`ipc_mapping.py`) and copies pages device to device.

The producer's ATTACHED carries the pool's IPC export (only an authenticated stream ever gets
one). A PULL is answered with its PAGES header once the forward that wrote the pages is done;
the consumer copies, then CREDITs: the lease stays pinned until then. Page checksums are
optional on this path (`device_checksums`: the bytes never cross a wire, and checking costs a
device-to-host pass and a host hash of every page on both sides): a consumer that does not
check says so in its ATTACH, and then the producer computes no digest for its pulls either.
A stream that cannot map the pool falls back to the host path: `shm_mapped` for a CPU pool,
`shm_staged` for a CUDA one.
"""
from __future__ import annotations

import torch

from connectors.metrics import FailureCause
from connectors.pages import KVPages
from connectors.zmq.control import framing
from connectors.zmq.control.wire import MalformedMessage, MsgType
from connectors.zmq.paths import answers, ipc_mapping
from connectors.zmq.paths.base import PathName, PathReceiver, PathServer, PullPart
from connectors.zmq.paths.page_access import PageAccess
from connectors.zmq.paths.shm_mapped import FINAL_CREDIT, serve_in_place
from connectors.zmq.paths.tcp import NO_SHM


class CudaIpcServer(PathServer):
    name = PathName.CUDA_IPC
    _stream: torch.cuda.Stream | None = None  # waits for the pages' writer (a CUDA pool)

    @property
    def needs_digests(self) -> bool:
        return self.settings.checksums  # only a consumer that checks every page gets digests

    def attached(self) -> dict:
        if not self.settings.offer_device:
            raise ipc_mapping.DeviceUnavailable("this producer does not offer its device pool (an emulated link, "
                                                "or shared memory disallowed)")
        try:
            export = ipc_mapping.export_pool(self.pool)
        except ipc_mapping.DeviceUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 -- any failure to export means: no device path, say why
            raise ipc_mapping.DeviceUnavailable(f"{type(e).__name__}: {e}") from None
        return {**NO_SHM, "ipc": export}

    def serve(self, reader: framing.FrameReader, xfer: int, block_ids: list[int], digests: list[int]) -> None:
        if self.pool.device.type == "cuda":  # the consumer reads the pages on the device: their writer first
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=self.pool.device)
            ipc_mapping.wait_for_writes(self.pool, self._stream)
        serve_in_place(self, reader, xfer, digests)


class CudaIpcReceiver(PathReceiver):
    name = PathName.CUDA_IPC
    _device: ipc_mapping.MappedPool | None = None

    @staticmethod
    def fallback(pool: KVPages) -> PathName | None:
        return PathName.SHM_MAPPED if pool.device.type == "cpu" else PathName.SHM_STAGED

    def open(self, attached: dict) -> None:
        self._device = ipc_mapping.MappedPool(attached.get("ipc"), self.pool)

    def receive(self, part: PullPart, access: PageAccess) -> None:
        msg = answers.expect(self.conn, MsgType.PAGES, part.xfer)  # the producer's pages are written: copy them
        device = self._device
        assert device is not None  # (opened)
        self.owed_credit = FINAL_CREDIT  # unpins the lease, whatever happens below
        digests = msg["digests"]
        if self.device_checksums and len(digests) != len(part.dst_block_ids):
            raise MalformedMessage("pages header does not match the pull")
        device.copy_pages(part.src_block_ids, part.dst_block_ids)
        if self.device_checksums:  # a device-to-host pass and a host hash of every page
            got = access.page_digests(part.dst_block_ids)
            part.bad_block_ids.extend(b for b, want, have in zip(part.dst_block_ids, digests, got, strict=True)
                                      if want != have)
            if part.bad_block_ids:
                part.cause = FailureCause.CHECKSUM

    def close(self) -> None:
        if self._device is not None:
            self._device.close()  # the session's mapping of the producer's pool ends with its stream
            self._device = None
