"""`python -m pd.launch` ends in under 10 s with no process left, whatever gets the signal:
the leader, the whole process group (systemd's KillMode=control-group) or each process; a
stream in flight ends as a stream (issue 23, finding 9).

The real launcher with its embedded Ray runs in its own session; the test remembers every
descendant while it serves (psutil), signals, then checks the exit time, that none of them
and nothing else of the session is left, and how the running stream ended.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests
from rel_deploy import LocalDeployment, local_config

from tests.helpers.launch_url import read_launch_url

REPO = Path(__file__).resolve().parents[2]
BASE = [sys.executable, "-m", "pd.launch", "--config", "deploy/local.yaml", "--port", "0",
        "--num-cpus", "2", "--object-store-mb", "100", "--log-level", "WARNING"]
EXIT_WITHIN_S = 10.0
# a process killed with SIGKILL is gone in milliseconds; Ray workers that find out by themselves that their
# raylet died take 1-2 s (issue 49)
WORKERS_GONE_S = 0.5


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("RAY_ADDRESS", None)  # embedded local Ray
    return env


def _session_processes(sid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            pass
    return out


def _read_stream(url: str, into: dict, started: threading.Event, max_tokens: int = 1000) -> None:
    """A long stream; `into["lines"]`: its SSE data lines, `into["error"]`: how it broke, if it did."""
    lines: list[bytes] = []
    into["lines"] = lines
    try:
        with requests.post(f"{url}/v1/completions", stream=True, timeout=60,
                           json={"prompt": "a long stream", "max_tokens": max_tokens, "ignore_eos": True,
                                 "stream": True}) as r:
            into["status"] = r.status_code
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    started.set()
    except requests.RequestException as exc:
        into["error"] = repr(exc)
    finally:
        started.set()


# The default suite runs the patterns that hung (SIGTERM to the group, to each process) and Ctrl-C;
# the rest under `-m slow` (each run starts a whole deployment: about 15 s).
CASES = [pytest.param(target, signum, id=f"{target}-{signum.name}",
                      marks=() if (target, signum) in {("group", signal.SIGTERM), ("each", signal.SIGTERM),
                                                       ("leader", signal.SIGINT)} else pytest.mark.slow)
         for target in ("leader", "group", "each") for signum in (signal.SIGTERM, signal.SIGINT)]


@pytest.mark.parametrize("target, signum", CASES)
def test_launch_ends_within_10s_leaving_nothing(target, signum, fault_record, tmp_path):
    err = tmp_path / "launch.err"
    proc = subprocess.Popen(BASE, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=err.open("w"),
                            text=True, start_new_session=True)
    known: dict[int, psutil.Process] = {}
    try:
        url = read_launch_url(proc, timeout_s=240)
        assert url, f"launch never printed its URL (exit {proc.poll()}): {err.read_text()[-3000:]}"
        assert requests.get(f"{url}/health", timeout=30).status_code == 200
        stream: dict = {}
        started = threading.Event()
        reader = threading.Thread(target=_read_stream, args=(url, stream, started), daemon=True)
        reader.start()
        assert started.wait(60), "the stream never started"
        leader = psutil.Process(proc.pid)
        for p in leader.children(recursive=True):
            known[p.pid] = p
        assert len(known) >= 4, known  # Ray's gcs, raylet and the two worker actors at least
        t0 = time.monotonic()
        if target == "leader":
            os.kill(proc.pid, signum)
        elif target == "group":
            os.killpg(os.getpgid(proc.pid), signum)
        else:
            for p in [leader, *known.values()]:
                try:
                    p.send_signal(signum)
                except psutil.NoSuchProcess:
                    pass
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            rc = None
        elapsed = time.monotonic() - t0
        reader.join(30)
        # what the launcher left: every descendant it had, and anything else of its session. They
        # exit asynchronously after the leader (SIGTERM, then SIGKILL at its deadline): each has until
        # EXIT_WITHIN_S after the signal.
        while time.monotonic() < t0 + EXIT_WITHIN_S and any(_alive(p) for p in known.values()):
            time.sleep(0.1)
        left = [p for p in known.values() if _alive(p)]
        left += [p for p in _session_processes(proc.pid) if p.pid not in known and p.pid != proc.pid]
        left_names = sorted(f"{p.pid}:{p.name()}" for p in left if p.is_running())
        assert rc is not None and elapsed < EXIT_WITHIN_S, f"exit {rc} after {elapsed:.1f} s"
        assert rc == 0, rc
        assert not left_names, left_names
        # the stream ended as a stream: its last line is [DONE], never a cut connection
        lines = stream.get("lines", [])
        assert "error" not in stream, stream.get("error")
        assert lines and lines[-1] == b"data: [DONE]", lines[-3:]
        ended = "finished" if b'"error"' not in b"".join(lines) else "error event + [DONE]"
        fault_record(fault=f"{signal.Signals(signum).name} to the {target}" if target != "each"
                     else f"{signal.Signals(signum).name} to each process", where="pd.launch (embedded Ray)",
                     user_saw=f"running stream: {ended}", pdkv_did=f"exited {rc} after {elapsed:.1f} s",
                     pools="no process left")
    finally:
        for p in list(known.values()) + _session_processes(proc.pid):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_router_stop_ends_a_running_stream_as_a_stream():
    """Past its drain time the router's stop ends a running stream with an error event and
    `data: [DONE]` (not a cut connection), and the worker frees its blocks."""
    with LocalDeployment(local_config()) as dep:
        stream: dict = {}
        started = threading.Event()
        reader = threading.Thread(target=_read_stream, args=(dep.url, stream, started, 480), daemon=True)
        reader.start()
        assert started.wait(60), "the stream never started"
        router, dep.router = dep.router, None  # stopped here, not again on exit
        dep.run(router.stop(drain_s=0.0))
        reader.join(30)
        lines = stream["lines"]
        assert "error" not in stream, stream.get("error")
        assert lines[-1] == b"data: [DONE]" and b'"shutting_down"' in lines[-2], lines[-3:]
        dep.wait_all_free()


def _workers_gone_after(proc: subprocess.Popen, known: dict[int, psutil.Process], limit_s: float) -> list[str]:
    """The processes of `known` still alive `limit_s` after the leader and its group are gone."""
    deadline = time.monotonic() + 30
    while _alive(psutil.Process(proc.pid)) if psutil.pid_exists(proc.pid) else False:
        assert time.monotonic() < deadline, "the leader outlived SIGKILL"
        time.sleep(0.01)
    t0 = time.monotonic()
    while time.monotonic() < t0 + limit_s and any(_alive(p) for p in known.values()):
        time.sleep(0.01)
    return sorted(f"{p.pid}:{p.name()}" for p in known.values() if _alive(p))


def test_sigkill_of_the_group_takes_the_ray_workers_with_it(fault_record, tmp_path):
    """`kill -9` of the launcher's process group: Ray's worker processes (each in a process group of
    its own) die with their raylet, not 1-2 s later when they notice it is gone (issue 49, finding 7):
    every worker actor's process is gone within WORKERS_GONE_S of the leader."""
    err = tmp_path / "launch.err"
    proc = subprocess.Popen(BASE, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=err.open("w"),
                            text=True, start_new_session=True)
    known: dict[int, psutil.Process] = {}
    try:
        url = read_launch_url(proc, timeout_s=240)
        assert url, f"launch never printed its URL (exit {proc.poll()}): {err.read_text()[-3000:]}"
        assert requests.get(f"{url}/health", timeout=30).status_code == 200
        known = {p.pid: p for p in psutil.Process(proc.pid).children(recursive=True)}
        workers = [p for p in known.values() if "WorkerActor" in " ".join(p.cmdline()) or "WorkerActor" in p.name()]
        assert len(workers) >= 2, sorted(p.name() for p in known.values())
        assert {os.getpgid(p.pid) for p in workers}.isdisjoint({proc.pid}), "workers in the launcher's group"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        # the worker actors (engines, caches); an idle pre-started Ray worker ran nothing of ours and may linger
        left = _workers_gone_after(proc, {p.pid: p for p in workers}, WORKERS_GONE_S)
        assert not left, left
        fault_record(fault="SIGKILL to the launcher's process group", where="pd.launch (embedded Ray)",
                     user_saw="connection cut", pdkv_did=f"every worker actor gone within {WORKERS_GONE_S} s of the "
                     "leader (they die with their raylet)", pools="no process left")
    finally:
        for p in list(known.values()) + _session_processes(proc.pid):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
