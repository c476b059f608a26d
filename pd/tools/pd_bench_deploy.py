"""The deployments `pd.tools.pd_bench` compares, each worker in a process of its own, pinned.

- `colocated`: one worker (role both) on both cores, with two torch threads;
- `1p1d` (and `1p1d-<streaming>` where the config has `transfer.streaming`): P on one core and
  D on the other, one torch thread each: the same cores and total threads as colocated.
Per link: `loopback` (the shipped `data_path: auto`, shared memory on one host) and
`emulated` (`transfer.emulated_link`: tcp through a relay of the given bandwidth and latency).
The real Router runs in the benchmark's process (on a private event-loop thread, unpinned,
the same for every deployment), and loopback HTTP joins it to the workers.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import select
import subprocess
import sys
import threading
from pathlib import Path

from pd.cluster.config import DeployConfig, TransferSection, load_deploy_config
from pd.cluster.roles import Role, WorkerEndpoint
from pd.router.server import Router

REPO = Path(__file__).resolve().parents[2]
SECRET = "pd-bench-secret-0123456789abcdef0123"
WORKER_START_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class Variant:
    """One deployment of the comparison."""

    name: str  # e.g. colocated, 1p1d, 1p1d-chunk
    link: str  # loopback or emulated (colocated: no link)
    streaming: str | None = None  # transfer.streaming, where the config has it

    @property
    def label(self) -> str:
        return self.name if self.name == "colocated" else f"{self.name} {self.link}"


def streaming_modes() -> tuple[str, ...]:
    """The `transfer.streaming` modes beside `off` this version has (none before streaming exists)."""
    if "streaming" not in TransferSection.model_fields:
        return ()
    return ("chunk", "layer")


def variants(links: tuple[str, ...]) -> list[Variant]:
    out = [Variant("colocated", "none")]
    for link in links:
        out.append(Variant("1p1d", link, "off" if streaming_modes() else None))
        out += [Variant(f"1p1d-{mode}", link, mode) for mode in streaming_modes()]
    return out


def deploy_config(variant: Variant, base: Path, bandwidth_mbps: float, latency_ms: float) -> DeployConfig:
    data = json.loads(load_deploy_config(base).to_json())
    data["topology"]["mode"] = "colocated" if variant.name == "colocated" else "disaggregated"
    data["router"].update(port=0, request_timeout_s=600.0, max_queued_requests=1024, health_interval_s=1.0)
    data["cache"]["kv_memory_mb"] = 512  # room for two chat streams beside two 2k-token documents
    data["scheduler"]["max_model_len"] = 2304
    data["transfer"].update(timeout_s=60.0, lease_s=60.0)
    if variant.link == "emulated":
        data["transfer"].update(data_path="tcp", emulated_link={"bandwidth_mbps": bandwidth_mbps,
                                                                "latency_ms": latency_ms})
    if variant.streaming is not None:
        data["transfer"]["streaming"] = variant.streaming
    return DeployConfig.from_dict(data)


def core_pair() -> tuple[int, int] | None:
    """Two cores this process may use (P on the first, D on the second), or None."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    return (cpus[0], cpus[1]) if len(cpus) >= 2 else None


@dataclasses.dataclass(frozen=True)
class WorkerPlan:
    worker_id: str
    role: Role
    cpus: tuple[int, ...] | None
    threads: int


def worker_plans(variant: Variant) -> list[WorkerPlan]:
    cores = core_pair()
    if variant.name == "colocated":
        return [WorkerPlan("colocated-0", Role.BOTH, cores, 2)]
    return [WorkerPlan("prefill-0", Role.PREFILL, cores[:1] if cores else None, 1),
            WorkerPlan("decode-0", Role.DECODE, cores[1:] if cores else None, 1)]


class Deployment:
    """A variant's workers (`pd.tools.pinned_worker` processes) and its Router; a context manager."""

    def __init__(self, variant: Variant, config: DeployConfig) -> None:
        self.variant = variant
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=f"router-{variant.label}", daemon=True)
        self.procs: list[subprocess.Popen] = []
        self.router: Router | None = None
        self.url = ""

    def run(self, coro, timeout_s: float = 1800.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def _spawn(self, plan: WorkerPlan) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), *sys.path) if p)}
        proc = subprocess.Popen([sys.executable, "-m", "pd.tools.pinned_worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env, text=True, cwd=REPO)
        self.procs.append(proc)
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"worker_id": plan.worker_id, "role": plan.role.value,
                                     "config": self.config.to_json(), "secret": SECRET,
                                     "cpus": list(plan.cpus) if plan.cpus else None,
                                     "threads": plan.threads}) + "\n")
        proc.stdin.flush()
        return proc

    def __enter__(self) -> Deployment:
        try:
            self.thread.start()
            plans = worker_plans(self.variant)
            procs = [self._spawn(plan) for plan in plans]
            endpoints = [WorkerEndpoint(plan.worker_id, plan.role, _read_url(proc, WORKER_START_TIMEOUT_S))
                         for plan, proc in zip(plans, procs, strict=True)]
            self.router = Router(self.config, endpoints, SECRET)
            self.url = self.run(self.router.start(), 60.0)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.router is not None:
            with contextlib.suppress(Exception):
                self.run(self.router.stop(), 60.0)
            self.router = None
        for proc in self.procs:
            with contextlib.suppress(OSError):
                assert proc.stdin is not None
                proc.stdin.close()  # the worker's cue to stop
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.procs.clear()
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


def _read_url(proc: subprocess.Popen, timeout_s: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    if not line:
        raise RuntimeError(f"a bench worker gave no URL within {timeout_s:.0f} s (exit code {proc.poll()})")
    return json.loads(line)["url"]
