"""Each deploy file a user or an attacker might write gets one `error:` line (exit 2) before Ray
starts, at a bounded cost: YAML bombs, huge or binary files, deep nesting, huge numbers and
strings, values that used to fail only inside the workers, and non-configs.

The cases go through `load_checked_config` (what `python -m pd.launch` calls before Ray) and
`error_line` (what it prints); tests/cluster/test_config_fuzz.py runs the same path on mutated
files and a few through the real CLI.
"""
from __future__ import annotations

import json
import time
import tracemalloc

import pytest

from pd.cluster.config import ConfigError, DeployConfig, load_deploy_config
from pd.cluster.config_file import MAX_FILE_BYTES
from pd.deploy.config_check import error_line, load_checked_config


def _refused(tmp_path, content: str | bytes) -> str:
    """The one error line for a file holding `content` (asserting it is refused cheaply)."""
    path = tmp_path / "deploy.yaml"
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(ConfigError) as info:
            load_checked_config(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    line = error_line(info.value)
    assert time.monotonic() - t0 < 10.0
    assert peak < 100 * 2**20, f"{peak / 2**20:.0f} MB to refuse it"
    assert "\n" not in line and len(line) <= 2100, line[:300]
    assert line.startswith("error: ")
    return line


BOMB = "\n".join(["a: &a [x, x, x, x, x, x, x, x, x]"]
                 + [f"{chr(98 + i)}: &{chr(98 + i)} [" + ", ".join([f"*{chr(97 + i)}"] * 9) + "]" for i in range(3)])


@pytest.mark.parametrize("content, expected", [
    pytest.param(BOMB, "alias", id="anchor-bomb"),
    pytest.param("model: &m {name: x}\ncache: *m\n", "alias", id="any-alias"),
    pytest.param("# " + "x" * MAX_FILE_BYTES + "\n", "larger than", id="over-1MiB"),
    pytest.param(b"model:\n  name: caf\xe9\n", "not UTF-8", id="latin-1"),
    pytest.param("model:\n  name: x\n".encode("utf-16"), "not UTF-8", id="utf-16"),
    pytest.param(bytes(range(256)) * 4, "UTF-8", id="binary"),
    pytest.param(b"model:\n  name: a\x00b\n", "YAML", id="nul-byte"),
    pytest.param("model: " + "[" * 900 + "]" * 900 + "\n", "deeper", id="nested-900"),
    pytest.param("model: " + "{a: " * 900 + "1" + "}" * 900 + "\n", "deeper", id="nested-mappings-900"),
    pytest.param("model:\n  seed: " + "7" * 5000 + "\n", "digits", id="int-5000-digits"),
    pytest.param("model:\n  path: /" + "p" * 5000 + "\n", "model.path", id="path-5000-chars"),
    pytest.param("model:\n  name: " + "n" * 100_000 + "\n", "model.name", id="name-100KB"),
    pytest.param("[]\n", "mapping", id="list"),
    pytest.param("false\n", "mapping", id="false"),
    pytest.param("42\n", "mapping", id="int"),
    pytest.param("router:\n  api_key: \"ключ-12345678\"\n", "router.api_key", id="api-key-not-latin-1"),
    pytest.param("router:\n  api_keys: {a: \"k\\u2028ey-12345678\"}\n", "router.api_keys.a", id="api-key-control"),
    pytest.param("model:\n  architecture: {num_heads: 0}\n", "model.architecture.num_heads", id="heads-0"),
    pytest.param("model:\n  architecture: {hidden_size: -64}\n", "model.architecture.hidden_size", id="hidden-neg"),
    pytest.param("model:\n  architecture: {num_heads: 3}\n", "model.architecture.num_kv_heads", id="kv-heads"),
    pytest.param("model:\n  architecture: {num_heads: 6, num_kv_heads: 6}\n", "model.architecture.num_heads",
                 id="heads-divide-hidden"),
    pytest.param("model:\n  architecture: {layer_types: [full_attention]}\n", "layer_types", id="layer-types"),
    pytest.param("model:\n  architecture: {hidden_sise: 64}\n", "unknown key", id="arch-unknown-key"),
    pytest.param("model:\n  architecture: {dtype: float16}\n", "unknown key", id="arch-dtype-is-model-dtype"),
    pytest.param("model:\n  path: /nonexistent/pdkv-model\n", "no such file", id="missing-path"),
    pytest.param("router:\n  host: \"127.0.0.\u0661\"\n", "router.host", id="homoglyph-host"),
    pytest.param("transfer:\n  host: \"lоcalhost\"\n", "transfer.host", id="homoglyph-transfer-host"),
    pytest.param("cache:\n  kv_memory_mb: 1.0e+15\n", "cache.kv_memory_mb", id="kv-1e15"),
    pytest.param("scheduler:\n  max_model_len: 1000000000\n", "scheduler.max_model_len", id="len-1e9"),
    pytest.param("model:\n  architecture: {num_layers: 100000}\n", "num_layers", id="layers-1e5"),
    pytest.param("model:\n  architecture: {hidden_size: 65536, intermediate_size: 262144, num_layers: 1024}\n",
                 "parameters", id="random-weights-too-big"),
    pytest.param("topology:\n  num_decode: 100000\n", "topology.num_decode", id="workers-1e5"),
    pytest.param("router:\n  request_timeout_s: .inf\n", "finite", id="timeout-inf"),
    pytest.param("router:\n  connect_timeout_s: .nan\n", "finite", id="timeout-nan"),
    pytest.param("router:\n  request_timeout_s: -1.0\n", "router.request_timeout_s", id="timeout-negative"),
])
def test_a_bad_file_gets_one_line_naming_the_problem(tmp_path, content, expected):
    assert expected in _refused(tmp_path, content)


def test_a_long_unknown_key_is_cut_in_the_message(tmp_path):
    line = _refused(tmp_path, "model:\n  ? " + "k" * 5000 + "\n  : 1\n")
    assert "unknown key" in line and len(line) < 1000
    # validated from data (the router's and the workers' path): a 1 MB key, 100 unknown keys
    with pytest.raises(ConfigError) as info:
        DeployConfig.from_dict({"model": {"k" * 2**20: 1, **{f"x{i}": i for i in range(100)}}})
    assert len(str(info.value)) < 1000 and "more" in str(info.value)


def test_a_huge_value_is_never_repr_d_whole():
    """The message quotes the first characters of a value; it never builds the whole repr (a 5,000-digit
    integer has none: Python refuses to spell it)."""
    for value in (10**5000, "v" * 2**22, b"\x00" * 2**22, list(range(10**5)), {"a": "b" * 2**22}):
        with pytest.raises(ConfigError) as info:
            DeployConfig.from_dict({"model": {"name": value}})
        assert len(str(info.value)) < 400, str(info.value)[:400]


def test_a_valid_file_loads_and_the_empty_file_is_every_default(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text("")
    assert load_checked_config(path) == DeployConfig()
    path.write_text("\ufeffmodel:\n  name: x\n  architecture: {num_layers: 3}\n")  # a UTF-8 BOM is fine
    config = load_checked_config(path, port=0)
    assert config.model.name == "x" and config.router.port == 0


def test_architecture_is_a_typed_section_carrying_only_what_was_set():
    config = DeployConfig.from_dict({"model": {"architecture": {"num_layers": 3, "layer_types": None}}})
    assert config.model.architecture.num_layers == 3 and config.model.architecture.hidden_size == 64
    assert config.to_dict()["model"]["architecture"] == {"num_layers": 3, "layer_types": None}
    assert DeployConfig.from_json(config.to_json()) == config
    assert config.replace(router__port=0).model.architecture == config.model.architecture
    schema = json.dumps(DeployConfig.json_schema())
    assert "ArchitectureSection" in schema and "num_kv_heads" in schema


def test_the_architecture_section_has_the_engine_model_fields_and_defaults():
    import dataclasses

    from pd.cluster.architecture_config import ArchitectureSection
    from pd.engine.model.config import ModelConfig

    engine = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    assert engine.pop("dtype") == "float32"  # model.dtype, not an architecture key
    section = ArchitectureSection()
    assert {name: getattr(section, name) for name in ArchitectureSection.model_fields} == engine


def _checkpoint(tmp_path, **changes):
    from pd.engine.model.config import ModelConfig

    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(ModelConfig().to_hf_dict() | changes))
    return directory


def test_a_readable_checkpoint_with_a_bad_shape_is_refused_at_launch(tmp_path):
    directory = _checkpoint(tmp_path, num_attention_heads=3)
    line = _refused(tmp_path, f"model:\n  path: {directory}\n")
    assert "model.path" in line and "num_heads" in line and str(directory) in line


def test_a_missing_path_is_only_a_warning_when_the_workers_run_elsewhere(tmp_path, caplog):
    path = tmp_path / "deploy.yaml"
    path.write_text("model:\n  path: /nonexistent/pdkv-model\n")
    config = load_checked_config(path, workers_here=False)
    assert config.model.path == "/nonexistent/pdkv-model"
    assert any("does not exist here" in record.getMessage() for record in caplog.records)


def test_load_deploy_config_refuses_aliases_too(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text(BOMB)
    with pytest.raises(ConfigError, match="alias"):
        load_deploy_config(path)
