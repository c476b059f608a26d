"""The KV audit's settings (`transfer.kv_audit_rate`, `transfer.kv_audit_tolerance`): validated when the
config loads, carried into the workers' engine config, and the `engine.perturb_kv` fault rule's syntax."""
from __future__ import annotations

import subprocess
import sys

import pytest

from connectors.links.faults import FaultSpecError
from pd.cluster.config import ConfigError, DeployConfig
from pd.cluster.fault_rules import parse_worker_faults
from pd.engine.config import EngineConfig


BAD = [("kv_audit_rate", -0.1), ("kv_audit_rate", 1.5), ("kv_audit_rate", float("nan")), ("kv_audit_rate", "often"),
       ("kv_audit_tolerance", -1.0), ("kv_audit_tolerance", float("inf")), ("kv_audit_tolerance", 2.0)]


@pytest.mark.parametrize("key, value", BAD)
def test_out_of_range_values_are_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=f"transfer.{key}"):
        DeployConfig.from_dict({"transfer": {key: value}})


def test_defaults_are_off_and_values_reach_the_engine_config():
    assert DeployConfig.from_dict({}).transfer.kv_audit_rate == 0.0
    assert DeployConfig.from_dict({}).transfer.kv_audit_tolerance is None
    t = DeployConfig.from_dict({"transfer": {"kv_audit_rate": 0.01, "kv_audit_tolerance": 0.001}}).transfer
    assert (t.kv_audit_rate, t.kv_audit_tolerance) == (0.01, 0.001)
    for bad in ({"kv_audit_rate": 2.0}, {"kv_audit_tolerance": -0.5}):
        with pytest.raises(ValueError, match="kv_audit"):
            EngineConfig(**bad)


def test_launcher_says_one_line_and_exits_2(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("transfer:\n  kv_audit_rate: 1.5\n")
    run = subprocess.run([sys.executable, "-m", "pd.launch", "--config", str(path)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and "transfer.kv_audit_rate" in run.stderr
    schema = subprocess.run([sys.executable, "-m", "pd.launch", "--print-config-schema"], capture_output=True,
                            text=True, timeout=120)
    assert "kv_audit_rate" in schema.stdout and "kv_audit_tolerance" in schema.stdout


def test_the_perturb_fault_rule_takes_corrupt_only():
    plan = parse_worker_faults("engine.perturb_kv:corrupt:times=all")
    assert plan is not None and plan.fire("engine.perturb_kv") is not None
    for bad in ("engine.perturb_kv:kill", "engine.perturb_kv:drop", "engine.step:corrupt"):
        with pytest.raises(FaultSpecError):
            parse_worker_faults(bad)
    DeployConfig.from_dict({"faults": {"prefill": "engine.perturb_kv:corrupt:times=all"}})
