"""The C++ kernels of the CPU backend (a small extension: the cpu_*.cpp files beside this one).

- `decode_layers` (cpu_kernels.cpp): every decoder layer of a step in one call, for steps of decode
  tokens and of short prompt chunks (norms, RoPE, K/V write, attention and SiLU in C++; the
  projections through the packed-panel GEMM of cpu_gemm.cpp where the compiler targets AVX2 + FMA
  (`packed_gemm_available()`; `packed_gemm_isa()` says "avx512" or "avx2"), from exact 4-bit codes
  where a matrix is one (cpu_q4.cpp), else at::linear);
- `paged_decode_attention` (cpu_attention.cpp): decode queries attending straight through the block
  table, each K and V element read once, no gather and no padding (the per-layer path's decode tokens);
- `packed_linear`, `packed_rows`, `q4_linear`: one projection, or embedding rows, from packed weights;
- `screened_argmax` (cpu_argmax.cpp): greedy tokens through an int8 screen of the lm_head.

Built on first use with torch's cpp_extension (needs a C++ compiler; the build is cached under
~/.cache/pdkv/kernels, see `build_directory()`), for this CPU (`-march=native`; `PDKV_KERNEL_MARCH`
names another target, e.g. `x86-64-v3` to build and test the AVX2 variant on an AVX-512 machine).
When the build fails, `load()` returns None and the engine keeps the torch backend, which is the
reference (pd/engine/runner/selector.py).
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import pathlib
import platform
import subprocess
import sys
import threading
import time

import torch

logger = logging.getLogger(__name__)

# One translation unit, in this order: each file calls those before it (cpu_pool.cpp: the threads'
# chunked loops; cpu_gemm.cpp: the packed GEMM; cpu_q4.cpp: the same GEMM from exact 4-bit codes;
# cpu_argmax.cpp: greedy tokens screened through an int8 lm_head; cpu_attention.cpp; cpu_kernels.cpp:
# the bindings).
_SOURCE_PATHS = [pathlib.Path(__file__).with_name(name)
                 for name in ("cpu_pool.cpp", "cpu_gemm.cpp", "cpu_q4.cpp", "cpu_argmax.cpp", "cpu_attention.cpp",
                              "cpu_kernels.cpp")]

_lock = threading.Lock()
_module = None
_failed = False


_VERSION = "pdkv_paged_decode_v17"  # bump with any change of the kernels' Python-facing signatures
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
_MARCH_ENV = "PDKV_KERNEL_MARCH"  # another -march target than native (e.g. x86-64-v3: the AVX2 build on AVX-512)
BUILD_WAIT_S = 900.0  # another process building the same kernels: wait this long, then use the torch path


def _cflags() -> list[str]:
    march = os.environ.get(_MARCH_ENV, "").strip()
    return [f"-march={march}" if march and flag == "-march=native" else flag for flag in _CFLAGS]


def _compiler_version() -> str:
    compiler = os.environ.get("CXX", "c++")
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return compiler
    return f"{compiler} {done.stdout.splitlines()[0] if done.stdout else ''}"


def _cpu_identity() -> str:
    """The CPU model and its feature flags (what -march=native compiles for)."""
    try:
        with open("/proc/cpuinfo") as handle:
            lines = [line for line in handle if line.startswith(("model name", "flags", "Features"))]
    except OSError:
        return platform.processor()
    firsts = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip() for line in reversed(lines)}
    return "|".join(f"{key}={value}" for key, value in sorted(firsts.items()))


def build_identity() -> list[str]:
    """All a build depends on: the kernels' version and sources, the machine (CPU model and flags, for
    -march=native), the compiler and flags, and the environment it links against (torch's version, C++ ABI
    and install path, Python's version and the interpreter's prefix, i.e. the virtualenv)."""
    sources = hashlib.sha256(b"".join(path.read_bytes() for path in _SOURCE_PATHS)).hexdigest()
    return [_VERSION, sources, platform.machine(), _cpu_identity(), _compiler_version(), " ".join(_cflags()),
            torch.__version__, f"cxx11_abi={int(torch.compiled_with_cxx11_abi())}", os.path.dirname(torch.__file__),
            sys.version.split()[0], sys.prefix]


@functools.cache
def kernel_name() -> str:
    """The build's module name: the kernels' version and a digest of `build_identity()`. Two environments
    (two virtualenvs with the same torch, two machines sharing one home directory) then get two directories
    and never rebuild over each other, and no process loads a build made for another CPU or torch; torch's
    own check covers only the sources and flags, and rebuilds in place when they differ."""
    return f"{_VERSION}_{hashlib.sha256(chr(10).join(build_identity()).encode()).hexdigest()[:12]}"


def build_directory() -> pathlib.Path:
    """Where the kernels are built and cached: `$PDKV_KERNEL_CACHE`, else ~/.cache/pdkv/kernels/<kernel_name()>."""
    root = os.environ.get("PDKV_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdkv", "kernels")
    return pathlib.Path(root) / kernel_name()


@contextlib.contextmanager
def _build_lock(directory: pathlib.Path, wait_s: float):
    """One builder at a time across processes. torch's own lock is a file created with O_EXCL,
    which stays behind when its holder is killed mid-build (a Ctrl-C during the first start), and
    every later start then waits on it forever. An flock dies with its holder; holding it, any
    torch lock file left in the directory is stale and goes."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f"{directory.name}.flock", "w") as handle:
        deadline, logged = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"another process is building {directory} for over {wait_s:.0f} s") from None
                if not logged:
                    logger.info("waiting for another process that builds the fused CPU kernels in %s", directory)
                    logged = True
                time.sleep(0.2)
        try:
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load():
    """The compiled module, or None when it cannot be built here."""
    global _module, _failed
    with _lock:
        if _module is None and not _failed:
            try:
                from torch.utils.cpp_extension import load_inline

                directory, name = build_directory(), kernel_name()
                with _build_lock(directory, BUILD_WAIT_S):
                    if not (directory / f"{name}.so").exists():
                        logger.info("building the fused CPU kernels once into %s (a minute or two)", directory)
                    _module = load_inline(
                        # (the bindings, which release the GIL, are at the end of cpu_kernels.cpp)
                        name=name, cpp_sources=[path.read_text() for path in _SOURCE_PATHS],
                        extra_cflags=_cflags(), extra_ldflags=["-fopenmp"],
                        build_directory=str(directory), verbose=False)
            except Exception as exc:  # noqa: BLE001 - any build problem means "use the torch path"
                logger.warning("fused CPU decode attention unavailable, using the torch path: %s", exc)
                _failed = True
        return _module


def paged_decode_attention(q: torch.Tensor, layer_cache: torch.Tensor, block_table: torch.Tensor,
                           key_start: torch.Tensor, key_end: torch.Tensor, scale: float) -> torch.Tensor:
    """q (B, Hq, D) attends to positions [key_start, key_end) of its request, read through block_table."""
    module = load()
    assert module is not None, "call load() first and fall back when it returns None"
    return module.paged_decode_attention(q.contiguous(), layer_cache, block_table, key_start, key_end, scale)
