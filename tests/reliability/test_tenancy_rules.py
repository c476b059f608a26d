"""The rules behind tenant isolation and admin endpoints (issue 23, findings 4 and 5), each
checked on the real thing: config validation, the refresh limiter on a real event loop, the
router's on-demand polls against a real (refusing) worker address, and shared-mode
`cache_salt` / `report_cached_tokens` on in-process workers and router over real HTTP.
"""
from __future__ import annotations

import asyncio
import socket

import openai
import pytest
import requests

from pd.cluster.admin_key import generate_admin_key
from pd.cluster.config import ConfigError, DeployConfig
from pd.cluster.roles import Role, WorkerEndpoint
from pd.router.refresh import RefreshBusy, RefreshLimiter
from pd.router.server import Router
from pd.router.tenancy import Tenancy
from rel_deploy import LocalDeployment, local_config

TIMEOUT_S = 30
STRONG = generate_admin_key()


@pytest.mark.parametrize(("router", "blamed"), [
    ({"api_keys": {"a": "k" * 20, "b": "k" * 20}}, "router.api_keys: two tenants share one API key"),
    ({"api_key": STRONG, "admin_key": STRONG}, "router.admin_key: must differ from every API key"),
    ({"prefix_cache_isolation": "per_api_key"}, "router.prefix_cache_isolation: per_api_key needs"),
    ({"api_keys": {"has space": "k" * 20}}, "router.api_keys.has space"),
    ({"api_key": "k" * 20, "api_keys": {"default": "j" * 20}}, "router.api_keys: tenant id 'default'"),
    ({"admin_key": ""}, "router.admin_key"),
    ({"refresh_min_interval_s": -1}, "router.refresh_min_interval_s"),
])
def test_bad_tenancy_configs_are_refused_by_name(router, blamed):
    with pytest.raises(ConfigError, match=blamed.replace(".", r"\.")):
        DeployConfig.from_dict({"router": router})


def test_isolation_and_metrics_auth_default_to_the_safe_choice_for_the_keys_set():
    def router(**fields):
        return DeployConfig.from_dict({"router": fields}).router

    two = {"a": "a-key-" + "x" * 20, "b": "b-key-" + "y" * 20}
    assert router(api_keys=two).cache_isolation == "per_api_key"  # two tenants, nothing said: apart
    assert router(api_keys=two).prefix_cache_isolation is None  # unset stays told apart from an explicit shared
    assert router(api_keys=two, prefix_cache_isolation="shared").cache_isolation == "shared"
    assert router(api_key="k" * 20, api_keys={"b": "b" * 20}).cache_isolation == "per_api_key"
    assert router(api_key="k" * 20).cache_isolation == "shared" and router().cache_isolation == "shared"
    # the default follows keys added later (DeployConfig.replace validates the whole section again)
    assert DeployConfig.from_dict({}).replace(router__api_keys=two).router.cache_isolation == "per_api_key"
    assert Tenancy(router(api_keys=two), "s" * 32).per_api_key
    assert not Tenancy(router(api_keys=two, prefix_cache_isolation="shared"), "s" * 32).per_api_key
    assert router(api_key="k" * 20).metrics_protected and not router().metrics_protected
    assert not router(api_key="k" * 20, metrics_auth=False).metrics_protected
    assert router(metrics_auth=True).metrics_protected
    assert router().report_route is False


def test_tenant_salts_are_derived_per_tenant_and_never_hold_the_key():
    section = DeployConfig.from_dict({"router": {"api_key": "first-key-" + "x" * 10, "api_keys": {"bob": "b" * 20},
                                                 "prefix_cache_isolation": "per_api_key"}}).router
    assert section.tenant_keys() == {"default": "first-key-" + "x" * 10, "bob": "b" * 20}
    tenancy, other_secret = Tenancy(section, "s" * 32), Tenancy(section, "t" * 32)
    salts = {tenancy.cache_salt(t, c) for t in ("default", "bob") for c in (None, "x", "y")}
    assert len(salts) == 6 and not any("b" * 20 in s or "first-key" in s for s in salts)
    assert tenancy.cache_salt("bob", "x") == tenancy.cache_salt("bob", "x") != other_secret.cache_salt("bob", "x")
    shared = Tenancy(DeployConfig.from_dict({"router": {"api_key": "k" * 20}}).router, "s" * 32)
    assert shared.cache_salt("default", "x") == "x" and shared.cache_salt("default", None) is None  # vLLM's


def test_refresh_limiter_shares_paces_and_bounds():
    async def scenario() -> None:
        release, starts = asyncio.Event(), []
        loop = asyncio.get_running_loop()

        async def poll() -> None:
            starts.append(loop.time())
            await release.wait()

        limiter = RefreshLimiter(poll, min_interval_s=0.3, max_waiting=4, clock=loop.time)
        first = asyncio.create_task(limiter.refresh())
        await asyncio.sleep(0.05)
        assert len(starts) == 1
        # arrived mid-poll: that poll may predate their request, so they share the next one
        late = [asyncio.create_task(limiter.refresh()) for _ in range(3)]
        await asyncio.sleep(0.05)
        with pytest.raises(RefreshBusy) as busy:
            await limiter.refresh()  # a fifth caller while four wait
        assert busy.value.retry_after_s == 1 and len(starts) == 1
        late[2].cancel()  # a caller that leaves cancels nothing the others wait on
        release.set()
        first_started, shared = await first, {await late[0], await late[1]}
        assert len(shared) == 1 and shared.pop() - first_started >= 0.3 and starts[1] - starts[0] >= 0.3
        assert limiter.num_polls == len(starts) == 2 and limiter.num_waiting == 0

    asyncio.run(scenario())


def test_on_demand_polls_never_take_a_worker_out():
    with socket.socket() as s:  # a port nothing listens on: every probe is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def scenario() -> tuple[bool, bool]:
        router = Router(local_config(), [WorkerEndpoint("decode-0", Role.DECODE, f"http://127.0.0.1:{port}")],
                        "s" * 32)
        await router.client.open()
        try:
            for _ in range(5):
                await router.poll_workers(audit=True, readmit=False, on_demand=True)
            kept = router.pool.get("decode-0").healthy
            for _ in range(router.recovery.max_failed_polls):
                await router.poll_workers()
            return kept, router.pool.get("decode-0").healthy
        finally:
            await router.client.close()

    assert asyncio.run(scenario()) == (True, False)  # 5 failed refreshes: still in; the paced polls: out


def _complete(url: str, prompt: str, **body) -> dict:
    resp = requests.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0, **body},
                         timeout=TIMEOUT_S)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_shared_mode_cache_salt_has_vllm_semantics():
    prompt = "Shared mode: a prompt of a few blocks that two clients send with and without salts, twice."
    with LocalDeployment(local_config("colocated")) as dep:
        cached = [_complete(dep.url, prompt, **extra)["usage"]["prompt_tokens_details"]["cached_tokens"]
                  for extra in ({"cache_salt": "s1"}, {"cache_salt": "s1"}, {"cache_salt": "s2"}, {}, {})]
        assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0 and cached[3] == 0 and cached[4] > 0, cached
        dep.wait_all_free()


def test_report_cached_tokens_off_leaves_usage_without_them():
    prompt = "Usage without cached tokens: the same prompt twice, the second served from the prefix cache."
    with LocalDeployment(local_config("colocated", router__report_cached_tokens=False)) as dep:
        for _ in range(2):
            usage = _complete(dep.url, prompt)["usage"]
            assert "prompt_tokens_details" not in usage and usage["prompt_tokens"] > 0, usage
        with requests.post(f"{dep.url}/v1/completions", stream=True, timeout=TIMEOUT_S,
                           json={"prompt": prompt, "max_tokens": 2, "stream": True,
                                 "stream_options": {"include_usage": True}}) as resp:
            lines = [line for line in resp.iter_lines() if line.startswith(b"data: {")]
        assert b'"usage": {' in lines[-1] or b'"usage":{' in lines[-1], lines[-1]
        assert b"prompt_tokens_details" not in b"".join(lines) and b"cached_tokens" not in b"".join(lines)
        client = openai.OpenAI(base_url=f"{dep.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)
        reply = client.chat.completions.create(model="pdkv-tiny", messages=[{"role": "user", "content": prompt}],
                                               max_tokens=2)
        assert reply.usage.prompt_tokens > 0 and reply.usage.prompt_tokens_details is None
        assert _flat(dep.stats("both-0")).get("prefix_cache_hits", 0) > 0  # there were hits to leave out
        dep.wait_all_free()


def _flat(stats: dict) -> dict:
    """The worker's stats with nested sections merged into one level."""
    out: dict = {}
    for key, value in stats.items():
        out.update(_flat(value) if isinstance(value, dict) else {key: value})
    return out
