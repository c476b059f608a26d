"""Shared memory for the same-host data paths: staging segments, and mapping a
producer's page pool read-only (`map_pool`).

A producer stream creates one segment (two halves of `chunk_pages` pages) in
`/dev/shm`, pre-faults it, and names it to its consumer; the consumer maps it
and unlinks the name at once, so nothing is left behind if either process
dies. Pages pass through the segment under credit-based double buffering (see
`shm_staged.py`); the segment only ever holds pages of the pull being served,
never a view of the producer's pool. For a CUDA pool both sides page-lock the
segment (`pin_for_pool`): unpinned, every copy between the device and the
segment crawls through the driver's bounce buffer, synchronously (the reason
shm once ran slower than tcp on a GPU). Where CUDA refuses to page-lock it, the
segment stays pageable: slower copies, logged once per process, never a failure.
"""
from __future__ import annotations

import logging
import mmap
import os
import secrets
import threading

import numpy as np
import torch

from connectors.zmq.paths.cuda_staging import HostPin

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_refusal_logged = threading.Event()  # "CUDA refused to page-lock a segment" is said once per process


def wants_pin(device: torch.device) -> bool:
    """Whether a segment feeding a pool on `device` is worth page-locking (a CUDA pool's copies)."""
    return device.type == "cuda"


def pin_for_pool(seg: ShmSegment, device: torch.device) -> bool:
    """Page-locks `seg` when its pool is on a GPU. Returns whether it is page-locked now; where
    CUDA refuses (`cudaHostRegister` fails: RLIMIT_MEMLOCK, a driver that will not), the segment
    stays pageable and works as it is, at the driver's bounce-buffer rate."""
    if not wants_pin(device):
        return False
    try:
        seg.pin()
    except RuntimeError as e:  # (torch's CudaError is a RuntimeError)
        if not _refusal_logged.is_set():
            _refusal_logged.set()
            logger.warning("CUDA refused to page-lock a shared-memory segment (%s); shm copies go through "
                           "pageable memory (slower). Said once per process.", e)
        return False
    return True


class ShmSegment:
    """A mapped segment viewed as `tensor` of shape (2 * chunk_pages, page_bytes)."""

    def __init__(self, name: str, mm: mmap.mmap, chunk_pages: int, page_bytes: int, owner: bool):
        self.name = name
        self.chunk_pages = chunk_pages
        self.page_bytes = page_bytes
        self._mm = mm
        self._owner = owner
        self._pin: HostPin | None = None
        self.tensor = torch.frombuffer(mm, dtype=torch.uint8).view(2 * chunk_pages, page_bytes)

    def pin(self) -> None:
        """Page-locks the mapping for CUDA copies (undone by `close`)."""
        if self._pin is None:
            self._pin = HostPin(self.tensor)

    @property
    def nbytes(self) -> int:
        return 2 * self.chunk_pages * self.page_bytes

    def half(self, index: int) -> torch.Tensor:
        return self.tensor[index * self.chunk_pages : (index + 1) * self.chunk_pages]

    @classmethod
    def create(cls, chunk_pages: int, page_bytes: int) -> ShmSegment:
        name = f"pdkv-{secrets.token_hex(12)}"
        size = 2 * chunk_pages * page_bytes
        fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        seg = cls(name, mm, chunk_pages, page_bytes, owner=True)
        seg.tensor.zero_()  # pre-fault now rather than inside the first transfer
        return seg

    @classmethod
    def open(cls, name: str, size: int, chunk_pages: int, page_bytes: int) -> ShmSegment:
        if "/" in name or not name.startswith("pdkv-") or size != 2 * chunk_pages * page_bytes:
            raise ValueError(f"bad shared-memory segment {name!r} of {size} bytes")
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != size:
                raise ValueError(f"segment {name} has size {os.fstat(fd).st_size}, expected {size}")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        seg = cls(name, mm, chunk_pages, page_bytes, owner=False)
        seg.unlink()  # both sides hold a mapping now; the name is no longer needed
        seg.tensor[:].sum()  # touch (pre-fault) the mapping on this side too
        return seg

    def unlink(self) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.unlink()
        if self._pin is not None:  # unregistered before the unmap
            self._pin.release()
            self._pin = None
        self.tensor = None  # drop the exported buffer before closing the map
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere; the GC unmaps it later
            pass


def map_pool(path: str, size: int, page_bytes: int) -> np.ndarray:
    """Maps a same-host producer's page pool read-only as (num_blocks, page_bytes)."""
    parts = path.split("/")
    if (len(parts) != 5 or parts[:2] != ["", "proc"] or parts[3] != "fd"
            or not (parts[2].isdigit() and parts[4].isdigit())):
        raise ValueError(f"not a pool path: {path!r}")
    if size <= 0 or size % page_bytes:
        raise ValueError(f"pool of {size} bytes is not whole pages of {page_bytes}")
    fd = os.open(path, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size != size:
            raise ValueError(f"{path} has {os.fstat(fd).st_size} bytes, expected {size}")
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    return np.frombuffer(mm, dtype=np.uint8).reshape(size // page_bytes, page_bytes)
