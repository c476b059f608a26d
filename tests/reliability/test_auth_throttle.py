"""Failed authentications back off per client address (pd.router.auth_throttle), on the real
router over real HTTP: `burst` wrong keys in a row are 401, then every request from that
address that needs a key gets 429 with Retry-After, a right weak key included, until the
bucket drains (a strong key, such as the admin key, goes through); another address is not held
up; /metrics counts the failures and refusals."""
from __future__ import annotations

import asyncio
import re
import time

import aiohttp

from pd.cluster.admin_key import generate_admin_key
from pd.cluster.config import DeployConfig
from pd.cluster.router_config import AuthThrottleSection
from pd.router.auth_throttle import AuthThrottle
from pd.router.server import Router

ADMIN_KEY = generate_admin_key()
API_KEY = "throttle-test-api-key-" + "q" * 12


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_buckets_fill_drain_group_ipv6_by_64_and_stay_bounded():
    clock = _Clock()
    throttle = AuthThrottle(AuthThrottleSection(burst=3, per_s=2.0, max_addresses=16), clock)
    for _ in range(3):
        assert throttle.retry_after_s("10.0.0.1") is None
        throttle.record_failure("10.0.0.1")
    assert throttle.retry_after_s("10.0.0.1") == 1 and throttle.retry_after_s("10.0.0.2") is None
    clock.now += 0.49
    assert throttle.retry_after_s("10.0.0.1") == 1
    clock.now += 0.02  # one failure drained (per_s 2): room for exactly one more
    assert throttle.retry_after_s("10.0.0.1") is None
    throttle.record_failure("10.0.0.1")
    assert throttle.retry_after_s("10.0.0.1") == 1
    clock.now += 1.6  # drained to 0: forgotten
    assert throttle.retry_after_s("10.0.0.1") is None and len(throttle) == 0
    for host in ("2001:db8:1:2::1", "2001:db8:1:2:ffff::9", "2001:db8:1:2::7%eth0"):  # one /64
        throttle.record_failure(host)
    assert throttle.retry_after_s("2001:db8:1:2::abcd") == 1 and throttle.retry_after_s("2001:db8:1:3::1") is None
    throttle.record_failure("::ffff:10.0.0.9")  # an IPv4 client on a dual-stack socket counts as itself
    assert len(throttle) == 2
    for i in range(40):  # more addresses than the table holds: the least recently failed go first
        throttle.record_failure(f"192.0.2.{i}")
    assert len(throttle) == 16


async def _get(http: aiohttp.ClientSession, url: str, key: str | None) -> tuple[int, str | None]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with http.get(url, headers=headers) as resp:
        await resp.read()
        return resp.status, resp.headers.get("Retry-After")


def _counter(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


def test_wrong_keys_back_off_per_address_and_are_counted(fault_record):
    config = DeployConfig.from_dict({"router": {"port": 0, "api_key": API_KEY, "admin_key": ADMIN_KEY,
                                                "auth_throttle": {"burst": 4, "per_s": 2.0}}})

    async def scenario() -> dict:
        router = Router(config, [], "s" * 32)
        url = await router.start()
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
                first = [await _get(http, f"{url}/pd/workers", f"wrong-{i}") for i in range(4)]
                throttled = await _get(http, f"{url}/pd/workers", "wrong-5")
                strong_passes = await _get(http, f"{url}/pd/workers", ADMIN_KEY)  # a strong key: unguessable
                client_waits = await _get(http, f"{url}/v1/models", API_KEY)  # a right weak key waits
                open_path = await _get(http, f"{url}/health", None)  # /health takes none: no wait
                # another client address (all of 127/8 is loopback) is not held up by this one
                other = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
                async with aiohttp.ClientSession(connector=other) as elsewhere:
                    other_ok = await _get(elsewhere, f"{url}/pd/workers", ADMIN_KEY)
                await asyncio.sleep(int(throttled[1] or 0) + 0.05)  # as Retry-After said
                right_later = await _get(http, f"{url}/v1/models", API_KEY)
                # a guesser as fast as it can go, for about a second: burst, then per_s a second
                t0, answers = time.monotonic(), []
                while time.monotonic() - t0 < 1.0:
                    answers.append((await _get(http, f"{url}/v1/models", "guess"))[0])
                elapsed = time.monotonic() - t0
                await asyncio.sleep(2.1)
                metrics = await (await http.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}))\
                    .text()
        finally:
            await router.stop()
        return {"first": first, "throttled": throttled, "strong_passes": strong_passes, "client_waits": client_waits,
                "open": open_path, "other_ok": other_ok, "right_later": right_later, "answers": answers,
                "elapsed": elapsed, "metrics": metrics}

    got = asyncio.run(scenario())
    assert [s for s, _ in got["first"]] == [401] * 4, got["first"]
    assert got["throttled"] == (429, "1") and got["strong_passes"] == (200, None), got
    assert got["client_waits"][0] == 429 and got["open"][0] == 503  # /health: no worker, but no key asked
    assert got["other_ok"][0] == 200 and got["right_later"][0] == 200, got
    answers, elapsed = got["answers"], got["elapsed"]
    checked = answers.count(401)
    assert answers.count(429) + checked == len(answers) and len(answers) > 20, answers
    assert 1 <= checked <= 4 + 2.0 * elapsed, (checked, len(answers), elapsed)  # burst 4, then per_s 2
    metrics = got["metrics"]
    assert _counter(metrics, "pdkv_auth_failures_total", key="admin_key") == 4
    assert _counter(metrics, "pdkv_auth_failures_total", key="api_key") == checked
    assert _counter(metrics, "pdkv_auth_throttled_total") == 2 + len(answers) - checked
    assert re.search(r"^# TYPE pdkv_auth_failures_total counter$", metrics, re.M)
    fault_record(fault=f"{len(answers)} wrong keys in {elapsed:.1f}s from one address", where="router",
                 user_saw=f"{checked} x 401, {len(answers) - checked} x 429 with Retry-After; a right weak key 429 "
                          "while throttled, 200 after Retry-After and from another address; the strong admin key 200",
                 pdkv_did="per-address failure bucket (burst 4, 2/s); counted on /metrics", pools="-")
