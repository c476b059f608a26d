"""A deployment for benchmarks: workers each in a process of its own, pinned to given cores, and the
real Router in the benchmark's process (used by `pd.tools.pd_bench`, `pd.tools.planner_bench` and
`pd.tools.route_bench`)."""
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

from pd.cluster.config import DeployConfig
from pd.cluster.roles import Role, WorkerEndpoint
from pd.router.server import Router
from pd.worker.process_env import worker_env

REPO = Path(__file__).resolve().parents[2]
SECRET = "pd-bench-secret-0123456789abcdef0123"
WORKER_START_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class WorkerPlan:
    worker_id: str
    role: Role
    cpus: tuple[int, ...] | None
    threads: int


class PinnedDeployment:
    """Workers in processes of their own (`pd.tools.pinned_worker`: the real Worker, its engine, ZMQ
    connector and HTTP API, pinned to the cores of its plan) and the real Router here, on a private
    event-loop thread; a context manager that stops all of it."""

    def __init__(self, config: DeployConfig, plans: list[WorkerPlan], label: str,
                 router_options: dict | None = None) -> None:
        self.config = config
        self.plans = plans
        self.router_options = router_options or {}  # Router keywords: `policy`, `policy_options`
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=f"router-{label}", daemon=True)
        self.procs: list[subprocess.Popen] = []
        self.router: Router | None = None
        self.url = ""

    def run(self, coro, timeout_s: float = 1800.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def _spawn(self, plan: WorkerPlan) -> subprocess.Popen:
        env = {**os.environ, **worker_env(),
               "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), *sys.path) if p)}
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

    def __enter__(self) -> PinnedDeployment:
        try:
            self.thread.start()
            plans = self.plans
            procs = [self._spawn(plan) for plan in plans]
            endpoints = [WorkerEndpoint(plan.worker_id, plan.role, _read_url(proc, WORKER_START_TIMEOUT_S))
                         for plan, proc in zip(plans, procs, strict=True)]
            self.router = Router(self.config, endpoints, SECRET, **self.router_options)
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
