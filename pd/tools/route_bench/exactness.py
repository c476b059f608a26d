"""After a route_bench run: is the router's KV index what the workers' caches hold?

For each worker, a snapshot of its prefix cache (`GET /internal/kv_events` without `after`: every
cached hash once per copy, taken between engine steps, at the worker's event seq) is compared with
the index's copies of that worker once the index has applied every batch up to the snapshot's seq.
The run is over (no request in flight), so the cache does not move meanwhile."""
from __future__ import annotations

import asyncio
import collections
import logging

from pd.router.kv_index import IndexState

logger = logging.getLogger(__name__)
CATCH_UP_S = 10.0


async def index_matches_caches(router, timeout_s: float = CATCH_UP_S) -> dict[str, bool]:
    """worker id -> True when the index is EXACT on it, at its seq, with the same hash copies."""
    out = {}
    for load in router.pool.all():
        wid = load.endpoint.worker_id
        snap = (await router.client.get_json(load.endpoint.url, "/internal/kv_events", timeout_s)).get("snapshot")
        if not isinstance(snap, dict):
            out[wid] = False
            continue
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while ((router.kv_index.describe(wid) or {}).get("seq", -1) < snap["seq"]) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        described = router.kv_index.describe(wid) or {}
        held = {int(g): dict(collections.Counter(bytes.fromhex(h) for h in hs))
                for g, hs in snap["groups"].items() if hs}
        out[wid] = (described.get("state") == IndexState.EXACT.value and described.get("seq") == snap["seq"]
                    and router.kv_index.copies(wid) == held)
        if not out[wid]:
            logger.error("kv index of %s is not its cache: %s, snapshot seq %s", wid, described, snap["seq"])
    return out
