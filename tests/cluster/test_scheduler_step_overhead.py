"""`scheduler.step_overhead_tokens` from the deploy YAML to the engine: bounded, off by default, set by the
SmolLM2 deploys, and handed to `EngineConfig` by the worker's wiring."""
import pytest

from pd.cluster.config import ConfigError, DeployConfig, load_deploy_config
from pd.cluster.roles import Role
from pd.worker.wiring import engine_config_for
from pd.worker.worker import WorkerSpec

ARCH = {"vocab_size": 260, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4,
        "num_kv_heads": 2}


def test_default_off_bounds_and_wiring():
    assert DeployConfig().scheduler.step_overhead_tokens == 0
    for bad in (-1, 1 << 17, "many"):
        with pytest.raises(ConfigError, match="scheduler.step_overhead_tokens"):
            DeployConfig.from_dict({"scheduler": {"step_overhead_tokens": bad}})
    config = DeployConfig.from_dict({"model": {"architecture": ARCH}, "cache": {"block_size": 4, "kv_memory_mb": 1},
                                     "scheduler": {"step_overhead_tokens": 24}, "topology": {"mode": "colocated"}})
    assert engine_config_for(WorkerSpec("w", Role.BOTH, config, "wiring-test-secret-0123456789")) \
        .step_overhead_tokens == 24


@pytest.mark.parametrize("path", ["deploy/smollm2-colocated.yaml", "deploy/smollm2.yaml"])
def test_smollm2_deploys_split_bursts(path):
    assert load_deploy_config(path).scheduler.step_overhead_tokens > 0
