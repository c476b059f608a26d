"""The router's KV index against each worker's own cache (its block pool's hash map), on real
workers (engine, ZMQ connector, CURVE event stream, HTTP) and the real router, over loopback.

- two blocks holding one hash (identical greedy requests) are two copies: the hash stays
  indexed until its last copy is removed, as on the worker;
- a worker over its index share stays DEGRADED (never EXACT on a fraction of its cache), and
  comes back only from a snapshot once its cache fits;
- after a mixed workload (shared prefixes, duplicates, client aborts, eviction and a cap
  overflow) every worker's index entry is its cache, copy for copy, or it is marked DEGRADED."""
from __future__ import annotations

import collections
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from kv_route_deploy import KVDeployment
from rel_deploy import SECRET, local_config

TIMEOUT_S = 30
SYSTEM = [f"You are the assistant of tenant {t}; answer briefly and politely, citing the manual. " * 2
          for t in "ABC"]


def _config(**overrides):
    # 0.25 MB: about 32 blocks of 16 tokens per worker, so every run evicts
    return local_config("disaggregated", **{"cache__kv_memory_mb": 0.25, **overrides})


def _complete(dep: KVDeployment, prompt: str, max_tokens: int = 3, temperature: float = 0.0) -> dict:
    r = requests.post(dep.url + "/v1/completions", timeout=TIMEOUT_S,
                      json={"model": "pdkv-tiny", "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": temperature, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def _abort_after_first_chunk(dep: KVDeployment, prompt: str) -> None:
    with requests.post(dep.url + "/v1/completions", timeout=TIMEOUT_S, stream=True,
                       json={"model": "pdkv-tiny", "prompt": prompt, "max_tokens": 64, "stream": True}) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # then the client goes away


def _counter(dep: KVDeployment, name: str, **labels) -> float:
    return sum(s.value for m in dep.router.metrics.registry.collect() for s in m.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _own_cache(dep: KVDeployment, wid: str) -> tuple[int, dict[int, dict[bytes, int]]]:
    """(seq, {group: {hash: copies}}) from the worker's own replay endpoint (a snapshot of its pool)."""
    url = dep.workers[wid].url
    r = requests.get(f"{url}/internal/kv_events", headers={"Authorization": f"Bearer {SECRET}"}, timeout=TIMEOUT_S)
    r.raise_for_status()
    snap = r.json()["snapshot"]
    groups = {int(g): dict(collections.Counter(bytes.fromhex(h) for h in hs)) for g, hs in snap["groups"].items()}
    return snap["seq"], {g: hs for g, hs in groups.items() if hs}


def _check_exact_or_degraded(dep: KVDeployment, timeout_s: float = 20.0) -> dict[str, str]:
    """Once every worker is settled (EXACT at its seq, or DEGRADED over its share), each EXACT
    worker's entries must be its cache: the same hashes, with the same number of copies."""
    dep.wait_all_free()
    deadline = time.monotonic() + timeout_s
    while True:
        states = {}
        for wid, worker in dep.workers.items():
            d = dep.index.describe(wid)
            if d["state"] == "exact" and d["seq"] == worker.kv_events.seq:
                states[wid] = "exact"
            elif d["state"] == "degraded" and "share" in (d["reason"] or ""):
                states[wid] = "degraded"
        if len(states) == len(dep.workers):
            break
        assert time.monotonic() < deadline, {w: dep.index.describe(w) for w in dep.workers}
        time.sleep(0.05)
    for wid, state in states.items():
        if state != "exact":
            continue
        seq, cache = _own_cache(dep, wid)
        assert seq == dep.index.describe(wid)["seq"], wid  # idle: nothing moved in between
        assert dep.index.hashes(wid) == {g: set(hs) for g, hs in cache.items()}, wid
        assert dep.index.copies(wid) == cache, wid
    return states


def test_a_hash_stays_indexed_until_its_last_copy_goes():
    with KVDeployment(_config(), num_prefill=1, num_decode=1) as dep:
        partial = False  # a copy removed while another copy of the hash stays cached
        for round_id in range(3):
            prompt = SYSTEM[round_id % 3] + f" round {round_id}: summarise the manual."
            for _ in range(2):  # greedy twins: D decodes the same tokens into new blocks, same hashes
                _complete(dep, prompt, max_tokens=40)
            dep.wait_exact()
            before = {wid: dep.cached_copies(wid) for wid in dep.workers}
            assert any(n >= 2 for hs in before["decode-0"].values() for n in hs.values()), "twins leave copies"
            for i in range(10):  # fillers: evict one block or two at a time
                _complete(dep, f"filler {round_id}.{i} " + "x" * (20 + i), max_tokens=2)
                dep.wait_exact()
                for wid in dep.workers:
                    now = dep.cached_copies(wid)
                    assert dep.index.hashes(wid) == {g: set(hs) for g, hs in now.items()}, (wid, round_id, i)
                    assert dep.index.copies(wid) == now, (wid, round_id, i)
                    partial |= any(n >= 2 and 1 <= now.get(g, {}).get(h, 0) < n
                                   for g, hs in before[wid].items() for h, n in hs.items())
                    before[wid] = now
            if partial:
                break
        assert partial, "the run should remove one copy of a hash while another stays"
        dep.wait_all_free()


def test_a_worker_over_its_share_stays_degraded_until_a_snapshot_fits():
    # 16 entries for 2 workers: a share of 8; the long prompt leaves 12 or more blocks on each
    with KVDeployment(_config(), num_prefill=1, num_decode=1, kv_index_max_entries=16) as dep:
        _complete(dep, (SYSTEM[0] * 3)[:200], max_tokens=2)
        dep.wait_all_free()
        assert all(sum(map(len, dep.cached_copies(w).values())) > 8 for w in dep.workers)
        seen_degraded = set()
        for k in range(3):  # later batches, then idle for four polls: a replay must not make it EXACT
            _complete(dep, f"a later request {k} " + "y" * 20, max_tokens=2)
            dep.wait_all_free()
            deadline = time.monotonic() + 4 * dep.config.router.health_interval_s
            while time.monotonic() < deadline:
                for wid in dep.workers:
                    d = dep.index.describe(wid)
                    if d["state"] == "exact" and d["seq"] == dep.workers[wid].kv_events.seq:  # caught up, idle
                        assert dep.index.hashes(wid) == dep.cached_hashes(wid), (wid, d)
                    else:
                        seen_degraded.add(wid)
                time.sleep(0.05)
        assert seen_degraded == set(dep.workers)
        assert all(dep.index.describe(w)["state"] == "degraded" for w in dep.workers)
        assert all(dep.index.describe(w)["num_entries"] == 0 for w in dep.workers)  # nothing held past the share
        snapshots = _counter(dep, "pdkv_kv_index_resyncs_total", kind="snapshot")
        for worker in dep.workers.values():
            assert worker.reset_prefix_cache()
        _complete(dep, "short", max_tokens=2)  # publishes the clears: both caches fit again
        dep.wait_exact(timeout_s=TIMEOUT_S)
        assert _counter(dep, "pdkv_kv_index_resyncs_total", kind="snapshot") >= snapshots + 2
        for wid in dep.workers:
            assert dep.index.copies(wid) == dep.cached_copies(wid), wid
        dep.wait_all_free()


def test_index_is_each_workers_cache_or_degraded_after_a_mixed_workload():
    # 2P2D, 64 blocks per worker, a share of 40 entries each: busy workers overflow it
    with KVDeployment(_config(cache__kv_memory_mb=0.5), num_prefill=2, num_decode=2,
                      kv_index_max_entries=160) as dep:
        history = {t: s for t, s in enumerate(SYSTEM)}
        seen: collections.Counter = collections.Counter()
        for turn in range(3):
            for tenant in history:  # shared prefixes, multi-turn, evicting
                history[tenant] += f" user turn {turn}: what about item {tenant * 10 + turn}?"
                out = _complete(dep, history[tenant], temperature=1.0)
                history[tenant] += " " + out["choices"][0]["text"].encode("utf-8", "replace").decode("utf-8")
            with ThreadPoolExecutor(3) as pool:  # duplicates: greedy twins, and two client aborts
                twins = [pool.submit(_complete, dep, SYSTEM[turn] + " twins", 40) for _ in range(2)]
                aborts = [pool.submit(_abort_after_first_chunk, dep, SYSTEM[(turn + 1) % 3] + f" abort {i}")
                          for i in range(2)]
                for f in twins + aborts:
                    f.result()
            seen.update(_check_exact_or_degraded(dep).values())
            _complete(dep, (SYSTEM[turn] * 3)[:380] + f" long {turn}", max_tokens=2)  # over the share
            seen.update(_check_exact_or_degraded(dep).values())
        assert seen["degraded"] > 0, seen
        for wid, worker in dep.workers.items():  # every cache fits again: all EXACT, from snapshots
            assert worker.reset_prefix_cache()
            _own_cache(dep, wid)  # taken between steps, it publishes the clear of an idle worker
        for tenant in history:
            _complete(dep, history[tenant][-200:])
        dep.wait_exact(timeout_s=TIMEOUT_S)
        assert set(_check_exact_or_degraded(dep).values()) == {"exact"}
        assert _counter(dep, "pdkv_prefix_hit_mispredictions_total") == 0  # no route on a wrong entry
        dep.wait_all_free()
