"""The fused CPU kernels' build cache survives a builder that was killed mid-build.

torch's cpp_extension guards a build with a lock file created O_EXCL; a process killed while
building (a Ctrl-C during the first start) leaves it behind, and every later process used to
wait on it forever. `cpu_kernels.load()` takes an flock instead (released when its holder dies)
and clears such a file. The tests use the real cache (built once here if need be: a copy would be
rebuilt, since torch's build file names its directory) with a stale torch lock left in it, or
an empty cache whose flock another process holds, and load from a fresh process.
"""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys

import pytest

from pd.engine.cpu import kernels as cpu_kernels

LOAD = "from pd.engine.cpu import kernels as cpu_kernels; m = cpu_kernels.load(); print('loaded' if m is not None else 'none')"


@pytest.fixture(scope="module")
def built_cache():
    if cpu_kernels.load() is None:
        pytest.skip("the fused CPU kernels cannot be built here (no compiler?)")
    return cpu_kernels.build_directory()


def _load_in_child(cache_root, timeout_s: float, wait_s: float | None = None) -> str:
    code = LOAD if wait_s is None else f"from pd.engine.cpu import kernels as cpu_kernels; cpu_kernels.BUILD_WAIT_S = {wait_s}; " \
        + LOAD.split("; ", 1)[1]
    env = dict(os.environ, PDKV_KERNEL_CACHE=str(cache_root))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_stale_torch_lock_does_not_block_the_next_start(built_cache):
    (built_cache / "lock").touch()  # what a builder killed mid-build leaves
    assert _load_in_child(built_cache.parent, timeout_s=240) == "loaded"
    assert not (built_cache / "lock").exists()


def test_a_live_builder_is_waited_for_within_a_bound(tmp_path):
    """While another process holds the build lock, a start waits at most BUILD_WAIT_S, then serves on
    the torch path (load() gives None) instead of hanging. (A cache of its own: holding the real one's
    lock would stall every other pdkv process starting on this machine meanwhile.)"""
    directory = tmp_path / cpu_kernels.build_directory().name
    directory.mkdir()
    with open(tmp_path / f"{directory.name}.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        assert _load_in_child(tmp_path, timeout_s=120, wait_s=1.0) == "none"
    assert not (directory / f"{directory.name}.so").exists()  # it gave up: nothing was built
