"""The online KV audit through a real 1P1D deployment on a local Ray instance (HTTP, ZMQ, the router's
`/metrics`), at `transfer.kv_audit_rate: 1`: a clean deployment flags nothing; one whose prefill worker
runs the fault plan `engine.perturb_kv:corrupt:times=all` (well-formed wrong KV, checksums intact) has
every audited request flagged, while the requests themselves still succeed. Pools end all free."""
from __future__ import annotations

import re

import pytest
import requests

from pd.deploy.launch import Deployment
from tests.helpers.e2e import HTTP_TIMEOUT_S, complete, e2e_config, wait_all_free, worker_reports

# Distinct openings (no prefix hits on D), each 100+ byte tokens: several full blocks of 16 to pull
PROMPTS = [f"{i}: " + "the audit recomputes the last block that was pulled; " * 2 for i in range(5)]



def _decode_stats(url: str) -> dict:
    return next(r["stats"] for r in worker_reports(url).values() if r["role"] == "decode")


def _run(url: str) -> dict:
    for prompt in PROMPTS:
        assert complete(url, prompt, ignore_eos=True)["choices"][0]["token_ids"]
    wait_all_free(url)
    return _decode_stats(url)


def _metric(url: str, name: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=HTTP_TIMEOUT_S).text
    return sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*role=\"decode\"[^}}]*}} (\S+)$", text, re.MULTILINE))


@pytest.mark.parametrize("perturb", [False, True], ids=["clean", "perturbed"])
def test_audit_flags_exactly_the_wrong_kv(ray_instance, perturb):
    faults = {"faults__prefill": "engine.perturb_kv:corrupt:times=all"} if perturb else {}
    with Deployment(e2e_config("local.yaml", transfer__kv_audit_rate=1.0, **faults)) as dep:
        stats = _run(dep.url)
        assert stats["kv_audit_checked"] == len(PROMPTS), stats
        assert stats["kv_audit_mismatched"] == (len(PROMPTS) if perturb else 0), stats
        assert stats["transfer"].get("failures_total", 0) == 0  # the checksums pass either way
        assert _metric(dep.url, "pdkv_kv_audit_checked_total") == len(PROMPTS)
        assert _metric(dep.url, "pdkv_kv_audit_mismatched_total") == stats["kv_audit_mismatched"]
