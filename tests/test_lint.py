"""ruff and mypy pass on the packages, with the configuration in pyproject.toml.

Both run as `python -m ...` from the repository root, as a developer would; mypy keeps its
cache in the default .mypy_cache there (git-ignored), so a cold run takes tens of seconds and
a warm one a few.
"""
from __future__ import annotations

import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT_S = 240  # a cold mypy run is ~30 s on a loaded 2-core machine


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False)


def test_ruff_check_passes():
    proc = _run("ruff", "check", "--no-cache")
    assert proc.returncode == 0, f"ruff check failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"


def test_mypy_passes():
    proc = _run("mypy")
    assert proc.returncode == 0, f"mypy failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    assert "Success: no issues found" in proc.stdout, proc.stdout
