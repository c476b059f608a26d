"""Reliability tests: fault outcomes are recorded for the fault table of docs/reliability-and-security.md.

With `PDKV_FAULT_REPORT=<path.json>` set, every test that uses the
`fault_record` fixture adds rows (fault, where, what the user saw, what pdkv
did, pools after); the file is written at the end of the session and
`python -m pd.tools.fault_report <path.json>` turns it into a markdown table.
"""
from __future__ import annotations

import fcntl
import json
import os

import pytest

_ROWS: list[dict] = []


@pytest.fixture
def fault_record(request):
    """record(fault=..., where=..., user_saw=..., pdkv_did=..., pools=...) adds one row."""

    def record(**row):
        row.setdefault("test", request.node.nodeid.split("::", 1)[-1])
        _ROWS.append({k: str(v) for k, v in row.items()})

    return record


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("PDKV_FAULT_REPORT")
    if path and _ROWS:
        # each xdist worker ends its own session: the lock keeps one worker's rows from
        # overwriting another's
        with open(path + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            existing = []
            if os.path.exists(path) and os.path.getsize(path):
                with open(path) as f:
                    existing = json.load(f)
            with open(path, "w") as f:
                json.dump(existing + _ROWS, f, indent=1)
