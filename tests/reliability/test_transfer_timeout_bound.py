"""`transfer.timeout_s` has a lower bound (issue 49, finding 7): below it a pull's handshake cannot
finish, so D can neither pull nor tell P it gave up, and P's blocks wait out the whole lease (the
run-load audit then says "NOT all free"). The config refuses such a value by name; at the bound,
a 1P1D run's pulls succeed and P's blocks are free long before a lease could expire."""
from __future__ import annotations

import pytest
import requests

from pd.cluster.config import ConfigError, DeployConfig
from rel_deploy import LocalDeployment, local_config

LEASE_S = 30.0
MIN_TRANSFER_TIMEOUT_S = 1.0  # pd.cluster.config.MIN_TRANSFER_TIMEOUT_S, as docs/reliability-and-security.md says


@pytest.mark.parametrize("timeout_s", [0.001, 0.05, MIN_TRANSFER_TIMEOUT_S * 0.99])
def test_near_zero_transfer_timeout_is_refused_by_name(timeout_s):
    with pytest.raises(ConfigError, match=r"transfer\.timeout_s.*greater than or equal to 1"):
        DeployConfig.from_dict({"transfer": {"timeout_s": timeout_s}})


def test_at_the_bound_pulls_succeed_and_leases_end_without_expiry():
    config = local_config(transfer__timeout_s=MIN_TRANSFER_TIMEOUT_S, transfer__lease_s=LEASE_S)
    with LocalDeployment(config) as dep:
        for i in range(4):
            resp = requests.post(f"{dep.url}/v1/completions", timeout=30,
                                 json={"prompt": f"request {i} " + "lorem ipsum " * 20, "max_tokens": 4,
                                       "temperature": 0, "ignore_eos": True})
            assert resp.status_code == 200, resp.text
        freed_s = dep.wait_all_free(timeout_s=LEASE_S / 2)  # the run-load audit's wait is 15 s
        transfer = dep.stats("prefill-0")["transfer"]
    assert freed_s < LEASE_S / 2
    assert transfer["leases_ended"].get("expired", 0) == 0, transfer["leases_ended"]
    assert transfer["leases_ended"].get("done", 0) >= 4, transfer["leases_ended"]
