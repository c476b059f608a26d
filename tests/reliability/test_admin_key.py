"""`router.admin_key` must be strong: at least 32 characters and 128 bits of estimated entropy
(pd.cluster.admin_key). Weak keys, the ones the tests and examples used before included, are
refused at config validation with a message that names the field and how to make a key, and
never echoes the key; generated keys are always accepted."""
from __future__ import annotations

import secrets

import pytest

from pd.cluster.admin_key import MIN_ENTROPY_BITS, estimated_entropy_bits, generate_admin_key
from pd.cluster.config import ConfigError, DeployConfig

WEAK = [
    "change-me-admin",  # deploy/gpu-2p4d.yaml's example
    "a" * 20,
    "admin-key-" + "z" * 24,  # 34 characters, one of them 24 times
    "loadgen-admin-key-" + "a" * 16,
    "Password123!Password123!Password123!",  # long, three words' worth of choice
    "abcdefghijklmnopqrstuvwxyz0123456789ABC",  # every character differs, yet a keyboard walk
    "ab" * 20,
    "x7Qp2Lm9",  # random but short
]


@pytest.mark.parametrize("key", WEAK)
def test_weak_admin_keys_are_refused_with_how_to_make_one(key):
    with pytest.raises(ConfigError) as refused:
        DeployConfig.from_dict({"router": {"admin_key": key}})
    message = str(refused.value)
    assert message.startswith("router.admin_key: too weak") and "32 characters and 128 bits" in message, message
    assert "python -m pd.launch --generate-admin-key" in message and key not in message


def test_generated_and_random_keys_pass_and_patterns_score_low():
    keys = {generate_admin_key() for _ in range(200)}
    assert len(keys) == 200 and all(len(k) >= 43 for k in keys)
    for key in list(keys)[:20]:
        assert DeployConfig.from_dict({"router": {"admin_key": key}}).router.admin_key == key
    assert min(estimated_entropy_bits(k) for k in keys) >= 1.5 * MIN_ENTROPY_BITS
    assert all(estimated_entropy_bits(secrets.token_hex(32)) >= 1.5 * MIN_ENTROPY_BITS for _ in range(200))
    # the estimate never credits a key with more than its true draw: 16 random bytes as hex are 128 bits
    assert max(estimated_entropy_bits(secrets.token_hex(16)) for _ in range(200)) <= 128.0
    assert estimated_entropy_bits("z" * 64) == 0.0 and estimated_entropy_bits("") == 0.0
    assert estimated_entropy_bits("0123456789" * 4) < 64  # runs count their first four characters only
