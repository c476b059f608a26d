"""The KV event wire format: signed msgpack batches, anything else refused with a reason."""
from __future__ import annotations

import hashlib
import hmac

import msgpack
import pytest

from pd.cluster.kv_wire import TOPIC, BatchError, EventBatch, decode_batch, encode_batch, event_key

KEY = event_key("wire-test-secret-0123456789")
BATCH = EventBatch("engine-1", "prefill-0", 7, [["stored", 0, [b"\x01" * 32, b"\x02" * 32]],
                                               ["removed", 1, [b"\x03" * 32]], ["cleared", -1, []]])


def _signed(payload: bytes) -> list[bytes]:
    return [TOPIC, payload, hmac.new(KEY, payload, hashlib.sha256).digest()]


def test_round_trip_keeps_every_field():
    assert decode_batch(KEY, encode_batch(KEY, BATCH)) == BATCH


@pytest.mark.parametrize("frames, reason", [
    (encode_batch(event_key("another-secret-0123456789"), BATCH), "bad_mac"),
    (encode_batch(KEY, BATCH)[:2], "malformed"),
    (_signed(b"\xc1\xc1"), "malformed"),
    (_signed(msgpack.packb(msgpack.ExtType(1, b"x"))), "malformed"),
    (_signed(msgpack.packb({"v": 2, "engine_id": "e", "worker_id": "w", "seq": 1, "events": []})), "malformed"),
    (_signed(msgpack.packb({"v": 1, "engine_id": "e", "worker_id": "w", "seq": 0, "events": []})), "malformed"),
    (_signed(msgpack.packb({"v": 1, "engine_id": "e", "worker_id": "w", "seq": 1,
                            "events": [["stored", 0, ["not bytes"]]]})), "malformed"),
    (_signed(msgpack.packb({"v": 1, "engine_id": "e", "worker_id": "w", "seq": 1,
                            "events": [["evicted", 0, []]]})), "malformed"),
])
def test_bad_batches_are_refused_with_a_reason(frames, reason):
    with pytest.raises(BatchError) as info:
        decode_batch(KEY, frames)
    assert info.value.reason == reason
