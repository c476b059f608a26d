"""The servers the peer benchmark starts and stops (pd/tools/peer_bench/cli.py).

- pdkv: `python -m pd.launch --config deploy/<name>.yaml --port 0` as a user runs it, in its own
  session; the URL is read from its stdout ("serving at http://..."), and SIGTERM stops it
  (the launcher then leaves no process behind; past STOP_TIMEOUT_S its group is killed).
  Worker threads are set to the benchmark's thread count (`pdkv_launch`).
- llama-server: the binary pd.tools.llama_server_build builds, on the F32 GGUF, with continuous
  batching, `--parallel` slots, `-t`/`-tb` threads and `-c` = slots x context per slot, on a
  free loopback port; ready when /health answers 200.
Both write their output to a log file in the run's directory (named in errors).
"""
from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import yaml

REPO = Path(__file__).resolve().parents[3]
_SERVING = re.compile(r"serving at (http://\S+)")
STOP_TIMEOUT_S = 30.0
HEALTH_POLL_S = 0.5
POOL_WAIT_S = 30.0


class ServerStartError(RuntimeError):
    """A server did not come up; the message names its log."""


@dataclass(frozen=True)
class LlamaServerSpec:
    binary: Path
    model: Path
    threads: int
    parallel: int = 32
    ctx_per_slot: int = 512


def _tail(path: Path, num_chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-num_chars:]
    except OSError:
        return ""


def _stop(proc: subprocess.Popen, name: str) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the group is this server's processes only
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
        print(f"warning: {name} did not stop within {STOP_TIMEOUT_S:.0f} s of SIGTERM; killed", file=sys.stderr)


@dataclass(frozen=True)
class PdkvLaunch:
    config_path: Path
    env: dict[str, str]  # added to the launch's environment
    threads_note: str


def pdkv_launch(config_path: Path, threads: int | None, run_dir: Path) -> PdkvLaunch:
    """How to launch `config_path` with `threads` per worker.

    Where the config has `topology.threads_per_worker`, a copy of the YAML sets it. Otherwise the
    launch's environment sets OMP_NUM_THREADS: Ray sets it to 1 in an actor that asks for less than
    one CPU (`cpus_per_worker: 0.5`) unless it is already set, and torch takes its thread count from
    it. `threads` None or 0: the config and Ray decide."""
    from pd.cluster.config import TopologySection

    if not threads:
        return PdkvLaunch(config_path, {}, "as the config and Ray give them")
    if "threads_per_worker" in TopologySection.model_fields:
        data = yaml.safe_load(config_path.read_text())
        data.setdefault("topology", {})["threads_per_worker"] = threads
        out = run_dir / f"{config_path.stem}.threads{threads}.yaml"
        out.write_text(yaml.safe_dump(data, sort_keys=False))
        return PdkvLaunch(out, {}, f"topology.threads_per_worker = {threads}")
    return PdkvLaunch(config_path, {"OMP_NUM_THREADS": str(threads)},
                      f"OMP_NUM_THREADS={threads} (no topology.threads_per_worker in this version; "
                      "as shipped, Ray gives a worker with cpus_per_worker < 1 one thread)")


class PdkvServer:
    """One pdkv deployment, launched as a subprocess; a context manager giving its URL."""

    def __init__(self, launch: PdkvLaunch, run_dir: Path, start_timeout_s: float = 600.0) -> None:
        self.config_path = launch.config_path
        self.extra_env = launch.env
        self.log_path = run_dir / f"pdkv-{self.config_path.stem}.log"
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None

    def __enter__(self) -> str:
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)  # an embedded Ray instance of its own
        env.pop("OMP_NUM_THREADS", None)
        env.update(self.extra_env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pd.launch", "--config", str(self.config_path), "--port", "0",
             "--log-level", "WARNING"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True)
        found = threading.Event()
        threading.Thread(target=self._drain, args=(found,), name="pdkv-log", daemon=True).start()
        deadline = time.monotonic() + self.start_timeout_s
        while not found.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise ServerStartError(f"pdkv ({self.config_path}) did not print its URL "
                                       f"(log {self.log_path}):\n{_tail(self.log_path)}")
        assert self.url is not None
        return self.url

    def _drain(self, found: threading.Event) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with open(self.log_path, "w") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                match = _SERVING.search(line)
                if match and not found.is_set():
                    self.url = match.group(1)
                    found.set()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            _stop(self.proc, f"pdkv ({self.config_path.name})")
            self.proc = None


async def pool_audits(session: aiohttp.ClientSession, url: str, timeout_s: float = POOL_WAIT_S) -> dict:
    """Every healthy worker's KV pool audit (`/pd/workers?refresh=1`), polled until all are free
    and consistent or `timeout_s` passes (a P worker frees its blocks a moment after D's pull)."""
    deadline = time.monotonic() + timeout_s
    audits: dict = {}
    while True:
        try:
            async with session.get(f"{url}/pd/workers", params={"refresh": "1"},
                                   timeout=aiohttp.ClientTimeout(total=15)) as resp:
                if resp.status == 200:
                    body = await resp.json()
                    audits = {wid: (w.get("stats") or {}).get("audit") or {} for wid, w in body.items() if w["healthy"]}
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            audits = {"error": {"detail": f"{type(exc).__name__}: {exc}"}}
        if (audits and all(a.get("all_free") and a.get("consistent") for a in audits.values())) \
                or time.monotonic() > deadline:
            return audits
        await asyncio.sleep(0.5)


def describe_pools(audits: dict) -> str:
    if not audits:
        return "KV pools after the run: no audit"
    bad = {wid: a.get("detail") or a for wid, a in audits.items() if not (a.get("all_free") and a.get("consistent"))}
    if not bad:
        return f"KV pools after the run: all free ({len(audits)} workers audited)"
    return f"KV pools after the run: NOT all free: {bad}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def llama_server_command(spec: LlamaServerSpec, port: int) -> list[str]:
    return [str(spec.binary), "-m", str(spec.model), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(spec.threads), "-tb", str(spec.threads), "--parallel", str(spec.parallel),
            "-c", str(spec.parallel * spec.ctx_per_slot), "--cont-batching", "--jinja", "-ngl", "0"]


class LlamaServer:
    """llama.cpp's server on the F32 GGUF; a context manager giving its URL."""

    def __init__(self, spec: LlamaServerSpec, run_dir: Path, start_timeout_s: float = 180.0) -> None:
        self.spec = spec
        self.log_path = run_dir / "llama-server.log"
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> str:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(llama_server_command(self.spec, port), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise ServerStartError(f"llama-server did not become healthy (log {self.log_path}):\n"
                                       f"{_tail(self.log_path)}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2.0) as resp:
                    if resp.status == 200:
                        return url
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(HEALTH_POLL_S)

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            _stop(self.proc, "llama-server")
            self.proc = None


def run_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="pdkv-peer-bench-"))
