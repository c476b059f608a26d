"""Tenants apart by default: a router with two API keys and nothing said about isolation
(real workers, real router, real HTTP; pd.router.tenancy, pd.cluster.router_config).

The probe: tenant A sends a memo holding a 4-digit door code; tenant B sends the memo with each
candidate code and reads everything a client can: every field of the response (cached_tokens,
the `pdkv_timing` extension it asks for, the streamed chunks), the headers, the worker's
measured prefill time, and `/metrics` and `/pd/workers`. B's view must not depend on A's
secret: B probes the same candidates twice, once before A sends anything (in a cache partition
of B's own, `cache_salt`) and once after, and both views are equal field by field; B's right
guess computes as long as the wrong ones. A second client of A's own tenant runs the same probe
and the right code stands out at once (cached tokens and prefill time): the probe has the power
to find the secret; only the isolation keeps B from it.
"""
from __future__ import annotations

import json
import statistics

import requests

from pd.cluster.admin_key import generate_admin_key
from rel_deploy import LocalDeployment, local_config

ALICE_KEY = "alice-api-key-" + "a" * 20
BOB_KEY = "bob-api-key-" + "b" * 20
ADMIN_KEY = generate_admin_key()
CODE = "4821"
GUESSES = ["1234", "4820", CODE, "9999", "1284", "7305"]  # the first: nothing of B's own cached yet
_CHECKS = " ".join(f"Round {i}: the fire doors, the alarm panel, the loading bay shutters and the roof hatch."
                   for i in range(10))
MEMO = "Memo to the night shift. The door code for the east wing is {code}. Then: " + _CHECKS
TIMEOUT_S = 60


def _config():
    # two API keys and an admin key; isolation, metrics_auth and report_route left at their defaults
    return local_config(router__api_keys={"alice": ALICE_KEY, "bob": BOB_KEY}, router__admin_key=ADMIN_KEY,
                        scheduler__max_model_len=1024, cache__kv_memory_mb=16)


def _probe(url: str, key: str, prompt: str, **extra) -> tuple[dict, float | None]:
    """What the client saw (ids, creation times and timing values left out) and P's prefill time."""
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
    resp = requests.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S,
                         headers={"Authorization": f"Bearer {key}", "x-pdkv-timing": "1"})
    assert resp.status_code == 200, resp.text
    seen = resp.json()
    timing = seen.pop("pdkv_timing")
    del seen["id"], seen["created"]
    seen["timing_stages"] = sorted(timing["stages"])
    seen["timing_cached"] = timing.get("num_cached_tokens")
    seen["headers"] = sorted(h.lower() for h in resp.headers if h.lower() not in ("date", "content-length"))
    return seen, timing["stages"].get("prefill_compute_s")


def _streamed(url: str, key: str, prompt: str, **extra) -> list:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    events = []
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=TIMEOUT_S,
                       headers={"Authorization": f"Bearer {key}", "x-pdkv-timing": "1"}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                event.pop("id"), event.pop("created")
                if "pdkv_timing" in event:
                    event["pdkv_timing"]["stages"] = sorted(event["pdkv_timing"]["stages"])
                    event["pdkv_timing"].pop("ttft_s")
                events.append(event)
    return events


def _cached(seen: dict) -> int:
    return seen["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_second_tenant_cannot_confirm_the_first_tenants_secret(fault_record):
    with LocalDeployment(_config()) as dep:
        url = dep.url
        before = [_probe(url, BOB_KEY, MEMO.format(code=g), cache_salt="bob-before") for g in GUESSES]
        stream_before = _streamed(url, BOB_KEY, MEMO.format(code=CODE), cache_salt="bob-before")
        _probe(url, ALICE_KEY, MEMO.format(code=CODE))  # the secret goes in
        after = [_probe(url, BOB_KEY, MEMO.format(code=g)) for g in GUESSES]
        stream_after = _streamed(url, BOB_KEY, MEMO.format(code=CODE))
        # the same probe from a second client of A's own tenant: A's cache is its to share
        colleague = [_probe(url, ALICE_KEY, MEMO.format(code=g) + " ") for g in GUESSES]
        scrapes = {(path, who): requests.get(url + path, headers=auth, timeout=TIMEOUT_S).status_code
                   for path in ("/metrics", "/pd/workers")
                   for who, auth in (("none", {}), ("bob", {"Authorization": f"Bearer {BOB_KEY}"}))}
        admin = requests.get(url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=TIMEOUT_S)
        dep.wait_all_free()

    right = GUESSES.index(CODE)
    # every field B can read is the same whether A's secret is in the cache or not
    for guess, (then, _), (now, _) in zip(GUESSES, before, after, strict=True):
        assert then == now, (guess, then, now)
    assert stream_before == stream_after, (stream_before, stream_after)
    assert not any("pdkv_route" in json.dumps(seen) for seen, _ in after)  # opt-in (router.report_route)
    assert not any("pdkv_route" in json.dumps(event) for event in stream_after)
    # timing: B's right guess computes as long as its wrong ones (all but the first share B's own prefix)
    bob_wrong = statistics.median(t for i, (_, t) in enumerate(after) if i not in (0, right))
    assert after[right][1] >= 0.5 * bob_wrong, [t for _, t in after]
    # /metrics (per-worker prefix-cache hits) and /pd/workers: admin only once API keys exist
    assert scrapes == {("/metrics", "none"): 401, ("/metrics", "bob"): 403,
                       ("/pd/workers", "none"): 401, ("/pd/workers", "bob"): 403}, scrapes
    assert admin.status_code == 200 and "pdkv_worker_prefix_cache_hits" in admin.text
    # the probe's power: within A's tenant the right code stands out in cached tokens and in time
    col_cached = [_cached(seen) for seen, _ in colleague]
    col_fastest_wrong = min(t for i, (_, t) in enumerate(colleague) if i != right)
    assert col_cached[right] > max(c for i, c in enumerate(col_cached) if i != right) + 160, col_cached
    # (the fastest of the six, not a fixed fraction of the others: the fraction depends on how fast the
    # engine computes the uncached part against the fixed cost of a request, which is this CPU's speed)
    assert colleague[right][1] < col_fastest_wrong, [t for _, t in colleague]
    fault_record(fault="tenant B probes tenant A's 4-digit code (2 API keys, isolation unset)",
                 where="router / P cache / metrics",
                 user_saw=f"B: cached_tokens {[_cached(s) for s, _ in after]} (same without A's secret), "
                          f"prefill right {after[right][1] * 1e3:.1f} ms vs wrong median {bob_wrong * 1e3:.1f} ms, "
                          f"/metrics 401/403; A's colleague: cached {col_cached}, prefill right "
                          f"{colleague[right][1] * 1e3:.1f} ms vs fastest wrong {col_fastest_wrong * 1e3:.1f} ms",
                 pdkv_did="per_api_key by default with two keys; metrics_auth on with keys; pdkv_route opt-in",
                 pools="all free")


def test_report_route_brings_pdkv_route_back():
    with LocalDeployment(local_config("colocated", router__report_route=True)) as dep:
        resp = requests.post(f"{dep.url}/v1/completions", timeout=TIMEOUT_S,
                             json={"prompt": "where did this go?", "max_tokens": 2, "temperature": 0})
        assert resp.status_code == 200 and resp.json()["choices"][0]["pdkv_route"]["decision"] == "colocated"
        events = _streamed(dep.url, "unused", "where did this go, streamed?")
        routes = [c["pdkv_route"] for e in events for c in e["choices"] if "pdkv_route" in c]
        assert len(routes) == 1 and routes[0]["ttft_s"] > 0, events
        dep.wait_all_free()
