"""AdmissionGate: bounded in-flight prompts, a bounded FIFO queue with a timeout,
429/503 with Retry-After, exact counts on every path (cancelled waiters too)."""
from __future__ import annotations

import asyncio

import pytest

from pd.router.admission import AdmissionGate, AdmissionLimits, Overloaded


def gate(limit=2, queued=2, timeout_s=0.2) -> AdmissionGate:
    return AdmissionGate(lambda: limit, AdmissionLimits(queued, timeout_s, retry_after_s=3))


def test_admits_queues_refuses_and_times_out():
    async def main():
        g = gate(timeout_s=1.0)  # (the waiter must still queue when released: room for a descheduled process)
        assert await g.acquire(1) == 1 and await g.acquire(1) == 1
        waiter = asyncio.create_task(g.acquire(1))
        late = asyncio.create_task(g.acquire(1))
        await asyncio.sleep(0.01)
        assert g.num_queued == 2
        with pytest.raises(Overloaded) as full:
            await g.acquire(1)
        assert full.value.status == 429 and full.value.retry_after_s == 3
        g.release(1)  # the first waiter gets the slot, FIFO
        assert await waiter == 1
        with pytest.raises(Overloaded) as slow:
            await late
        assert slow.value.status == 503
        g.release(1)
        g.release(1)
        assert g.num_in_flight == 0 and g.num_queued == 0

    asyncio.run(main())


def test_fifo_big_request_is_not_starved_and_is_clamped():
    async def main():
        g = gate(limit=4, queued=8, timeout_s=2)
        assert await g.acquire(3) == 3
        big = asyncio.create_task(g.acquire(100))  # clamped to 4: runs alone
        await asyncio.sleep(0.01)
        small = asyncio.create_task(g.acquire(1))  # fits now, but waits behind `big`
        await asyncio.sleep(0.01)
        assert not small.done()
        g.release(3)
        assert await big == 4
        await asyncio.sleep(0.01)
        assert not small.done()
        g.release(4)
        assert await small == 1
        g.release(1)
        assert g.num_in_flight == 0

    asyncio.run(main())


def test_cancelled_waiter_leaves_no_trace():
    async def main():
        g = gate(limit=1, queued=4, timeout_s=5)
        await g.acquire(1)
        waiter = asyncio.create_task(g.acquire(1))
        await asyncio.sleep(0.01)
        waiter.cancel()  # the client went away while queued
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert g.num_queued == 0
        g.release(1)
        assert g.num_in_flight == 0 and await g.acquire(1) == 1

    asyncio.run(main())
