"""Rank 0's step plans to the other ranks of a TP gang, over the group's gloo control group.

Each message is two collectives: a header all-reduce (rank 0 contributes `[kind, seq, size]`, the
others zeros, so every rank learns it and every rank must be alive for it to complete), then, for a
step, the payload broadcast from rank 0 as a uint8 tensor of `size` bytes. A plan is a msgpack map
(plain values only: lists, numbers, strings, bytes); nothing is ever pickled.

Kinds: `step` (a plan), `noop` (liveness only: rank 0 sends one whenever it has had nothing to send
for a while, well inside the group's timeout, so that neither side sits in a collective long enough
to time out and a dead peer is seen within that while), `stop` (the other ranks leave their loop).

Guarantees: every rank sees the same messages in the same order (`seq` counts from 1, and a receiver
that sees a gap or a header it cannot read raises instead of running a wrong step); a payload is
never larger than `max_bytes`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import torch

from pd.engine.parallel.group import TPGroup


def _refuse_ext(code: int, data: bytes) -> Any:
    # a plan holds plain values only: an extension type is not one of ours (never decoded into objects)
    raise ValueError(f"msgpack extension type {code} in a step plan")

STEP, NOOP, STOP = "step", "noop", "stop"
_KIND_CODES = {STEP: 1, NOOP: 2, STOP: 3}
_KINDS = {code: kind for kind, code in _KIND_CODES.items()}
MAX_PLAN_BYTES = 64 << 20


class StepChannelError(RuntimeError):
    """The channel's peers disagree (a lost or garbled message): the gang cannot go on."""


@dataclasses.dataclass(frozen=True)
class Message:
    kind: str
    seq: int
    plan: dict[str, Any] | None = None


class StepChannel:
    """Rank 0 sends (`send`, `send_noop`, `send_stop`); every other rank receives (`receive`)."""

    def __init__(self, group: TPGroup, max_bytes: int = MAX_PLAN_BYTES):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.group = group
        self.max_bytes = max_bytes
        self._seq = 0
        self.stopped = False

    def _header(self, kind: str, size: int) -> torch.Tensor:
        header = torch.zeros(3, dtype=torch.int64)
        if self.group.rank == 0:
            header[0], header[1], header[2] = _KIND_CODES[kind], self._seq + 1, size
        return self.group.all_reduce_control(header)

    def _send(self, kind: str, payload: bytes = b"") -> int:
        if self.group.rank != 0:
            raise RuntimeError(f"rank {self.group.rank} cannot send step plans: only rank 0 does")
        if self.stopped:
            raise RuntimeError("the step channel was stopped")
        if len(payload) > self.max_bytes:
            raise ValueError(f"a step plan of {len(payload)} bytes exceeds the channel's {self.max_bytes}")
        self._header(kind, len(payload))
        self._seq += 1
        if payload:
            self.group.broadcast_control(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        if kind == STOP:
            self.stopped = True
        return self._seq

    def send(self, plan: dict[str, Any]) -> int:
        """Sends one step's plan to every other rank; returns its sequence number."""
        if not isinstance(plan, dict):
            raise TypeError(f"a step plan is a dict, got {type(plan).__name__}")
        return self._send(STEP, msgpack.packb(plan, use_bin_type=True))

    def send_noop(self) -> int:
        """A liveness round: raises within the group's timeout if any rank is gone."""
        return self._send(NOOP)

    def send_stop(self) -> int:
        return self._send(STOP)

    def receive(self) -> Message:
        """The next message from rank 0 (blocks up to the group's timeout)."""
        if self.group.rank == 0:
            raise RuntimeError("rank 0 sends step plans; it does not receive them")
        if self.stopped:
            raise RuntimeError("the step channel was stopped")
        code, seq, size = (int(x) for x in self._header(STEP, 0).tolist())
        kind = _KINDS.get(code)
        if kind is None or seq != self._seq + 1 or not 0 <= size <= self.max_bytes or (kind != STEP and size):
            raise StepChannelError(f"rank {self.group.rank}: unreadable step header (kind {code}, seq {seq} "
                                   f"after {self._seq}, {size} bytes, limit {self.max_bytes})")
        self._seq = seq
        if kind == STOP:
            self.stopped = True
        if kind != STEP:
            return Message(kind, seq)
        buffer = torch.empty(size, dtype=torch.uint8)
        if size:
            self.group.broadcast_control(buffer)
        try:
            plan = msgpack.unpackb(buffer.numpy().tobytes(), raw=False, strict_map_key=False, ext_hook=_refuse_ext)
        except (ValueError, msgpack.UnpackException) as exc:
            raise StepChannelError(f"rank {self.group.rank}: step plan {seq} is not msgpack: {exc}") from exc
        if not isinstance(plan, dict):
            raise StepChannelError(f"rank {self.group.rank}: step plan {seq} is a {type(plan).__name__}, not a map")
        return Message(STEP, seq, plan)
