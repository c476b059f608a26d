"""A TP gang of real processes for tests: torch.multiprocessing (spawn), gloo on 127.0.0.1, one
torch thread per rank.

Rank 0 opens the rendezvous on a port the OS picks and sends its address back; the parent hands it
to the other ranks as a plain string, as a gang's rank 0 would (every rank is spawned at once, so
the seconds of importing torch overlap). Each rank runs
`target(group, *args)` and sends back what it returns (plain values, msgpack over a pipe), or the
error it raised. `Gang` always terminates and joins every process it started.
"""
from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import Any

import msgpack
import torch.multiprocessing as mp

HOST = "127.0.0.1"
START_TIMEOUT_S = 60.0  # spawning a rank imports torch: seconds on a busy box


def _rank_main(rank: int, world_size: int, target: Callable, args: tuple, conn, inbox, timeout_s: float) -> None:
    import torch

    from pd.engine.parallel.group import TPGroup, open_rendezvous

    torch.set_num_threads(1)
    group = None
    try:
        if rank == 0:
            rendezvous = open_rendezvous(HOST, world_size, START_TIMEOUT_S)
            conn.send_bytes(msgpack.packb({"address": rendezvous.address}))
            group = TPGroup(0, world_size, rendezvous, timeout_s=timeout_s, join_timeout_s=START_TIMEOUT_S)
        else:
            if not inbox.poll(START_TIMEOUT_S):
                raise TimeoutError("no rendezvous address from the parent")
            address = msgpack.unpackb(inbox.recv_bytes())["address"]
            group = TPGroup(rank, world_size, address, timeout_s=timeout_s, join_timeout_s=START_TIMEOUT_S)
        reply = {"result": target(group, *args)}
    except Exception as exc:  # noqa: BLE001 - the parent asserts on it
        reply = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    finally:
        if group is not None:
            group.close()
    conn.send_bytes(msgpack.packb(reply, use_bin_type=True))


class Gang:
    """`world_size` ranks running `target`; use as a context manager (every process is ended on exit)."""

    def __init__(self, world_size: int, target: Callable, *args: Any, timeout_s: float = 5.0):
        self.world_size, self.target, self.args, self.timeout_s = world_size, target, args, timeout_s
        self.ctx = mp.get_context("spawn")
        self.procs: list = []
        self.conns: list = []
        self.inboxes: list = []
        self.address: str | None = None

    def _start(self, rank: int) -> None:
        parent, child = self.ctx.Pipe(duplex=False)
        inbox, outbox = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=_rank_main, daemon=True,
                                args=(rank, self.world_size, self.target, self.args, child, inbox, self.timeout_s))
        proc.start()
        child.close()
        inbox.close()
        self.procs.append(proc)
        self.conns.append(parent)
        self.inboxes.append(outbox)

    def __enter__(self) -> Gang:
        try:
            for rank in range(self.world_size):
                self._start(rank)
            if not self.conns[0].poll(START_TIMEOUT_S):
                raise TimeoutError(f"rank 0 sent no rendezvous address in {START_TIMEOUT_S} s")
            self.address = msgpack.unpackb(self.conns[0].recv_bytes())["address"]
            for outbox in self.inboxes[1:]:
                outbox.send_bytes(msgpack.packb({"address": self.address}))
        except BaseException:
            self.close()
            raise
        return self

    def results(self, wait_s: float = START_TIMEOUT_S, ranks: list[int] | None = None) -> list[dict]:
        """Each rank's reply ({"result": ...} or {"error": ...}); {"gone": exitcode} for a rank that
        ended without one. Waits at most `wait_s` in all, for `ranks` only when given."""
        deadline = time.monotonic() + wait_s
        out = []
        for rank in (range(self.world_size) if ranks is None else ranks):
            proc, conn = self.procs[rank], self.conns[rank]
            if conn.poll(max(0.0, deadline - time.monotonic())):
                try:
                    out.append(msgpack.unpackb(conn.recv_bytes(), raw=False))
                    continue
                except EOFError:
                    pass
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
            out.append({"gone": proc.exitcode})
        return out

    def close(self) -> None:
        deadline = time.monotonic() + 2.0  # ranks that replied are exiting already; the rest are ended
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in (*self.conns, *self.inboxes):
            conn.close()

    def __exit__(self, *exc) -> None:
        self.close()

    def all_ended(self) -> bool:
        return all(not p.is_alive() for p in self.procs)
