"""The deploy config's TP settings: per-role degrees checked against the model, what TP refuses,
the schema, and that TP 1 (the default) leaves a config exactly as it was."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pd.cluster.config import ConfigError, DeployConfig, load_deploy_config
from pd.cluster.tp_config import checkpoint_tp_problem
from pd.engine.parallel.tp import valid_tps

REPO = Path(__file__).resolve().parents[2]


def _config(**topology) -> DeployConfig:
    return DeployConfig.from_dict({"topology": topology})


def test_tp_is_one_by_default_and_round_trips():
    config = DeployConfig.from_dict({})
    topo = config.topology
    assert (topo.prefill_tp, topo.decode_tp, topo.colocated_tp) == (1, 1, 1)
    assert [topo.tp_of(r) for r in ("prefill", "decode", "both")] == [1, 1, 1]
    tp = _config(prefill_tp=2, decode_tp=1, tp_timeout_s=7.5)
    assert DeployConfig.from_json(tp.to_json()) == tp
    assert tp.topology.tp_of("prefill") == 2 and tp.topology.tp_timeout_s == 7.5


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 2), (8, 8), (6, 2), (4, 1)])
def test_every_tp_the_rule_accepts_validates_and_every_other_names_both_numbers(num_heads, num_kv_heads):
    arch = {"hidden_size": 8 * num_heads, "intermediate_size": 24 * num_heads, "num_heads": num_heads,
            "num_kv_heads": num_kv_heads}
    fits = valid_tps(num_heads, num_kv_heads)
    for tp in range(1, 9):
        data = {"model": {"architecture": arch}, "topology": {"decode_tp": tp}}
        if tp in fits:
            assert DeployConfig.from_dict(data).topology.decode_tp == tp
            continue
        with pytest.raises(ConfigError) as err:
            DeployConfig.from_dict(data)
        text = str(err.value)
        assert text.startswith("topology.decode_tp: ") and f"decode TP {tp}" in text, text
        assert str(num_kv_heads) in text or str(num_heads) in text, text


def test_each_role_is_checked_on_its_own():
    arch = {"model": {"architecture": {"num_heads": 4, "num_kv_heads": 2}}}
    ok = DeployConfig.from_dict({**arch, "topology": {"prefill_tp": 4, "decode_tp": 2}})
    assert (ok.topology.prefill_tp, ok.topology.decode_tp) == (4, 2)
    with pytest.raises(ConfigError, match=r"topology\.prefill_tp: prefill TP 3 and 2 KV heads"):
        DeployConfig.from_dict({**arch, "topology": {"prefill_tp": 3}})
    colocated = DeployConfig.from_dict({**arch, "topology": {"mode": "colocated", "colocated_tp": 2}})
    assert colocated.topology.tp_of("both") == 2
    with pytest.raises(ConfigError, match=r"topology\.colocated_tp: colocated TP 3"):
        DeployConfig.from_dict({**arch, "topology": {"mode": "colocated", "colocated_tp": 3}})


@pytest.mark.parametrize("data, key, reason", [
    ({"model": {"attention_backend": "fused"}, "topology": {"prefill_tp": 2}}, "prefill_tp", "'fused'"),
    ({"transfer": {"streaming": "layer"}, "topology": {"decode_tp": 2}}, "decode_tp", "'layer'"),
    ({"topology": {"decode_tp": 2, "device": "cuda", "gpus_per_worker": 0.5}}, "decode_tp", "gpus_per_worker"),
    ({"topology": {"colocated_tp": 2}}, "colocated_tp", "starts no colocated worker"),
    ({"transfer": {"kv_audit_rate": 0.5}, "topology": {"prefill_tp": 2}}, "prefill_tp", "kv_audit_rate"),
    ({"model": {"architecture": {"intermediate_size": 130}}, "topology": {"decode_tp": 4}}, "decode_tp",
     "intermediate size of 130"),
    ({"topology": {"mode": "colocated", "prefill_tp": 2}}, "prefill_tp", "starts no prefill worker"),
    ({"topology": {"prefill_tp": 0}}, "prefill_tp", "greater than or equal to 1"),
    ({"topology": {"prefill_tp": 2.0}}, "prefill_tp", "int"),
    ({"topology": {"tp_timeout_s": 0}}, "tp_timeout_s", "greater than 0"),
])
def test_what_tp_cannot_run_is_refused_with_the_reason(data, key, reason):
    with pytest.raises(ConfigError) as err:
        DeployConfig.from_dict(data)
    assert f"topology.{key}" in str(err.value) and reason in str(err.value), str(err.value)


def test_the_same_settings_at_tp_one_stay_valid():
    for data in ({"model": {"attention_backend": "fused"}}, {"transfer": {"streaming": "layer"}},
                 {"transfer": {"kv_audit_rate": 0.5}}, {"model": {"architecture": {"intermediate_size": 130}}},
                 {"topology": {"device": "cuda", "gpus_per_worker": 0.5}}):
        DeployConfig.from_dict(data)


def test_a_checkpoint_shape_is_checked_against_each_role_in_use():
    config = _config(prefill_tp=2, decode_tp=1)
    assert checkpoint_tp_problem(config, num_heads=4, num_kv_heads=2) is None
    why = checkpoint_tp_problem(config, num_heads=9, num_kv_heads=3)  # SmolLM2-135M's heads
    assert why is not None and why.startswith("topology.prefill_tp: prefill TP 2 and 3 KV heads"), why
    assert "[1, 3, 9]" in why and "model.path" in why


def test_shipped_tp_configs_check_and_existing_configs_keep_tp_one():
    for path in sorted((REPO / "deploy").glob("*.yaml")):
        if path.name.startswith("kuberay"):
            continue
        topo = load_deploy_config(path).topology
        if "tp" not in path.stem:
            assert (topo.prefill_tp, topo.decode_tp, topo.colocated_tp) == (1, 1, 1), path.name
    local_tp = load_deploy_config(REPO / "deploy" / "local-tp.yaml").topology
    assert (local_tp.prefill_tp, local_tp.decode_tp) == (2, 1)
    gpu = load_deploy_config(REPO / "deploy" / "gpu-tp4p-2x-tp2d.yaml").topology
    assert (gpu.prefill_tp, gpu.num_prefill, gpu.decode_tp, gpu.num_decode) == (4, 1, 2, 2)
    assert gpu.device == "cuda" and gpu.gpus_per_worker == 1.0


def test_check_config_cli_and_schema_show_the_tp_settings():
    out = subprocess.run([sys.executable, "-m", "pd.launch", "--print-config-schema"], capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    topology = json.loads(out.stdout)["$defs"]["TopologySection"]["properties"]
    for key in ("prefill_tp", "decode_tp", "colocated_tp", "tp_timeout_s"):
        assert key in topology and topology[key]["description"], key
    assert "per worker rank" in topology["cpus_per_worker"]["description"]
    for name in ("local-tp.yaml", "gpu-tp4p-2x-tp2d.yaml"):
        check = subprocess.run([sys.executable, "-m", "pd.launch", "--config", f"deploy/{name}", "--check-config"],
                               capture_output=True, text=True, timeout=120, cwd=REPO)
        assert check.returncode == 0 and "valid" in check.stdout, (name, check.stderr)
