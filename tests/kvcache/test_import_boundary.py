"""kvcache must import (every module) with torch, ray and zmq unavailable."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import importlib, pkgutil, sys

BLOCKED = ("torch", "ray", "zmq")

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"blocked import of {name}")
        return None

sys.meta_path.insert(0, Blocker())
import kvcache
names = [m.name for m in pkgutil.iter_modules(kvcache.__path__, "kvcache.")]
for name in names:
    importlib.import_module(name)
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
assert not leaked, leaked
print("OK", len(names))
"""


def test_kvcache_imports_without_torch_ray_zmq():
    res = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("OK")


def test_blocker_really_blocks():
    probe = SCRIPT.split("import kvcache")[0] + "import zmq\n"
    res = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "blocked import of zmq" in res.stderr
