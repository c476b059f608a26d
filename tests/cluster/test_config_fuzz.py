"""Fuzzing the deploy-config loader: every file is either valid (exit 0) or refused with one
`error:` line (exit 2), never a traceback, in under 10 s and 500 MB.

- hypothesis over the schema: sections of known and unknown keys holding values of every
  YAML type (huge, negative, infinite, long, non-ASCII, nested), dumped without aliases;
  a config that passes must also build the engine's ModelConfig the workers will build;
- byte-level mutations of the shipped deploy files: flipped, cut and spliced bytes, anchors
  and aliases, deep nesting, binary and UTF-16 re-encodings;
- the model's shape rules: `model.architecture` refuses exactly what `ModelConfig` refuses;
- a handful of files through the real CLI (`python -m pd.launch --config X --check-config`),
  measuring each child's time and peak RSS (`os.wait4`).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pd.cluster.config import ConfigError, DeployConfig
from pd.deploy.config_check import error_line, load_checked_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY_FILES = ["local.yaml", "local-colocated.yaml", "gpu-1p1d-one-gpu.yaml", "gpu-2p4d.yaml", "gpu-2p2d-k8s.yaml"]  # (no .gguf: it would convert)
SECTIONS = {name: sorted(field.annotation.model_fields) for name, field in DeployConfig.model_fields.items()}
MAX_S, MAX_RSS_MB = 10.0, 500


class _NoAliases(yaml.SafeDumper):
    def ignore_aliases(self, data):  # noqa: ARG002 - the dumper's hook: the same object twice is written twice
        return True


def _outcome(path: Path) -> tuple[int, str]:
    """(0, "") for a valid file, (2, its error line); anything else escapes and fails the test."""
    t0 = time.monotonic()
    try:
        config = load_checked_config(path)
    except ConfigError as exc:
        line = error_line(exc)
        assert "\n" not in line and line.startswith("error: ") and len(line) < 2100, line[:300]
        assert time.monotonic() - t0 < MAX_S
        return 2, line
    assert time.monotonic() - t0 < MAX_S
    _workers_can_build(config)
    return 0, ""


def _workers_can_build(config: DeployConfig) -> None:
    """What a worker builds first from a valid config: it must not fail there."""
    if config.model.path is None:
        from pd.engine.model.config import ModelConfig

        ModelConfig(**(config.model.architecture.overrides() | {"dtype": config.model.dtype}))
    assert DeployConfig.from_json(config.to_json()) == config


SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-(10**60), max_value=10**60),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
    st.text(min_size=5000, max_size=9000), st.sampled_from(["auto", "cpu", "cuda", "float16", "", "127.0.0.1",
                                                            "full_attention", "0", "yes", "\u0661", "ключ"]),
)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                            max_size=4), max_leaves=12)
SMALL_INTS = st.one_of(st.integers(min_value=-2, max_value=300), st.sampled_from([0, 1, 2, 4, 64, 260, 1 << 20]))


@st.composite
def configs(draw) -> dict:
    data: dict = {}
    for section in draw(st.lists(st.sampled_from(sorted(SECTIONS) + ["unknown"]), max_size=4, unique=True)):
        keys = SECTIONS.get(section, ["x"]) + ["not_a_key"]
        chosen = draw(st.lists(st.sampled_from(keys), max_size=4, unique=True))
        data[section] = {key: draw(VALUES) for key in chosen}
    if draw(st.booleans()):  # the model's shape, where most values fail only in the workers
        arch = draw(st.dictionaries(st.sampled_from(["hidden_size", "num_heads", "num_kv_heads", "num_layers",
                                                     "head_dim", "intermediate_size", "vocab_size", "layer_types",
                                                     "sliding_window", "max_position_embeddings"]),
                                    SMALL_INTS | VALUES, max_size=5))
        data.setdefault("model", {})["architecture"] = arch
    return data


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=configs())
def test_schema_fuzz_valid_or_one_line(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("fuzz") / "deploy.yaml"
    path.write_text(yaml.dump(data, Dumper=_NoAliases, allow_unicode=True))
    _outcome(path)


def _mutations(seed: int, original: bytes) -> list[bytes]:
    import random

    rng = random.Random(seed)
    text = original.decode()
    lines = text.splitlines(keepends=True)
    flipped = bytearray(original)
    for _ in range(rng.randint(1, 8)):
        flipped[rng.randrange(len(flipped))] = rng.randrange(256)
    cut = original[: rng.randrange(len(original))]
    spliced = b"".join(rng.choice(lines).encode() for _ in range(len(lines)))
    anchored = ("base: &b {x: [1, 2, 3]}\n" + text + "\nextra: [*b, *b, *b]\n").encode()
    merged = ("defaults: &d\n  name: m\nmodel:\n  <<: *d\n").encode()
    deep = text.replace("model:", "model: " + "[" * rng.randint(30, 1200) + "]" * 3, 1).encode()
    return [bytes(flipped), cut, spliced, anchored, merged, deep, text.encode("utf-16"), text.encode("utf-32"),
            rng.randbytes(len(original)), original.replace(b": ", b": !!binary ", 1),
            original + b"\n" + bytes([rng.randrange(256) for _ in range(64)])]


@pytest.mark.parametrize("name", DEPLOY_FILES)
def test_byte_mutations_of_the_shipped_files(tmp_path, name):
    original = (ROOT / "deploy" / name).read_bytes()
    assert _outcome(ROOT / "deploy" / name)[0] in (0, 2)
    outcomes = []
    for seed in range(6):
        for index, content in enumerate(_mutations(seed, original)):
            path = tmp_path / f"m{seed}-{index}.yaml"
            path.write_bytes(content)
            outcomes.append(_outcome(path)[0])
    assert outcomes.count(2) >= len(outcomes) // 2  # (most mutations break a file: the fuzz reached the checks)


SHAPES = st.fixed_dictionaries({}, optional={
    "hidden_size": st.integers(1, 256), "num_heads": st.integers(1, 16), "num_kv_heads": st.integers(1, 16),
    "num_layers": st.integers(1, 4), "head_dim": st.none() | st.integers(1, 64), "intermediate_size": st.integers(1, 64),
    "layer_types": st.none() | st.lists(st.sampled_from(["full_attention", "sliding_attention"]), min_size=1,
                                        max_size=4),
    "sliding_window": st.none() | st.integers(1, 64)})


@settings(max_examples=300, deadline=None)
@given(shape=SHAPES)
def test_architecture_refuses_exactly_what_the_engine_refuses(shape):
    from pd.cluster.architecture_config import ArchitectureSection
    from pd.engine.model.config import ModelConfig

    try:
        ModelConfig(**shape)
        engine_ok = True
    except ValueError:
        engine_ok = False
    try:
        ArchitectureSection.model_validate(shape)
        section_ok = True
    except ValueError:
        section_ok = False
    assert section_ok == engine_ok, shape


# The child reports its own peak RSS (VmHWM of its address space) as it exits: a forked child's
# `ru_maxrss` also counts the pytest process it was forked from (Linux keeps the pre-exec peak), which in
# the full suite holds torch and hundreds of MB.
_PEAK_RSS_CHILD = """
import atexit, runpy, sys
report = sys.argv.pop(1)
def _peak():
    with open("/proc/self/status") as status, open(report, "w") as out:
        out.write(next(line.split()[1] for line in status if line.startswith("VmHWM:")))
atexit.register(_peak)
sys.argv[0] = "pd.launch"
runpy.run_module("pd.launch", run_name="__main__", alter_sys=True)
"""


def _run_cli(config: Path) -> tuple[int, str, float, float]:
    """(exit status, stderr, seconds, peak RSS MB) of `python -m pd.launch --config X --check-config`."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    report = config.with_suffix(".rss")
    t0 = time.monotonic()
    with open(config.with_suffix(".err"), "w+") as err:
        status = subprocess.run([sys.executable, "-c", _PEAK_RSS_CHILD, str(report), "--config", str(config),
                                 "--check-config"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                timeout=60).returncode
        seconds = time.monotonic() - t0
        err.seek(0)
        return status, err.read(), seconds, int(report.read_text()) / 1024


CLI_CASES = {
    "valid": (ROOT / "deploy" / "local.yaml").read_text(),
    "bomb": "\n".join(["a: &a [x, x, x, x, x, x, x, x, x]"] + [
        f"{chr(98 + i)}: &{chr(98 + i)} [" + ", ".join([f"*{chr(97 + i)}"] * 9) + "]" for i in range(8)]),
    "deep": "model: " + "[" * 5000 + "]" * 5000,
    "utf16": (ROOT / "deploy" / "local.yaml").read_text().encode("utf-16"),
    "binary": bytes(range(256)) * 64,
    "huge-int": "model:\n  seed: " + "9" * 100_000,
    "key-1MB": "model:\n  ? " + "k" * (2**20 - 64) + "\n  : 1\n",  # (under the 1 MiB cap)
    "timeout-inf": "router:\n  request_timeout_s: .inf\n",
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_the_cli_check_gives_one_line_in_bounded_time_and_memory(tmp_path, case):
    content = CLI_CASES[case]
    path = tmp_path / f"{case}.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    status, stderr, seconds, rss_mb = _run_cli(path)
    assert seconds < MAX_S and rss_mb < MAX_RSS_MB, (seconds, rss_mb)
    if case == "valid":
        assert status == 0, stderr
        return
    assert status == 2 and "Traceback" not in stderr, stderr[-2000:]
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and len(lines[0]) < 2100, stderr[:500]
