"""KV transfers over an emulated slow link (`connectors.links.emulated_link`): two real engines with
real ZMQ connectors, P behind the link, and a whole local deployment configured from the deploy
config's `transfer.emulated_link`. A pull over the link takes about bytes / bandwidth (plus a
round trip) longer than over loopback, lands the same bytes (every page verified), is counted
per producer in D's transfer stats, and leaves every pool all free."""
from __future__ import annotations

import statistics

import pytest
import requests

from connectors.links.link_shape import LinkShape
from pd.cluster.config import ConfigError, DeployConfig
from rel_deploy import SECRET, LocalDeployment, local_config
from rel_pair import Pair, Side, prompt, reference

SLOW = LinkShape(bandwidth_mbps=20, latency_ms=5)
NUM_RUNS = 3  # the first pull of a pair handshakes: the peer's `recent` samples hold the others


def _warm_loads(link: LinkShape | None, tokens: list[int], want: list[int]) -> tuple[list, dict, dict]:
    """(recent (bytes, seconds) samples of D's loads from P, D's stats, P's stats) after NUM_RUNS
    requests whose tokens all matched the colocated reference."""
    p = Side("prefill-0", timeout_s=5.0, link=link)
    d = Side("decode-0", timeout_s=5.0, data_path="auto")  # auto: only a link-less P offers shared memory
    with Pair(p, d) as pair:
        for i in range(NUM_RUNS):
            out = pair.run(f"r{i}", tokens, n=4)
            assert out.error is None and out.tokens == want, f"run {i}: wrong tokens"
            pair.assert_all_free()  # (also empties D's prefix cache: the next run pulls every block again)
        assert pair.d.scheduler.stats.num_load_failures_recomputed == 0
        d_stats, p_stats = pair.d.connector.stats(), pair.p.connector.stats()
    assert not d_stats["failures"], d_stats["failures"]
    peer = d_stats["peers"]["prefill-0"]
    assert peer["num_loads"] == NUM_RUNS and peer["num_failed"] == 0
    assert len(peer["recent"]) == NUM_RUNS - 1  # the first load's seconds include the handshake
    return peer["recent"], d_stats, p_stats


def test_a_pull_over_a_slow_link_takes_bytes_over_bandwidth_longer_and_lands_the_same_bytes():
    tokens = prompt(640)  # 40 full blocks (320 KiB of KV): ~131 ms at 20 Mbit/s
    want = reference(tokens, 4)
    fast, _, fast_p = _warm_loads(None, tokens, want)
    slow, d_stats, p_stats = _warm_loads(SLOW, tokens, want)
    num_bytes = slow[0][0]
    assert num_bytes == fast[0][0] and num_bytes >= 40 * 8192
    assert "emulated_link" not in fast_p
    link = p_stats["emulated_link"]
    assert link["bytes_reverse"] >= NUM_RUNS * num_bytes  # every page crossed the link, P -> D
    assert link["bytes_forward"] > 0 and link["num_connections_accepted"] >= 2  # side channel + data streams
    extra_s = statistics.median(s for _, s in slow) - statistics.median(s for _, s in fast)
    # PULL out, pages back: one round trip on top of the bytes' own time on the link
    expected_s = num_bytes / SLOW.bytes_per_s + 2 * SLOW.latency_s
    # The rule is the floor: no pull over the link beats its bytes' time plus a round trip. The
    # difference of two medians also carries the loopback pulls' own noise: its ceiling is generous.
    assert all(s >= 0.9 * expected_s for _, s in slow), (expected_s, slow)
    assert extra_s < 1.5 * expected_s + 0.5, (extra_s, expected_s, fast, slow)
    assert d_stats["bytes_recv"] == NUM_RUNS * num_bytes


def test_the_deploy_config_puts_each_prefill_worker_behind_the_link_and_stats_show_it():
    """From `transfer.emulated_link` to the workers' /internal/stats: D counts the pulls per
    producer, P reports the link's bytes, and the pools end all free."""
    config = local_config(transfer__emulated_link={"bandwidth_mbps": 50, "latency_ms": 2})
    with LocalDeployment(config) as dep:
        body = {"prompt": "lorem ipsum dolor sit amet " * 8, "max_tokens": 4, "temperature": 0}
        first = requests.post(f"{dep.url}/v1/completions", json=body, timeout=30)
        second = requests.post(f"{dep.url}/v1/completions", json=body, timeout=30)
        assert first.status_code == second.status_code == 200, first.text
        assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]
        auth = {"Authorization": f"Bearer {SECRET}"}
        d_stats = requests.get(f"{dep.workers['decode-0'].url}/internal/stats", headers=auth, timeout=10).json()
        p_stats = requests.get(f"{dep.workers['prefill-0'].url}/internal/stats", headers=auth, timeout=10).json()
        dep.wait_all_free()
    (peer,) = d_stats["transfer"]["peers"].values()
    assert peer["num_loads"] >= 1 and peer["num_bytes"] > 0, peer
    assert all(b > 0 and s > 0 for b, s in peer["recent"]), peer
    link = p_stats["transfer"]["emulated_link"]
    assert (link["bandwidth_mbps"], link["latency_ms"]) == (50, 2)
    assert link["bytes_reverse"] >= peer["num_bytes"]
    assert "emulated_link" not in d_stats["transfer"]  # only producers put a link in front of themselves


@pytest.mark.parametrize("transfer, message", [
    ({"emulated_link": {"bandwidth_mbps": 0}}, "transfer.emulated_link.bandwidth_mbps: input should be greater"),
    ({"emulated_link": {"latency_ms": 5}}, "transfer.emulated_link.bandwidth_mbps: is required"),
    ({"emulated_link": {"bandwidth_mbps": 10, "jitter_ms": 1}},
     r"transfer.emulated_link: unknown key\(s\) \['jitter_ms'\]"),
    ({"emulated_link": {"bandwidth_mbps": 10}, "data_path": "shm"}, "transfer.data_path: must be 'auto' or 'tcp'"),
])
def test_a_bad_emulated_link_is_refused_naming_the_field(transfer, message):
    with pytest.raises(ConfigError, match=message):
        DeployConfig.from_dict({"transfer": transfer})


def test_no_emulated_link_by_default():
    assert DeployConfig().transfer.emulated_link is None
    assert DeployConfig().transfer.transfer_settings().emulated_link is None
    shaped = DeployConfig.from_dict({"transfer": {"emulated_link": {"bandwidth_mbps": 200, "latency_ms": 5}}})
    assert shaped.transfer.transfer_settings().emulated_link == LinkShape(bandwidth_mbps=200, latency_ms=5)
    assert DeployConfig.from_json(shaped.to_json()) == shaped
