"""Fixtures for connector tests: KV peers in their own processes."""
from __future__ import annotations

import pytest

from tests.helpers.kvpeer import PeerProc


@pytest.fixture(scope="module")
def producer():
    p = PeerProc(engine_id="prefill-0", role="kv_producer", lease_s=30.0)
    yield p
    p.close()


@pytest.fixture(scope="module")
def consumer():
    c = PeerProc(engine_id="decode-0", role="kv_consumer", heartbeat_s=0.2)
    yield c
    c.close()
