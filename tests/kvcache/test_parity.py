"""pdkv's KVCacheManager makes exactly vLLM 0.25.1's decisions (issue 2 acceptance).

Every scenario in parity/fixtures/vllm_0_25_1.json (recorded by parity/record_vllm.py inside
the vLLM anchor venv) is replayed against pdkv; each op's observation (block ids per group,
hit lengths, None results, contract errors, KV events, prefix-cache stats, and the free-block
count after the op) must equal vLLM's. Hash values are never compared (events carry first-seen
ordinals instead). Re-record after changing scenarios:

    cd tests/kvcache && $VENV/bin/python -m parity.record_vllm --out parity/fixtures/vllm_0_25_1.json
"""
from __future__ import annotations

import json
import os
import subprocess
import traceback
from pathlib import Path

import pytest

from kvcache.audit import assert_all_free
from parity import runner, scenarios
from parity.pdkv_adapter import PdkvAdapter

PARITY_DIR = Path(__file__).resolve().parent / "parity"
FIXTURE = PARITY_DIR / "fixtures" / "vllm_0_25_1.json"
DEFAULT_VENV = Path.home() / ".cache" / "pdkv-anchors" / "vllm-venv"
CONTEXT_OPS = 6

with FIXTURE.open() as _f:
    RECORDED = json.load(_f)
SCENARIOS = {s["name"]: s for s in RECORDED["scenarios"]}


class _Tally:
    """Ops compared in this session, reported once at module end."""
    ops = 0
    scenarios = 0
    mismatching: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def _report_tally(request):
    yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    line = (f"kvcache parity vs vLLM {RECORDED['vllm_version']}: {_Tally.ops} ops compared "
            f"in {_Tally.scenarios} scenarios, {len(_Tally.mismatching)} mismatching"
            + (f" ({', '.join(_Tally.mismatching)})" if _Tally.mismatching else ""))
    print(line)
    capman = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capman is not None:
        with capman.global_and_fixture_disabled():  # show the figure even under -q
            reporter.write_line("")
            reporter.write_line(line)


def replay(scenario: dict) -> tuple[int, str | None]:
    """Replay on pdkv; returns (ops compared, None or a readable description of the first
    mismatch). An exception in pdkv counts as a mismatch at that op."""
    adapter = PdkvAdapter(scenario["config"])
    ops, expected = scenario["ops"], scenario["expected"]
    for i, (op, exp) in enumerate(zip(ops, expected)):
        try:
            got = runner.execute(adapter, op)
        except Exception:  # noqa: BLE001 - any pdkv failure is reported as a mismatch
            got = ["raised " + traceback.format_exc(limit=4).strip().splitlines()[-1], None]
            tb = traceback.format_exc(limit=6)
        else:
            tb = ""
        if got != exp:
            return i, _describe(scenario, i, exp, got, tb)
    if adapter.num_free_blocks() == scenario["config"]["num_blocks"] - 1:
        assert_all_free(adapter.mgr)
    return len(ops), None


def _describe(scenario, i, exp, got, tb) -> str:
    ops = scenario["ops"]
    lines = [f"scenario {scenario['name']!r} config {json.dumps(scenario['config'])}",
             f"first mismatch at op #{i} of {len(ops)}: {json.dumps(ops[i])}",
             f"  vLLM 0.25.1: result={json.dumps(exp[0])} free={exp[1]}",
             f"  pdkv       : result={json.dumps(got[0])} free={got[1]}"]
    lines.append("preceding ops (op -> vLLM observation):")
    for j in range(max(0, i - CONTEXT_OPS), i):
        lines.append(f"  #{j} {json.dumps(ops[j])} -> {json.dumps(scenario['expected'][j])}")
    if tb:
        lines.append(tb)
    return "\n".join(lines)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_same_decisions_as_vllm(name):
    scenario = SCENARIOS[name]
    compared, mismatch = replay(scenario)
    _Tally.ops += compared
    _Tally.scenarios += 1
    if mismatch is not None:
        _Tally.mismatching.append(name)
        pytest.fail(mismatch, pytrace=False)


def test_free_order_example_matches_reference():
    """The reference's literal example: after two requests sharing three blocks are freed,
    a miss takes blocks in free-queue order [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]."""
    scenario = SCENARIOS["free_order"]
    allocs = [obs[0]["new"] for op, obs in zip(scenario["ops"], scenario["expected"])
              if op["op"] == "allocate_slots" and op["id"] == "miss"]
    assert allocs == [scenarios.FREE_ORDER_EXPECTED]
    adapter = PdkvAdapter(scenario["config"])
    observed = [runner.execute(adapter, op) for op in scenario["ops"]]
    got = [obs[0]["new"] for op, obs in zip(scenario["ops"], observed)
           if op["op"] == "allocate_slots" and op["id"] == "miss"]
    assert got == [scenarios.FREE_ORDER_EXPECTED]
    assert_all_free(adapter.mgr)


def test_fixture_matches_handwritten_scenarios():
    """The committed fixture holds the current hand-written scenarios (with `admit_alloc`
    resolved from vLLM's own hit lengths), so editing scenarios.py forces a re-record."""
    for name, cfg, build in scenarios.HANDWRITTEN:
        recorded = SCENARIOS.get(name)
        assert recorded is not None, f"scenario {name} missing from fixture: re-record"
        assert recorded["config"] == cfg, f"scenario {name}: config changed, re-record"
        playback = iter(recorded["expected"])
        ops, _ = runner.resolve_and_run(lambda op: next(playback), scenarios.observed(build()))
        assert ops == recorded["ops"], f"scenario {name}: ops changed, re-record"


def test_fixture_is_small_and_from_vllm_0_25_1():
    assert RECORDED["vllm_version"] == "0.25.1"
    assert FIXTURE.stat().st_size < 2 * 1024 * 1024
    assert sum(len(s["ops"]) for s in RECORDED["scenarios"]) > 5000


def _anchor_python() -> Path | None:
    venv = Path(os.environ.get("PDKV_VLLM_VENV", DEFAULT_VENV))
    python = venv / "bin" / "python"
    return python if python.exists() else None


@pytest.mark.timeout(600)
def test_committed_fixture_is_current(tmp_path):
    """Re-record live with vLLM 0.25.1 and require the committed fixture to be identical."""
    python = _anchor_python()
    if python is None:
        pytest.skip("vLLM anchor venv not found (set PDKV_VLLM_VENV or run "
                    "../shared/anchors/setup_vllm_anchor.sh)")
    out = tmp_path / "live.json"
    env = dict(os.environ, PYTHONHASHSEED="0")  # vLLM's NONE_HASH and set orders fixed
    proc = subprocess.run([str(python), "-m", "parity.record_vllm", "--out", str(out)], cwd=PARITY_DIR.parent,
                          capture_output=True, text=True, timeout=540, env=env)
    if proc.returncode != 0 and "No module named 'vllm" in proc.stderr:
        pytest.skip(f"{python} has no vLLM: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    live = json.loads(out.read_text())
    assert live["vllm_version"] == RECORDED["vllm_version"]
    live_names = [s["name"] for s in live["scenarios"]]
    assert live_names == list(SCENARIOS), "scenario list changed: re-record the fixture"
    for fresh in live["scenarios"]:
        old = SCENARIOS[fresh["name"]]
        for key in ("config", "ops", "expected"):
            if fresh[key] != old[key]:
                idx = runner.first_mismatch(old[key], fresh[key]) if key != "config" else None
                pytest.fail(f"fixture stale for {fresh['name']!r} ({key}, first difference at "
                            f"#{idx}): re-run record_vllm.py", pytrace=False)
