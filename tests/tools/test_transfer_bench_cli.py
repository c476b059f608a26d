"""`python -m pd.tools.transfer_bench` end to end, small: its producer child reports its ports as JSON,
every path's pages land exact (the bench refuses otherwise), and --staged runs the staging ring."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.parametrize("extra, paths", [([], ["tcp", "shm"]), (["--staged"], ["tcp", "shm_staged"])])
def test_bench_reports_every_path_from_exact_pages(extra, paths):
    cmd = [sys.executable, "-m", "pd.tools.transfer_bench", "--blocks", "12", "--page-kib", "16", "--reps", "2",
           "--runs", "1", "--json", "--paths", ",".join(paths), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["path"] for r in rows] == paths
    assert [r["taken"] for r in rows] == [["tcp"], ["shm_staged" if extra else "shm_mapped"]]  # the code's words
    for r in rows:
        assert r["blocks"] == 12 and r["page_bytes"] == 16 * 1024 and r["gbps"] > 0 and r["raw_gbps"] > 0
