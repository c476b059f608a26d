"""Helpers for connector tests: a KV peer in its own process (see peer_proc.py)."""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys

# run as a module from the repository root, so that it imports this checkout's packages
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECRET = "test-secret-0123456789abcdef"
BLOCK_SIZE = 16
DEFAULT_GROUPS = [{}, {"heads": 2}]  # two distinct full-attention groups (pages of 8 and 16 KiB)


class PeerProc:
    """One peer process; `call` sends a command and waits (bounded) for its reply."""

    def __init__(self, **init):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.peer_proc"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=None, text=True, env=env, cwd=REPO)
        init.setdefault("secret", SECRET)
        init.setdefault("block_size", BLOCK_SIZE)
        init.setdefault("head_size", 64)
        init.setdefault("num_blocks", 128)
        init.setdefault("groups", DEFAULT_GROUPS)
        info = self.call("init", timeout_s=60, **init)
        self.port, self.data_port = info["port"], info["data_port"]
        self.engine_id = init["engine_id"]

    def call(self, cmd: str, timeout_s: float = 30, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            raise TimeoutError(f"peer did not answer {cmd!r} within {timeout_s}s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer exited during {cmd!r} (rc={self.proc.poll()})")
        out = json.loads(line)
        if not out.pop("ok"):
            raise AssertionError(f"peer {cmd!r} failed: {out['error']}\n{out.get('trace', '')}")
        return out

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout_s=10)
            except Exception:
                pass
            self.proc.kill()
        self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


