"""One key guesser must not lock out the clients that share its address (issue 49, finding 1), on
the real router over real HTTP:

- behind a proxy named in `router.trusted_proxies`, each client is throttled on its own forwarded
  address (rightmost untrusted X-Forwarded-For hop): a right-key client keeps >= 19 of 20 requests
  while another client behind the same proxy guesses keys at 20 a second, and the guesser stays
  held to `burst` + `per_s` checked guesses a second, whatever hops it writes itself;
- a peer that is not a trusted proxy has its headers ignored; a malformed header from the proxy
  counts on the proxy's own address;
- without a proxy, on one shared address, a strong key still goes through while the address is
  throttled and a weak key waits (the trade-off in docs/reliability-and-security.md)."""
from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from pd.cluster.admin_key import generate_admin_key
from pd.cluster.config import DeployConfig
from pd.router.server import Router

WEAK_KEY = "trusted-proxy-test-key-" + "w" * 12  # far under 128 estimated bits
STRONG_KEY = generate_admin_key()
GUESS_RATE_HZ = 20.0
BURST, PER_S = 5, 1.0


async def _get(http: aiohttp.ClientSession, url: str, key: str, forwarded: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"}
    if forwarded is not None:
        headers["X-Forwarded-For"] = forwarded
    async with http.get(f"{url}/v1/models", headers=headers) as resp:
        await resp.read()
        return resp.status


async def _guesser_and_client(http: aiohttp.ClientSession, url: str, guess_via, right_key: str, right_via
                              ) -> tuple[list[int], list[int], float]:
    """A guesser at GUESS_RATE_HZ for the whole run and, once its burst is spent, a right-key client
    sending 20 requests at the same pace. `*_via(i)`: the X-Forwarded-For of request i (None: none)."""
    stop = asyncio.Event()
    guesses: list[int] = []

    async def guess() -> None:
        i = 0
        while not stop.is_set():
            guesses.append(await _get(http, url, f"guess-{i}", guess_via(i)))
            i += 1
            await asyncio.sleep(1.0 / GUESS_RATE_HZ)

    t0 = time.monotonic()
    guesser = asyncio.create_task(guess())
    await asyncio.sleep((BURST + 1) / GUESS_RATE_HZ + 0.1)  # the guesser's address is throttled by now
    rights = []
    for _ in range(20):
        rights.append(await _get(http, url, right_key, right_via))
        await asyncio.sleep(1.0 / GUESS_RATE_HZ)
    stop.set()
    await guesser
    return guesses, rights, time.monotonic() - t0


def _router(**router) -> Router:
    section = {"port": 0, "auth_throttle": {"burst": BURST, "per_s": PER_S}} | router
    return Router(DeployConfig.from_dict({"router": section}), [], "s" * 32)


def test_right_key_behind_a_trusted_proxy_keeps_going_while_a_neighbour_guesses(caplog, fault_record):
    caplog.set_level(logging.WARNING, logger="pd.router.tenancy")

    async def scenario() -> dict:
        router = _router(api_key=WEAK_KEY, trusted_proxies=["127.0.0.1/32"])  # this test's client is "the proxy"
        url = await router.start()
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
                # the guesser writes a fresh hop of its own each time; the proxy appends its real address
                guesses, rights, elapsed = await _guesser_and_client(
                    http, url, lambda i: f"10.66.{i % 250}.{i // 250}, 203.0.113.66", WEAK_KEY, "198.51.100.20")
                # a peer that is not a trusted proxy (all of 127/8 is loopback) claims the right client's
                # address: ignored, its failures count on itself
                other = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
                async with aiohttp.ClientSession(connector=other) as spoofer:
                    spoofed = [await _get(spoofer, url, "wrong", "198.51.100.20") for _ in range(BURST + 2)]
                right_after_spoof = await _get(http, url, WEAK_KEY, "198.51.100.20")
                # a malformed header from the proxy: the proxy's own address takes the failures
                malformed = [await _get(http, url, "wrong", "garbage") for _ in range(BURST + 2)]
                malformed_right = await _get(http, url, WEAK_KEY, "garbage")
                no_header_right = await _get(http, url, WEAK_KEY)  # the proxy itself: its own (throttled) address
                still_right = await _get(http, url, WEAK_KEY, "198.51.100.20")
        finally:
            await router.stop()
        return {"guesses": guesses, "rights": rights, "elapsed": elapsed, "spoofed": spoofed,
                "right_after_spoof": right_after_spoof, "malformed": malformed, "malformed_right": malformed_right,
                "no_header_right": no_header_right, "still_right": still_right}

    got = asyncio.run(scenario())
    rights, guesses, elapsed = got["rights"], got["guesses"], got["elapsed"]
    assert rights.count(200) >= 19, rights
    assert len(guesses) >= 20 and set(guesses) <= {401, 429}, guesses  # ~20 a second for over a second
    checked = guesses.count(401)
    assert BURST <= checked <= BURST + PER_S * elapsed + 1, (checked, elapsed, guesses)
    assert got["spoofed"][:BURST] == [401] * BURST and got["spoofed"][BURST:] == [429, 429], got["spoofed"]
    assert got["right_after_spoof"] == 200 and got["still_right"] == 200, got
    assert got["malformed"][BURST:] == [429, 429] and got["malformed_right"] == 429, got
    assert got["no_header_right"] == 429, got  # the same bucket as the malformed header's: the proxy's
    logged = [r.getMessage() for r in caplog.records]
    assert any("203.0.113.66 (via proxy 127.0.0.1)" in line for line in logged), logged
    assert not any("198.51.100.20" in line for line in logged), logged
    fault_record(fault=f"{len(guesses)} wrong keys at {GUESS_RATE_HZ:.0f}/s from one client behind a trusted proxy",
                 where="router auth throttle",
                 user_saw=f"a right-key client behind the same proxy: {rights.count(200)}/20 served; the guesser "
                          f"{checked} x 401 then 429",
                 pdkv_did="throttled the guesser's forwarded address (rightmost untrusted X-Forwarded-For hop)",
                 pools="-")


def test_strong_key_passes_a_throttled_shared_address_and_a_weak_key_waits():
    async def scenario() -> dict:
        router = _router(api_keys={"strong": STRONG_KEY, "weak": WEAK_KEY})  # no proxy: one shared address
        url = await router.start()
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
                guesses, rights, elapsed = await _guesser_and_client(http, url, lambda i: None, STRONG_KEY, None)
                weak = await _get(http, url, WEAK_KEY)
                forged = await _get(http, url, WEAK_KEY, "198.51.100.20")  # no trusted proxy: the header is ignored
        finally:
            await router.stop()
        return {"guesses": guesses, "rights": rights, "elapsed": elapsed, "weak": weak, "forged": forged}

    got = asyncio.run(scenario())
    assert got["rights"] == [200] * 20, got["rights"]
    checked = got["guesses"].count(401)
    assert BURST <= checked <= BURST + PER_S * got["elapsed"] + 1, got  # still held to burst + per_s
    assert got["weak"] == 429 and got["forged"] == 429, got
