"""The launcher's notice for P/D on one CPU machine (pd.deploy.one_box): when it is given, and what
it says about the box and the planner settings; and that `pd.launch --check-config` prints it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pd.cluster.config import load_deploy_config
from pd.deploy.one_box import SUGGESTED_LOCAL_PREFILL_MAX_TOKENS, one_box_notice, usable_cores

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = load_deploy_config(ROOT / "deploy" / "smollm2.yaml")


def _with(planner: dict | None = None, **topology) -> object:
    config = SMOLLM2
    if topology:
        config = config.replace(topology={**config.to_dict()["topology"], **topology})
    if planner is not None:
        config = config.replace(router={**config.to_dict()["router"], "planner": planner})
    return config


def test_no_notice_where_p_and_d_do_not_share_this_cpu():
    assert one_box_notice(_with(mode="colocated"), 2, workers_here=True) is None
    assert one_box_notice(SMOLLM2, 2, workers_here=False) is None  # a cluster: the launcher cannot see its nodes
    assert one_box_notice(load_deploy_config(ROOT / "deploy" / "smollm2-colocated.yaml"), 2, True) is None


def test_every_prompt_on_p_gets_the_advice_to_keep_short_ones_on_d():
    line = one_box_notice(_with({"mode": "always_disaggregate", "local_prefill_max_tokens": 0}, threads_per_worker=2),
                          2, workers_here=True)
    assert line is not None and line.startswith("notice: 1P1D on one machine's 2 CPU cores (2 threads per worker)")
    assert "\n" not in line
    assert f"local_prefill_max_tokens (e.g. {SUGGESTED_LOCAL_PREFILL_MAX_TOKENS})" in line
    assert "too small" not in line  # two cores for two workers


def test_the_notice_names_what_the_planner_keeps_on_d():
    short = one_box_notice(_with({"local_prefill_max_tokens": 300}), 8, workers_here=True)
    assert short is not None and "at most 300 tokens prefill on D" in short and "longer ones on P" in short
    assert "e.g." not in short
    planned = one_box_notice(_with({"mode": "planner", "local_prefill_max_tokens": 64}), 8, workers_here=True)
    assert planned is not None and "at most 64 tokens" in planned and "predicts" in planned
    assert "per prompt by predicted TTFT" in (one_box_notice(_with({"mode": "planner"}), 8, True) or "")
    assert "P stays idle" in (one_box_notice(_with({"mode": "always_local"}), 8, True) or "")


def test_fewer_cores_than_workers_is_too_small_for_p_d():
    line = one_box_notice(_with(num_prefill=2, num_decode=2), 3, workers_here=True)
    assert line is not None and line.startswith("notice: 2P2D on one machine's 3 CPU cores")
    assert "too small for P/D to pay" in line and "4 workers" in line
    assert "too small" not in (one_box_notice(_with(num_prefill=2, num_decode=2), 4, True) or "")


def test_check_config_prints_the_notice_on_stderr_and_still_succeeds():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-m", "pd.launch", "--config", "deploy/smollm2.yaml", "--check-config"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "deploy/smollm2.yaml: valid"
    notices = [line for line in out.stderr.splitlines() if line.startswith("notice: ")]
    assert notices == [one_box_notice(SMOLLM2, usable_cores(), workers_here=True)]
    colocated = subprocess.run([sys.executable, "-m", "pd.launch", "--config", "deploy/smollm2-colocated.yaml",
                                "--check-config"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert colocated.returncode == 0 and "notice:" not in colocated.stderr, colocated.stderr
