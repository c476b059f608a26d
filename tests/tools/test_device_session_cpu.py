"""tests/gpu/device_session.sh on the CPU: the one command a GPU machine runs (at most 8 minutes), checked here
through its dry form and stand-in commands, so that a device stay is not spent finding a typo or a step that
stops the rest.

- its budget table: the steps in their order, the limits summing to at most 460 s;
- its dry run: every step in order, each one's figures (gpu_check's JSON plan) under OUT before the next starts,
  a summary naming each step's status, the GPU and the date, at most 8 files (what a device run brings back);
- a step that times out or fails (or, for the gpu tests, skips) is recorded and the next one still runs; a
  step that would pass the deadline gets what is left, or is skipped for time;
- the gpu step's pytest selection collects only `gpu`-marked tests: no CPU Ray test, no hypothesis test.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "gpu" / "device_session.sh"
ORDER = ["setup", "float32", "engine", "transfer", "gpu_tests", "served"]
GPU_CHECK_STEPS = ["float32", "engine", "transfer", "served"]


def _session(out: Path, *args: str, timeout: float = 300, **env: str) -> tuple[subprocess.CompletedProcess, dict]:
    """Run the script into `out`; returns the process and summary.txt's step lines as {step: status}."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    proc = subprocess.run(["bash", str(SCRIPT), *args, str(out)], cwd=REPO, env=full_env, capture_output=True,
                          text=True, timeout=timeout)
    lines = (out / "summary.txt").read_text().splitlines()
    steps = {}
    for line in lines:
        name, _, status = line.partition(" ")
        if name in ORDER:
            steps[name] = status.strip()
    return proc, steps


def _headers(log: str) -> list[tuple[str, int, str]]:
    """Each step's header in session.log: (step, limit s, the files OUT held when it started)."""
    return [(m[1], int(m[2]), m[3]) for m in re.finditer(r"^== (\w+) \(limit (\d+) s\) at \d+ s; \S+ held: (.*)$",
                                                          log, re.M)]


def _standins(**over: str) -> dict[str, str]:
    return {f"STANDIN_{name}": over.get(name, "true") for name in ORDER}


def test_the_budget_table_orders_the_steps_and_fits_eight_minutes():
    table = subprocess.run(["bash", str(SCRIPT), "--print-budget"], capture_output=True, text=True, timeout=30)
    rows = [line.split() for line in table.stdout.splitlines()]
    assert [name for name, _ in rows] == ORDER
    limits = {name: int(seconds) for name, seconds in rows}
    assert sum(limits.values()) <= 460 and min(limits.values()) > 0, limits
    deadline = int(re.search(r"DEADLINE_S=\$\{DEADLINE_S:-(\d+)\}", SCRIPT.read_text())[1])
    assert sum(limits.values()) <= deadline <= 480


def test_dry_run_runs_every_step_in_order_and_each_writes_under_out_before_the_next(tmp_path):
    out = tmp_path / "out"
    proc, steps = _session(out, "--dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list(steps) == ORDER and all(status.startswith("ok") for status in steps.values()), steps
    summary = (out / "summary.txt").read_text()
    assert re.search(r"^gpu: .+$", summary, re.M) and re.search(r"^date: \d{4}-\d\d-\d\d \d\d:\d\d", summary, re.M)
    headers = _headers((out / "session.log").read_text())
    assert [name for name, _, _ in headers] == ORDER
    for i, (name, _, held) in enumerate(headers):
        earlier = [f"{step}.json" for step in GPU_CHECK_STEPS if step in ORDER[:i]]
        assert set(earlier) <= set(held.split()), (name, held)  # the figures of every earlier step are there
    for step in GPU_CHECK_STEPS:  # each gpu_check step parsed its real arguments and asked for its own section
        plan = json.loads((out / f"{step}.json").read_text())
        assert plan["dry_run"] and plan["sections"] == [step]
    assert json.loads((out / "engine.json").read_text())["engine_batches"][:2] == [32, 128]
    assert len(list(out.iterdir())) <= 8 and all(p.is_file() for p in out.iterdir())


def test_a_step_that_times_out_or_fails_is_recorded_and_the_next_still_runs(tmp_path):
    out = tmp_path / "out"
    t0 = time.monotonic()
    proc, steps = _session(out, STEPS="float32 engine transfer gpu_tests served", LIMIT_float32="1",
                           **_standins(float32="sleep 30", engine='cp "$OUT/summary.txt" "$OUT/seen.txt"',
                                       transfer="exit 3", gpu_tests='echo "26 passed, 1 skipped in 9.0s"'))
    assert time.monotonic() - t0 < 25  # the sleeping stand-in was stopped at its limit, not waited for
    assert proc.returncode == 1
    assert steps["setup"] == "not asked"
    assert steps["float32"].startswith("timed out (limit 1 s)")
    assert steps["engine"].startswith("ok") and steps["served"].startswith("ok")
    assert steps["transfer"].startswith("failed (rc=3)")
    assert steps["gpu_tests"].startswith("failed (gpu tests skipped")  # a skip on a GPU machine hides a path
    seen = (out / "seen.txt").read_text()  # what the engine step found: float32's result already recorded
    assert re.search(r"^float32 +timed out", seen, re.M) and re.search(r"^engine +running", seen, re.M)
    assert "not ok: float32 transfer gpu_tests" in proc.stdout


def test_a_step_that_would_pass_the_deadline_gets_what_is_left_or_is_skipped_for_time(tmp_path):
    proc, steps = _session(tmp_path / "short", DEADLINE_S="12", LIMIT_setup="6", **_standins(setup="sleep 3"))
    assert proc.returncode == 1
    assert steps["setup"].startswith("ok")
    assert all(steps[name].startswith("skipped for time") for name in ORDER[1:]), steps
    proc, steps = _session(tmp_path / "capped", DEADLINE_S="60", **_standins())
    assert proc.returncode == 0 and all(status.startswith("ok") for status in steps.values()), steps
    limits = {name: limit for name, limit, _ in _headers((tmp_path / "capped" / "session.log").read_text())}
    assert 10 <= limits["engine"] <= 60  # its table limit (190 s) cut to what the deadline leaves


PROBE = '''
import json, os

def pytest_collection_finish(session):
    rows = [{"nodeid": item.nodeid, "gpu": item.get_closest_marker("gpu") is not None,
             "hypothesis": bool(getattr(getattr(item, "obj", None), "is_hypothesis_test", False)),
             "fixtures": list(getattr(item, "fixturenames", ())),
             "imports_ray": "ray" in vars(item.module)} for item in session.items]
    with open(os.environ["PROBE_OUT"], "w") as f:
        json.dump(rows, f)
'''


@given(st.integers())
def _a_hypothesis_test(_x):
    pass


def test_the_gpu_step_collects_only_gpu_tests_and_no_ray_or_hypothesis_test(tmp_path):
    listed = subprocess.run(["bash", str(SCRIPT), "--print-gpu-tests"], capture_output=True, text=True, timeout=30)
    selection = listed.stdout.split()
    assert selection[:2] == ["-m", "gpu"] and not any(arg.startswith("tests/triton") for arg in selection)
    (tmp_path / "collect_probe.py").write_text(PROBE)
    rows_path = tmp_path / "rows.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)]), "PROBE_OUT": str(rows_path)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider",
                           "-p", "collect_probe", *selection], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(rows_path.read_text())
    assert rows, "the gpu step selects no test"
    assert _a_hypothesis_test.is_hypothesis_test  # the attribute the probe reads is the one hypothesis sets
    assert [r["nodeid"] for r in rows if not r["gpu"]] == []
    assert [r["nodeid"] for r in rows if r["hypothesis"]] == []
    assert [r["nodeid"] for r in rows if "ray_instance" in r["fixtures"] or r["imports_ray"]] == []
    files = {r["nodeid"].split("::")[0] for r in rows}
    assert {"tests/connectors/test_cuda.py", "tests/gpu/test_gpu_engine_parts.py", "tests/gpu/test_gpu_pd.py",
            "tests/gpu/test_device_path_gpu.py"} <= files
