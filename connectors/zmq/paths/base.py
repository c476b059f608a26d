"""The one interface every data path implements, in two halves: how the producer serves a
pull's pages on one data stream (`PathServer`) and how the consumer lands them in its page pool
(`PathReceiver`).

A data stream's path is chosen once, when it attaches (`choice.py`), and never changes; the
stream's loop (`consumer/pull_stream.py`, `producer/data_stream.py`) is the same for every path
and only calls these methods. The paths, one module each:

- `tcp`: the page bytes follow a PAGES header on the data socket;
- `shm_mapped`: same host, CPU pool: the consumer copies out of the producer's pool, mapped
  read-only (what the user's `shm` means for a CPU pool);
- `shm_staged`: same host: pages pass through a double-buffered shared-memory segment (what the
  user's `shm` means for a CUDA pool, and `shm_mapped`'s fallback);
- `cuda_ipc`: same node, CUDA pools: the consumer copies device to device out of the producer's
  pool, mapped through CUDA IPC.

How a stream's pool pages reach host memory on the tcp, shm_mapped and shm_staged paths is the
second small interface, one level below (`page_access.PageAccess`, chosen once per stream by
`choice.page_access_for`): in place for a CPU pool (`InPlacePages`), through the pinned staging
ring for a CUDA pool (`staging_ring.StagedPages`).
"""
from __future__ import annotations

import abc
import dataclasses
import enum
import socket
from collections.abc import Callable
from typing import ClassVar

from connectors.metrics import FailureCause
from connectors.pages import KVPages
from connectors.zmq.control import framing
from connectors.zmq.paths.page_access import PageAccess


class PathName(str, enum.Enum):
    """What a data stream names in its ATTACH (and what `Consumer.data_paths` reports)."""

    TCP = "tcp"
    SHM_MAPPED = "shm_mapped"
    SHM_STAGED = "shm_staged"
    CUDA_IPC = "cuda_ipc"
    GANG = "gang"  # either side is a TP gang: every rank moves its own heads (`connectors/zmq/gang/`)


@dataclasses.dataclass(slots=True)
class PullPart:
    """A slice of one load that travels on one stream: what a path lands."""

    remote_request_id: str
    src_block_ids: list[int]
    dst_block_ids: list[int]
    on_done: Callable[[PullPart], None]
    bad_block_ids: list[int] = dataclasses.field(default_factory=list)
    cause: FailureCause | None = None  # None: all pages landed and verified
    xfer: int = 0  # set once its PULL started to go out
    unsent: bytes = b""  # tail of the PULL frame the stream thread still has to send
    expect: bytes = b""  # a one-page answer's exact PAGES frame up to its digest (made once the PULL is out)
    trace_context: str | None = None  # its load's, sent in the PULL

    def fail(self, cause: FailureCause) -> None:
        self.cause = cause
        self.bad_block_ids = list(self.dst_block_ids)


class Refused(Exception):
    """The producer answered a pull with ERROR (the lease is gone, blocks not leased...)."""


class PathUnavailable(Exception):
    """This path cannot serve this pair (the message says why); the stream falls back."""


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    """What a producer's data stream serves with: from its config, and the stream's ATTACH."""

    io_timeout_s: float = 5.0  # a frame, a send or a credit waits at most this long
    shm_chunk_bytes: int = 8 * 1024 * 1024  # shm_staged: one half of the segment
    offer_shm: bool = True  # same-host paths allowed (shm_mapped, shm_staged)
    offer_device: bool = True  # cuda_ipc allowed
    checksums: bool = True  # cuda_ipc: the consumer checks every page (ATTACH's `checksums`)


class PathServer(abc.ABC):
    """The producer's half of one attached data stream.

    Guarantees: `attached` is sent before any pull is served; `serve` returns once the
    consumer no longer reads the pull's pages (sent, or credited back), so the lease may be
    released; `close` frees what the path holds (a segment), once."""

    name: ClassVar[PathName]

    def __init__(self, conn: socket.socket, pool: KVPages, access: PageAccess, settings: ServeSettings):
        self.conn = conn
        self.pool = pool
        self.access = access
        self.settings = settings

    @property
    def needs_digests(self) -> bool:
        """Whether a pull's answer carries page digests (the consumer checks them)."""
        return True

    @abc.abstractmethod
    def attached(self) -> dict:
        """The ATTACHED message's fields (raises PathUnavailable: the producer says why and
        closes the connection; the consumer falls back on a new one)."""

    @abc.abstractmethod
    def serve(self, reader: framing.FrameReader, xfer: int, block_ids: list[int], digests: list[int]) -> None:
        """Sends one pull's pages (`digests` is empty when `needs_digests` is false)."""

    def close(self) -> None:  # noqa: B027 -- optional: most paths hold nothing beyond the connection
        """Frees what the path holds beyond the connection."""


class PathReceiver(abc.ABC):
    """The consumer's half of one attached data stream.

    Guarantees: `receive` returns with every destination page landed (no copy into the pool
    still running) and those failing their checksum in `part.bad_block_ids` (cause CHECKSUM);
    it raises `Refused` when the producer refused the pull, anything else when the stream broke.
    A frame the producer waits for after the pages (the credit that unpins its lease) is left in
    `owed_credit`, sent once the part is reported (off the latency path), even if `receive` raised."""

    name: ClassVar[PathName]
    spins_in_reads: ClassVar[bool] = False  # waits for the answer itself (tcp): no spin before `receive`
    owed_credit: bytes | None = None

    def __init__(self, conn: socket.socket, pool: KVPages, spin_s: float = 0.0, device_checksums: bool = False):
        self.conn = conn
        self.pool = pool
        self.spin_s = spin_s
        self.device_checksums = device_checksums

    @staticmethod
    def fallback(pool: KVPages) -> PathName | None:
        """The path a stream tries next when this one cannot attach (None: the stream is dead)."""
        return None

    @abc.abstractmethod
    def open(self, attached: dict) -> None:
        """Takes the producer's ATTACHED answer (raises PathUnavailable, OSError or ValueError:
        the stream falls back)."""

    @abc.abstractmethod
    def receive(self, part: PullPart, access: PageAccess) -> None:
        """Lands one pull's pages."""

    def take_owed_credit(self) -> bytes | None:
        credit, self.owed_credit = self.owed_credit, None
        return credit

    def close(self) -> None:  # noqa: B027 -- optional: tcp maps nothing
        """Unmaps what the path mapped (a segment, the producer's pool)."""
