"""The deploy YAML's schema: printed as JSON Schema, strict types, unknown keys refused by path,
fault plans checked without zmq, and the one transfer-settings -> connector-config mapping."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from connectors.zmq.transfer_settings import TransferSettings
from connectors.zmq.connector import KVRole
from pd.cluster.config import ConfigError, DeployConfig

REPO = Path(__file__).resolve().parents[2]
SECTIONS = {"model", "cache", "scheduler", "topology", "transfer", "router", "faults", "tracing"}
SHIPPED = sorted(p for p in (REPO / "deploy").glob("*.yaml") if not p.name.startswith("kuberay"))


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_launch_prints_a_valid_json_schema_that_names_every_section():
    out = subprocess.run([sys.executable, "-m", "pd.launch", "--print-config-schema"], capture_output=True,
                         text=True, timeout=120, env=_env(), cwd=REPO)
    assert out.returncode == 0, out.stderr
    schema = json.loads(out.stdout)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert set(schema["properties"]) == SECTIONS and schema["additionalProperties"] is False
    assert schema == DeployConfig.json_schema()
    model = schema["$defs"]["ModelSection"]["properties"]
    assert model["attention_backend"]["enum"] == ["auto", "torch", "fused", "triton"]
    assert model["cuda_graphs"]["default"] is True
    assert model["attention_backend"]["default"] == "auto"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_configs_satisfy_the_schema_and_a_typo_fails_both_checks(path):
    validator = jsonschema.Draft202012Validator(DeployConfig.json_schema())
    data = yaml.safe_load(path.read_text())
    validator.validate(data)
    data.setdefault("router", {})["prot"] = 8000
    assert not validator.is_valid(data)
    with pytest.raises(ConfigError, match=r"^router: unknown key\(s\) \['prot'\]; known: \[.*'port'"):
        DeployConfig.from_dict(data)


@pytest.mark.parametrize("data, message", [
    ({"cache": {"enable_prefix_caching": 1}}, "cache.enable_prefix_caching: expected bool, got int 1"),
    ({"cache": {"enable_prefix_caching": "yes"}}, "cache.enable_prefix_caching: expected bool, got str 'yes'"),
    ({"router": {"port": True}}, "router.port: expected int, got bool True"),
    ({"scheduler": {"max_num_seqs": 2.5}}, "scheduler.max_num_seqs: expected int, got float 2.5"),
    ({"topology": {"mode": "colocated", "num_colocated": 0}},
     "topology.num_colocated: must be >= 1 in colocated mode"),
    ({"topology": {"nodes": 2}, "cache": {"blocks": 1}}, "topology: unknown key(s) ['nodes']"),
    ({"faults": {"decode": "worker.decode_token:corrupt"}}, "faults.decode: fault rule"),
    ({"model": {"path": "  "}}, "model.path: must be a directory path or empty"),
])
def test_bad_values_are_refused_naming_the_path(data, message):
    with pytest.raises(ConfigError) as info:
        DeployConfig.from_dict(data)
    assert message in str(info.value)


def test_numbers_widen_to_float_and_enums_take_their_values():
    config = DeployConfig.from_dict({"transfer": {"timeout_s": 3, "kv_load_failure_policy": "fail"},
                                     "topology": {"placement": "pack"}})
    assert config.transfer.timeout_s == 3.0 and isinstance(config.transfer.timeout_s, float)
    assert config.transfer.kv_load_failure_policy.value == "fail" and config.topology.placement.value == "pack"
    assert DeployConfig.from_json(config.to_json()) == config


def test_fault_plans_are_checked_without_loading_zmq_or_torch():
    code = ("import sys; from pd.cluster.config import ConfigError, DeployConfig\n"
            "DeployConfig.from_dict({'faults': {'decode': 'data.pull:kill,worker.decode_token:delay:0.1'}})\n"
            "try:\n    DeployConfig.from_dict({'faults': {'prefill': 'side.hellp:drop'}})\n"
            "except ConfigError as exc:\n    assert 'faults.prefill' in str(exc) and 'side.hellp' in str(exc), exc\n"
            "else:\n    raise SystemExit('typo accepted')\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('zmq', 'torch', 'ray'))\n"
            "assert not loaded, loaded\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=_env())
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("timeout_s, step_s", [(2.0, 2.0), (30.0, 5.0)])
def test_transfer_section_maps_onto_the_connectors_timeouts(timeout_s, step_s):
    config = DeployConfig.from_dict({"transfer": {"timeout_s": timeout_s, "lease_s": 12, "port": 0,
                                                  "data_path": "tcp"}})
    settings = config.transfer.transfer_settings()
    assert settings == TransferSettings(port=0, timeout_s=timeout_s, lease_s=12.0, data_path="tcp")
    cc = settings.connector_config(engine_id="e", role=KVRole.CONSUMER, secret="s" * 16, model_id="m",
                                   host="127.0.0.1")
    assert (cc.transfer_timeout_s, cc.handshake_timeout_s, cc.io_timeout_s) == (timeout_s, step_s, step_s)
    assert cc.lease_s == 12.0 and cc.heartbeat_interval_s == 2.0 and cc.data_path.value == "tcp"
    defaults = DeployConfig().transfer
    assert (defaults.timeout_s, defaults.lease_s, defaults.data_path) == (TransferSettings().timeout_s,
                                                                        TransferSettings().lease_s, "auto")
