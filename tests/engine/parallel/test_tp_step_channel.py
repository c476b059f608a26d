"""The step channel (pd/engine/parallel/step_channel.py): rank 0's plans reach every other rank of a
real gloo gang (2 and 4 processes) intact and in order, with `noop` and `stop`; a plan that cannot be
sent is refused on rank 0 before any collective, so the gang stays in step; a header that does not
follow is refused by the receiver."""
from __future__ import annotations

import msgpack
import pytest
import torch
from tests.helpers.tp_gang import Gang

from pd.engine.parallel.group import TPGroup
from pd.engine.parallel.step_channel import NOOP, STEP, STOP, StepChannel, StepChannelError

PLANS = [
    {"seq": 1, "finished_request_ids": [], "zero_block_ids": [],
     "chunks": [["req-1", [1, 2, 3], 0, [4, 5], True]]},
    {"seq": 2, "finished_request_ids": ["req-0", "ünïcode"], "zero_block_ids": [9],
     "chunks": [["req-1", [7], 3, [4, 5], True], ["req-2", list(range(300)), 0, [6, 7, 8], False]]},
    {"blob": b"\x00\xff" * 100_000, "nested": {"a": [1.5, None, True, -(2 ** 40)]}},
    {},
]
LIMIT = 1 << 20


def _exchange(group: TPGroup, plans: list) -> dict:
    channel = StepChannel(group, max_bytes=LIMIT)
    if group.rank == 0:
        refused = []
        for bad in ({"too_big": b"x" * (LIMIT + 1)}, {"not_plain": {1, 2}}, ["not", "a", "dict"]):
            try:
                channel.send(bad)
            except (ValueError, TypeError) as exc:
                refused.append(type(exc).__name__)
        seqs = [channel.send(p) for p in plans[:2]] + [channel.send_noop()] + [channel.send(p) for p in plans[2:]]
        seqs.append(channel.send_stop())
        try:
            channel.send_noop()
        except RuntimeError:
            refused.append("after stop")
        return {"seqs": seqs, "refused": refused}
    received = []
    while True:
        message = channel.receive()
        received.append([message.kind, message.seq, message.plan])
        if message.kind == STOP:
            break
    try:
        channel.send({"a": 1})
    except RuntimeError:
        received.append("followers cannot send")
    return {"received": received}


@pytest.mark.timeout(150)  # spawning ranks imports torch: slow on a busy box, never stuck
@pytest.mark.parametrize("world_size", [2, 4])
def test_plans_reach_every_rank_in_order_without_pickle(world_size):
    with Gang(world_size, _exchange, PLANS, timeout_s=10.0) as gang:
        replies = gang.results()
    assert all("result" in r for r in replies), replies
    head = replies[0]["result"]
    assert head["refused"] == ["ValueError", "TypeError", "TypeError", "after stop"]
    assert head["seqs"] == [1, 2, 3, 4, 5, 6]
    want = [[STEP, 1, PLANS[0]], [STEP, 2, PLANS[1]], [NOOP, 3, None], [STEP, 4, PLANS[2]], [STEP, 5, PLANS[3]],
            [STOP, 6, None], "followers cannot send"]
    for r in replies[1:]:
        assert r["result"]["received"] == want
    assert gang.all_ended()


class _ScriptedGroup:
    """Stands in for a follower's group: each control all-reduce returns the next scripted header,
    each broadcast fills the next scripted payload (the header rule, without processes)."""

    rank, world_size = 1, 2

    def __init__(self, headers: list[list[int]], payloads: list[bytes] = ()):
        self.headers, self.payloads = list(headers), list(payloads)

    def all_reduce_control(self, tensor):
        tensor.copy_(torch.tensor(self.headers.pop(0)))
        return tensor

    def broadcast_control(self, tensor, src=0):
        tensor.copy_(torch.frombuffer(bytearray(self.payloads.pop(0)), dtype=torch.uint8))
        return tensor


@pytest.mark.parametrize(("headers", "payloads", "reason"), [
    ([[2, 1, 0], [2, 3, 0]], [], "seq 3 after 1"),  # a lost message
    ([[9, 1, 0]], [], "kind 9"),
    ([[1, 1, LIMIT + 1]], [], f"{LIMIT + 1} bytes"),
    ([[2, 1, 5]], [], "kind 2, seq 1 after 0, 5 bytes"),  # a noop never carries a payload
    ([[1, 1, 3]], [b"\xc1\x00\x00"], "not msgpack"),
    ([[1, 1, 2]], [msgpack.packb([1])], "is a list, not a map"),
])
def test_a_follower_refuses_a_header_or_payload_out_of_step(headers, payloads, reason):
    channel = StepChannel(_ScriptedGroup(headers, payloads), max_bytes=LIMIT)
    with pytest.raises(StepChannelError, match=reason):
        for _ in headers:
            channel.receive()
