"""Tenants apart, on real Ray actors (1P1D), the real router and real HTTP (issue 23, findings 4 and 5).

The probe of finding 4: a victim sends a memo holding a 4-digit code; an attacker sends the
memo with each candidate code and reads `usage.prompt_tokens_details.cached_tokens` (the right
guess hits one more block). With `prefix_cache_isolation: per_api_key` the attacker, holding
another API key, sees 0 cached tokens for every guess, the right one included, while clients
of the victim's own tenant still share its cache; `cache_salt` separates further within a
tenant; the router's KV index holds (and routes by) the salted hashes.

Finding 5: `/pd/*`, `/metrics` and `?refresh=1` take the admin key alone; on-demand refreshes
are paced and never count toward taking a worker out, even while a decode worker is frozen.
Every test ends with every pool all free.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest
import requests

from tests.helpers.e2e import HTTP_TIMEOUT_S, e2e_config, wait_all_free, worker_reports
from test_ray_recovery import worker_pid

from pd.cluster.admin_key import generate_admin_key
from pd.deploy.launch import Deployment

VICTIM_KEY = "victim-api-key-" + "v" * 20
ATTACKER_KEY = "attacker-api-key-" + "a" * 20
ADMIN_KEY = generate_admin_key()
MEMO = "Memo to the night shift from the site manager. The door code for the east wing is {code}. Memorise it."
CODE = "4821"
GUESSES = ["1234", "4820", CODE, "9999", "1284"]  # the first is wrong: it can only hit the victim's blocks


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def dep(ray_instance):
    config = e2e_config(router__api_keys={"victim": VICTIM_KEY, "attacker": ATTACKER_KEY},
                        router__admin_key=ADMIN_KEY, router__prefix_cache_isolation="per_api_key",
                        router__metrics_auth=True, router__health_interval_s=30.0,
                        # test_api_keys_cannot_reach_admin_endpoints fails 8 keys in a row on purpose
                        router__auth_throttle={"burst": 64})
    with Deployment(config) as deployment:
        yield deployment


def _complete(dep: Deployment, key: str, prompt: str, **body) -> dict:
    resp = requests.post(f"{dep.url}/v1/completions", headers=_auth(key), timeout=HTTP_TIMEOUT_S,
                         json={"prompt": prompt, "max_tokens": 2, "temperature": 0, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def _all_free(dep: Deployment) -> None:
    wait_all_free(dep.url, admin_key=ADMIN_KEY)


def test_another_api_key_never_reads_the_victims_cache(dep, fault_record):
    memo = MEMO.format(code=CODE)
    _complete(dep, VICTIM_KEY, memo)
    attacker = {guess: _cached(_complete(dep, ATTACKER_KEY, MEMO.format(code=guess))) for guess in GUESSES}
    # the same probe by a second client of the victim's tenant: the cache is shared there, so the
    # right guess stands out (the probe works; only the key keeps the attacker out)
    colleague = {guess: _cached(_complete(dep, VICTIM_KEY, MEMO.format(code=guess) + " ")) for guess in GUESSES}
    again = _cached(_complete(dep, VICTIM_KEY, memo))
    wrong = [attacker[g] for g in GUESSES[1:] if g != CODE]
    # not even the memo's opening blocks (before the code) hit; later guesses hit only the attacker's own
    # earlier guesses, and the right one no more than the wrong ones
    assert attacker[GUESSES[0]] == 0 and set(wrong) == {attacker[CODE]}, attacker
    assert again > 0 and colleague[CODE] > max(v for g, v in colleague.items() if g != CODE), colleague
    _all_free(dep)
    fault_record(fault="tenant probes another tenant's memo via cached_tokens (per_api_key)", where="router / P cache",
                 user_saw=f"attacker cached_tokens {list(attacker.values())} for {len(GUESSES)} guesses (right one "
                          f"{attacker[CODE]}); the victim's tenant: right {colleague[CODE]}, "
                          f"wrong {max(v for g, v in colleague.items() if g != CODE)}",
                 pdkv_did="salted the first block per tenant (HMAC of the secret and the tenant id)", pools="all free")


def test_cache_salt_shares_only_between_equal_salts(dep):
    prompt = "Quarterly report draft for the finance team, section seven, figures to be confirmed by Friday."
    first = _cached(_complete(dep, VICTIM_KEY, prompt, cache_salt="team-a"))
    same = _cached(_complete(dep, VICTIM_KEY, prompt, cache_salt="team-a"))
    other = _cached(_complete(dep, VICTIM_KEY, prompt, cache_salt="team-b"))
    unsalted = _cached(_complete(dep, VICTIM_KEY, prompt))
    across = _cached(_complete(dep, ATTACKER_KEY, prompt, cache_salt="team-a"))  # same salt, other tenant
    assert first == 0 and same > 0 and other == 0 and unsalted == 0 and across == 0, (first, same, other, unsalted)
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 2, "temperature": 0, "cache_salt": "c"}
    replies = [requests.post(f"{dep.url}/v1/chat/completions", headers=_auth(VICTIM_KEY), json=chat,
                             timeout=HTTP_TIMEOUT_S) for _ in range(2)]
    assert [r.status_code for r in replies] == [200, 200]
    assert _cached(replies[0].json()) == 0 and _cached(replies[1].json()) > 0
    for bad in ("", 7, ["x"], "x" * 1025):
        resp = requests.post(f"{dep.url}/v1/completions", headers=_auth(VICTIM_KEY), timeout=HTTP_TIMEOUT_S,
                             json={"prompt": prompt, "max_tokens": 2, "cache_salt": bad})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "cache_salt", resp.text
    _all_free(dep)


def test_kv_index_holds_and_routes_by_salted_hashes(dep):
    prompt = "Index probe: a prompt long enough for several blocks, so the router hashes it block by block."
    router = dep.router
    index = router.kv_index
    ids = router.tokenizer.encode(prompt)
    salt = router.tenancy.cache_salt("victim", None)
    assert salt is not None and salt != router.tenancy.cache_salt("attacker", None) and VICTIM_KEY not in salt
    salted, plain = index.prompt_hashes(ids, cache_salt=salt), index.prompt_hashes(ids)
    deadline = time.monotonic() + 30
    while (index.describe("prefill-0") or {}).get("state") != "exact":  # predictions need an exact entry
        assert time.monotonic() < deadline, index.describe("prefill-0")
        time.sleep(0.05)
    first = _complete(dep, VICTIM_KEY, prompt)
    while not set(salted) <= set().union(*index.hashes("prefill-0").values()):
        assert time.monotonic() < deadline, "the index never got the salted hashes"
        time.sleep(0.05)
    assert not set(plain) & set().union(*index.hashes("prefill-0").values())
    again = _complete(dep, VICTIM_KEY, prompt)
    other = _complete(dep, ATTACKER_KEY, prompt)
    predicted = {name: router.pool.last_predicted[(reply["id"] + "-0", "prefill")]
                 for name, reply in (("first", first), ("again", again), ("other", other))}
    assert predicted == {"first": 0, "again": _cached(again), "other": 0} and _cached(again) > 0, predicted
    assert _cached(other) == 0
    _all_free(dep)


def test_api_keys_cannot_reach_admin_endpoints(dep):
    for path in ("/pd/workers", "/pd/workers?refresh=1", "/pd/planner", "/metrics"):
        for key in (VICTIM_KEY, ATTACKER_KEY):
            resp = requests.get(dep.url + path, headers=_auth(key), timeout=HTTP_TIMEOUT_S)
            assert resp.status_code == 403 and resp.json()["error"]["code"] == "admin_key_required", (path, resp.text)
        assert requests.get(dep.url + path, timeout=HTTP_TIMEOUT_S).status_code == 401
        assert requests.get(dep.url + path, headers=_auth("nope"), timeout=HTTP_TIMEOUT_S).status_code == 401
        assert requests.get(dep.url + path, headers=_auth(ADMIN_KEY), timeout=HTTP_TIMEOUT_S).status_code == 200
    resp = requests.post(f"{dep.url}/v1/completions", headers=_auth(ADMIN_KEY), timeout=HTTP_TIMEOUT_S,
                         json={"prompt": "hi", "max_tokens": 2})
    assert resp.status_code == 401  # the admin key is no API key
    assert requests.get(dep.url + "/health", timeout=HTTP_TIMEOUT_S).status_code == 200
    _all_free(dep)


def test_refreshes_are_paced_and_shared(dep):
    starts, polls = [], []
    for _ in range(4):
        resp = requests.get(dep.url + "/pd/workers?refresh=1", headers=_auth(ADMIN_KEY), timeout=HTTP_TIMEOUT_S)
        assert resp.status_code == 200
        starts.append(float(resp.headers["X-PDKV-Poll-Started"]))
        polls.append(int(resp.headers["X-PDKV-Polls"]))
    interval = dep.config.router.refresh_min_interval_s - 1e-5  # the header rounds to the microsecond
    assert interval > 0.99 and polls == list(range(polls[0], polls[0] + 4))  # one poll each, one at a time
    assert all(b - a >= interval for a, b in zip(starts, starts[1:], strict=False)), starts
    t0 = time.monotonic()
    answers = _concurrent_refreshes(dep, 6)
    elapsed = time.monotonic() - t0
    assert all(status == 200 for status, _, _, _ in answers), answers
    shared = sorted({start for _, _, start, _ in answers})  # concurrent calls share polls, still paced
    assert all(b - a >= interval for a, b in zip(shared, shared[1:], strict=False)), shared
    assert max(n for _, n, _, _ in answers) - polls[-1] == len(shared) <= elapsed / interval + 1, (answers, elapsed)
    _all_free(dep)


def _concurrent_refreshes(dep: Deployment, n: int) -> list[tuple[int, int, float, bool]]:
    """(status, polls so far, its poll's start, every worker healthy) of `n` concurrent refreshes."""
    out: list[tuple[int, int, float, bool]] = []

    def one() -> None:
        resp = requests.get(dep.url + "/pd/workers?refresh=1", headers=_auth(ADMIN_KEY), timeout=HTTP_TIMEOUT_S)
        healthy = resp.status_code == 200 and all(w["healthy"] for w in resp.json().values())
        out.append((resp.status_code, int(resp.headers.get("X-PDKV-Polls", -1)),
                    float(resp.headers.get("X-PDKV-Poll-Started", "nan")), healthy))

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HTTP_TIMEOUT_S * 2)
    assert len(out) == n, out
    return out


def test_frozen_decode_worker_under_refreshes_stays_in(dep, caplog, fault_record):
    victim = "decode-0"
    pid = worker_pid(dep, victim)
    caplog.set_level(logging.WARNING, logger="pd.router.server")
    os.kill(pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        answers = _concurrent_refreshes(dep, 3)  # each poll's probe of the frozen worker times out (probe 2 s)
        time.sleep(max(0.0, 2.6 - (time.monotonic() - frozen_at)))
        frozen_s = time.monotonic() - frozen_at
    finally:
        os.kill(pid, signal.SIGCONT)
    assert [a[0] for a in answers] == [200] * 3 and all(a[3] for a in answers), answers
    missed = [r for r in caplog.records if "on-demand poll: worker decode-0 did not answer" in r.getMessage()]
    assert missed, "the refreshes never saw the frozen worker fail: the test proved nothing"
    assert dep.router.pool.get(victim).healthy
    reports = worker_reports(dep.url, ADMIN_KEY)
    assert all(r["healthy"] for r in reports.values()), reports
    _all_free(dep)
    fault_record(fault=f"D frozen {frozen_s:.1f}s (SIGSTOP) under 3 concurrent ?refresh=1", where="D worker / router",
                 user_saw="every refresh 200, D healthy throughout",
                 pdkv_did=f"{len(missed)} failed on-demand probes, none counted toward max_failed_polls",
                 pools="all free")
