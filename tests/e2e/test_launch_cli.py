"""`python -m pd.launch` as users run it: embedded Ray, printed URL, clean exits."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import requests

from tests.helpers.e2e import REPO
from tests.helpers.launch_url import read_launch_url

BASE = [sys.executable, "-m", "pd.launch", "--config", "deploy/local.yaml", "--port", "0",
        "--num-cpus", "2", "--object-store-mb", "100", "--log-level", "WARNING"]


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("RAY_ADDRESS", None)  # embedded local Ray
    return env


def test_run_load_prints_report_and_writes_files(tmp_path):
    result_json, plot = tmp_path / "r.json", tmp_path / "p.png"
    out = subprocess.run(BASE + ["--run-load", "--num-prompts", "6", "--result-json", str(result_json),
                                 "--plot", str(plot)],
                         cwd=REPO, env=_env(), capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "serving at http://" in out.stdout and "Serving Benchmark Result (pdkv)" in out.stdout
    assert "KV pools after the run: all free (2 of 2 workers audited)" in out.stdout
    result = json.loads(result_json.read_text())
    assert result["completed"] == 6 and result["failed"] == 0 and "p99_itl_ms" in result and len(result["itls"]) == 6
    assert plot.stat().st_size > 1000


def test_run_load_serves_a_tp_gang_and_audits_every_rank():
    """deploy/local-tp.yaml (P a gang of 2 ranks, D at TP 1) under the default load: every request succeeds
    and the pool audit names every rank of every worker."""
    cmd = [a if a != "deploy/local.yaml" else "deploy/local-tp.yaml" for a in BASE] + ["--run-load"]
    out = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Successful requests:                                      32" in out.stdout
    assert "Failed requests:                                           0" in out.stdout
    assert "KV pools after the run: all free (2 of 2 workers audited, 3 ranks)" in out.stdout


def test_sigterm_shuts_down_cleanly():
    proc = subprocess.Popen(BASE, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = read_launch_url(proc, timeout_s=90)
        assert url, "launch never printed its URL"
        assert requests.get(f"{url}/health", timeout=10).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_bad_config_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("topology:\n  num_prefil: 2\n")
    out = subprocess.run([sys.executable, "-m", "pd.launch", "--config", str(bad)], cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "topology: unknown key(s) ['num_prefil']" in out.stderr


def test_generate_admin_key_prints_a_key_the_config_accepts():
    """`--generate-admin-key` needs no config and prints a fresh key each time that passes the router's
    strength rule (the keys a user pastes into router.admin_key)."""
    from pd.cluster.config import DeployConfig

    keys = [subprocess.run([sys.executable, "-m", "pd.launch", "--generate-admin-key"], cwd=REPO, env=_env(),
                           capture_output=True, text=True, timeout=60).stdout.strip() for _ in range(2)]
    assert keys[0] != keys[1] and all(len(k) >= 32 for k in keys)
    for key in keys:
        assert DeployConfig.from_dict({"router": {"admin_key": key}}).router.admin_key == key
