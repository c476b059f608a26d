"""A gang's control directory outlives a SIGKILLed rank 0; the next gang on the host removes it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from connectors.zmq.gang.gang_control import GangControl, sweep_stale_dirs

CHILD = """
import sys, time
from connectors.zmq.gang.gang_control import GangControl
control = GangControl(1, parent_dir=sys.argv[1])
print(control._dir, flush=True)
time.sleep(120)
"""


def test_a_killed_rank_zeros_directory_goes_with_the_next_gang_and_nothing_else_does(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        left = child.stdout.readline().strip()
        assert left.startswith(str(tmp_path / f"pdkv-gang-{child.pid}-"))
        assert os.path.exists(os.path.join(left, "control"))  # its ipc socket
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        child.stdout.close()
    assert os.path.isdir(left)  # SIGKILL: nothing ran to remove it
    live = tmp_path / f"pdkv-gang-{os.getpid()}-live"  # a live process's (this one's)
    odd = tmp_path / "pdkv-gang-notapid"
    other = tmp_path / "other"
    for d in (live, odd, other):
        d.mkdir()
    control = GangControl(1, parent_dir=str(tmp_path))
    try:
        assert not os.path.exists(left)
        assert live.is_dir() and odd.is_dir() and other.is_dir()
        assert os.path.basename(control._dir).startswith(f"pdkv-gang-{os.getpid()}-")
    finally:
        control.close()
    assert not os.path.exists(control._dir)
    assert sweep_stale_dirs(str(tmp_path)) == 0  # (only live or foreign names are left)
