"""A TP group: the processes of one tensor-parallel worker (its gang), one rank each.

Rendezvous: rank 0 opens a `TCPStore` on a port the OS picks (`open_rendezvous`), and hands its
address, a plain "host:port" string, to the other ranks when it starts them. No port or name is
fixed, so two gangs on one host (a P and a D worker) never collide, and a restarted gang gets a
fresh address.

Backends: activations are all-reduced with NCCL on CUDA and gloo on the CPU (the backend name is
the only difference, `backend_for`); control messages (`broadcast_control`, the step channel)
always go over gloo. Every collective has an explicit timeout (`timeout_s`, a setting): a rank that
died or hangs makes the others' next collective raise within it instead of blocking for the
library's default (minutes). Joining has its own, longer timeout (`join_timeout_s`): the other ranks
are still starting (importing torch, loading weights) while rank 0 waits for them.

A failed collective leaves the group unusable: the gang is the unit of failure, and its owner must
tear every rank down (`close`) and start a new gang with a new rendezvous.

One process holds at most one group (torch's default process group), which is the shape of a gang:
one rank per process.
"""
from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def backend_for(device: torch.device | str) -> str:
    """The collective backend for activations on `device`: nccl on CUDA, gloo elsewhere."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _timeout(timeout_s: float) -> datetime.timedelta:
    if not timeout_s > 0:
        raise ValueError(f"a TP timeout must be positive seconds, got {timeout_s!r}")
    return datetime.timedelta(seconds=timeout_s)


def _split(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"TP rendezvous address {address!r} is not host:port")
    return host.strip("[]"), int(port)


class Rendezvous:
    """Rank 0's store for one gang incarnation, on a port chosen at start. `address` is what the
    other ranks are given. Keep it open until the group is closed (rank 0's `TPGroup` does)."""

    def __init__(self, host: str, world_size: int, join_timeout_s: float):
        if world_size < 1:
            raise ValueError(f"a TP group has at least one rank, got {world_size}")
        self.store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=_timeout(join_timeout_s),
                                   wait_for_workers=False)
        bracketed = f"[{host}]" if ":" in host else host
        self.address = f"{bracketed}:{self.store.port}"
        self.world_size = world_size


def open_rendezvous(host: str, world_size: int, join_timeout_s: float = 120.0) -> Rendezvous:
    """Rank 0's side of the rendezvous: a store on a free port of `host` (pass an explicit address
    the other ranks reach, not the machine's hostname), waiting up to `join_timeout_s` for them."""
    return Rendezvous(host, world_size, join_timeout_s)


def _wait_for_everyone(store, world_size: int, join_timeout_s: float) -> None:
    """Returns once every rank has reached the store. gloo connects its ranks under the collective
    timeout, which is meant for the seconds of a step, not for ranks still starting up."""
    if store.add("pdkv/tp/joined", 1) == world_size:
        store.set("pdkv/tp/everyone", b"1")
    try:
        store.wait(["pdkv/tp/everyone"], datetime.timedelta(seconds=join_timeout_s))
    except Exception as exc:  # noqa: BLE001 - torch raises several store errors; all mean the same here
        raise TimeoutError(f"TP group: not all {world_size} ranks joined within {join_timeout_s} s: {exc}") from exc


class TPGroup:
    """This process's rank in a TP gang of `world_size` ranks.

    Guarantees: every collective either completes on every rank or raises on the ranks that
    reach it within `timeout_s` (a peer's death is usually seen at once, a hang at the timeout);
    `control_group` is gloo whatever the device.
    """

    def __init__(self, rank: int, world_size: int, address: str | Rendezvous, device: torch.device | str = "cpu",
                 timeout_s: float = 60.0, join_timeout_s: float = 120.0):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not a rank of a TP group of {world_size}")
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a TP group (one rank per process)")
        timeout, join_timeout = _timeout(timeout_s), _timeout(join_timeout_s)
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.device = torch.device(device)
        self.backend = backend_for(self.device)
        self._rendezvous: Rendezvous | None = None
        if isinstance(address, Rendezvous):
            if rank != 0:
                raise ValueError("only rank 0 holds the rendezvous store; give the other ranks its address")
            self._rendezvous = address
            store = address.store
        else:
            host, port = _split(address)
            store = dist.TCPStore(host, port, world_size, is_master=False, timeout=join_timeout)
        if self.backend == "nccl":
            # a failed NCCL collective raises instead of hanging the stream until the watchdog kills the process
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
            torch.cuda.set_device(self.device)
        _wait_for_everyone(store, world_size, join_timeout_s)
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        self._control = None if self.backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        log.info("TP rank %d/%d joined (%s, timeout %.1f s)", rank, world_size, self.backend, timeout_s)

    @property
    def control_group(self):
        """The gloo group for control messages (the default group when activations use gloo too)."""
        return self._control if self._control is not None else dist.group.WORLD

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduces `tensor` in place over every rank (`sum`, `min` or `max`) and returns it."""
        if op not in _OPS:
            raise ValueError(f"unknown reduction {op!r}: one of {sorted(_OPS)}")
        if self.world_size > 1:
            dist.all_reduce(tensor, op=_OPS[op])
        return tensor

    def all_reduce_control(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """`all_reduce` of a CPU tensor over the control group (the liveness check of the step channel)."""
        if op not in _OPS:
            raise ValueError(f"unknown reduction {op!r}: one of {sorted(_OPS)}")
        if self.world_size > 1:
            dist.all_reduce(tensor, op=_OPS[op], group=self.control_group)
        return tensor

    def broadcast_control(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s CPU `tensor` copied into every rank's `tensor` (same shape and dtype everywhere)."""
        if self.world_size > 1:
            dist.broadcast(tensor, src=src, group=self.control_group)
        return tensor

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (the gang's common pool size, for instance)."""
        return int(self.all_reduce_control(torch.tensor([value], dtype=torch.int64), op="min").item())

    def close(self) -> None:
        """Leaves the group and closes rank 0's store. Safe to call twice, and after a failed collective."""
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # noqa: BLE001 - a broken group still has to be released
                log.warning("TP rank %d: destroying the process group failed: %s", self.rank, exc)
        self._rendezvous = None
