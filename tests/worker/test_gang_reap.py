"""Reaping an earlier gang's followers (`pd.worker.gang.reap`), on real processes: a recorded process
still alive is SIGKILLed and waited for; a recorded pid that now names another process (a different
start time: the pid was reused) is left alone; a missing or unreadable record is no error."""
from __future__ import annotations

import json
import subprocess
import sys

import psutil

from pd.worker.gang import pid_file, reap


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def test_reap_kills_the_recorded_followers_and_spares_a_reused_pid(tmp_path):
    old, other = _sleeper(), _sleeper()
    try:
        record = tmp_path / "gang.json"
        started = psutil.Process(old.pid).create_time()
        record.write_text(json.dumps([{"pid": old.pid, "started": started},
                                      {"pid": other.pid, "started": started - 100.0}]))  # not the recorded one
        assert reap(record, timeout_s=10) == 1
        assert old.wait(timeout=10) == -9  # SIGKILLed (and gone before reap returned: only the reaping is left)
        assert other.poll() is None and not record.exists()
    finally:
        for proc in (old, other):
            proc.kill()
            proc.wait()


def test_nothing_recorded_or_a_bad_record_reaps_nothing(tmp_path):
    assert reap(tmp_path / "absent.json") == 0
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert reap(bad) == 0
    bad.write_text(json.dumps([{"pid": "x"}, 7, {"started": 1.0}]))
    assert reap(bad) == 0


def test_each_worker_and_deployment_has_its_own_record():
    files = {pid_file(w, s) for w in ("prefill-0", "decode-0") for s in ("a" * 32, "b" * 32)}
    assert len(files) == 4 and all(f.name.startswith("pdkv-gang-") for f in files)
