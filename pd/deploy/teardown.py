"""A launcher's shutdown that ends, whatever was signalled: the leader alone, its whole process
group (systemd's `KillMode=control-group`, most supervisors) or each process one by one.

`ShutdownGuard` guarantees:
- the first SIGINT or SIGTERM asks for a clean stop (`requested` is set); a second one (any
  of the two) ends the process at once, after killing every process it started;
- `track()` remembers every descendant process (by pid and start time, so a reused pid is
  never killed); with the leader a child subreaper (Linux), processes orphaned when Ray's
  raylet dies first are re-parented to it and stay found;
- `run_bounded(fn, deadline)` runs the clean stop in a thread and returns once it is done or
  the deadline passed; `kill_remaining()` then ends every remembered process still alive
  (SIGTERM, a short grace, SIGKILL) and reaps it.
Nothing here needs psutil: it reads /proc (elsewhere it only kills what the OS reports as
children, i.e. nothing; the clean stop still runs).

What no handler can catch (SIGKILL of the launcher or of its whole process group) ends the
launcher, Ray's gcs and raylet at once, but not the Ray worker processes: Ray puts each in a
process group of its own, and they notice their raylet is gone only 1-2 s later, long enough to
go on writing files (a model cache). `die_with_parent`, Ray's worker process setup hook in an
embedded Ray (pd.deploy.launch.init_ray), has the kernel SIGKILL each worker the moment its
parent, the raylet, dies.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
KILL_GRACE_S = 0.5


def become_subreaper() -> bool:
    """Orphans of our descendants re-parent to this process (Linux prctl); False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent() -> bool:
    """This process gets SIGKILL the moment its parent dies (Linux prctl); False elsewhere. A parent
    gone before the call already (we were re-parented) ends this process at once."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent died between the two reads: the kernel will not signal now
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live, non-zombie process; None otherwise."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) "
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """Every live descendant of `root`: pid -> start time."""
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return {}
    children: dict[int, list[tuple[int, int]]] = {}
    for pid in pids:
        st = _stat(pid)
        if st is not None:
            children.setdefault(st[0], []).append((pid, st[1]))
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        for pid, started in children.get(todo.pop(), []):
            if pid not in found:
                found[pid] = started
                todo.append(pid)
    return found


def _alive(pid: int, started: int) -> bool:
    st = _stat(pid)
    return st is not None and st[1] == started


def _reap_zombies() -> None:
    """Collects exited children (as a subreaper, orphans' exits come here too)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


class ShutdownGuard:
    """Signals, descendant tracking and a bounded stop for the launcher's main thread."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self._known: dict[int, int] = {}
        self._lock = threading.RLock()  # re-entered when a second signal lands during kill_remaining
        self.subreaper = False

    def install(self) -> None:
        """Becomes a subreaper and takes SIGINT and SIGTERM; idempotent (call it again after
        anything that installs handlers of its own, such as ray.init)."""
        self.subreaper = self.subreaper or become_subreaper()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        if not self.requested.is_set():
            self.requested.set()
            return
        # a second signal: the user or the supervisor will not wait for the clean stop
        os.write(2, b"pdkv: second signal, stopping now\n")
        self.kill_remaining()
        os._exit(128 + signum)

    def track(self) -> None:
        """Remembers every current descendant (call it while serving, and before the stop)."""
        found = descendants(os.getpid())
        with self._lock:
            self._known.update(found)

    def run_bounded(self, fn: Callable[[], None], deadline: float) -> bool:
        """Runs `fn` in a daemon thread until it returns or `deadline` (time.monotonic) passes;
        True when it finished."""
        done = threading.Event()

        def run() -> None:
            try:
                fn()
            except Exception:  # noqa: BLE001 - a failed clean stop still ends in kill_remaining
                logger.exception("clean stop failed")
            finally:
                done.set()

        threading.Thread(target=run, name="pd-stop", daemon=True).start()
        while not done.wait(0.1):
            self.track()  # processes started or orphaned meanwhile are found too
            if time.monotonic() > deadline:
                logger.warning("clean stop did not finish in time; killing what is left")
                return False
        return True

    def kill_remaining(self, grace_s: float = KILL_GRACE_S) -> int:
        """SIGTERM then (after `grace_s`) SIGKILL to every remembered process still alive;
        returns how many there were."""
        self.track()
        with self._lock:
            alive = {pid: started for pid, started in self._known.items() if _alive(pid, started)}
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid, started in alive.items():
                if _alive(pid, started):
                    try:
                        os.kill(pid, sig)
                    except OSError:
                        pass
            end = time.monotonic() + grace_s
            while time.monotonic() < end and any(_alive(p, s) for p, s in alive.items()):
                _reap_zombies()
                time.sleep(0.05)
        _reap_zombies()
        return len(alive)
