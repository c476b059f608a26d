"""Reading the URL a `python -m pd.launch` subprocess prints once it serves."""
from __future__ import annotations

import re
import subprocess
import time

_SERVING = re.compile(r"serving at (http://\S+)")


def read_launch_url(proc: subprocess.Popen, timeout_s: float) -> str | None:
    """The URL from the launch's stdout, or None if it exits or `timeout_s` passes before printing it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            return None
        match = _SERVING.search(line)
        if match:
            return match.group(1)
    return None
