"""A whole P/D deployment in this process, without Ray: real `Worker`s (engine,
ZMQ connector, internal HTTP API) and the real `Router`, on one event-loop
thread, over real loopback HTTP. Fast enough to hammer in the default suite;
process kills need real processes and live in test_ray_faults.py.
"""
from __future__ import annotations

import asyncio
import threading
import time

import torch

from pd.cluster.config import DeployConfig
from pd.router.recovery import RecoverySettings
from pd.router.server import Router
from pd.cluster.roles import Role, WorkerEndpoint
from pd.worker.worker import Worker, WorkerSpec

torch.set_num_threads(1)

SECRET = "local-deploy-secret-0123456789abcdef"
ARCH = {"vocab_size": 260, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
        "num_kv_heads": 2}


def local_config(mode: str = "disaggregated", **overrides) -> DeployConfig:
    data = {
        "model": {"name": "pdkv-tiny", "seed": 0, "architecture": ARCH},
        "cache": {"block_size": 16, "kv_memory_mb": 2},
        "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 1024, "max_model_len": 512},
        "topology": {"mode": mode},
        "transfer": {"lease_s": 5.0, "timeout_s": 3.0},
        "router": {"port": 0, "request_timeout_s": 30.0, "health_interval_s": 0.5},
    }
    config = DeployConfig.from_dict(data)
    return config.replace(**overrides) if overrides else config


class LocalDeployment:
    """Workers + router on a private loop thread; `url` once started. Use as a context manager."""

    def __init__(self, config: DeployConfig, recovery: RecoverySettings | None = None):
        self.config = config
        self.recovery = recovery
        self.workers: dict[str, Worker] = {}
        self.router: Router | None = None
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="local-deploy", daemon=True)

    def run(self, coro, timeout_s: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def __enter__(self) -> LocalDeployment:
        self._thread.start()
        roles = ([("both-0", Role.BOTH)] if self.config.topology.mode.value == "colocated"
                 else [("prefill-0", Role.PREFILL)]
                 + [(f"decode-{i}", Role.DECODE) for i in range(self.config.topology.num_decode)])
        endpoints = []
        for wid, role in roles:
            worker = Worker(WorkerSpec(wid, role, self.config, SECRET))
            self.workers[wid] = worker
            endpoints.append(WorkerEndpoint(wid, role, self.run(worker.start())))
        self.router = Router(self.config, endpoints, SECRET, recovery=self.recovery)
        self.url = self.run(self.router.start())
        return self

    def __exit__(self, *exc) -> None:
        if self.router is not None:
            self.run(self.router.stop())
        for worker in self.workers.values():
            self.run(worker.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def audits(self) -> dict[str, dict]:
        return {wid: w.stats(audit=True)["audit"] for wid, w in self.workers.items()}

    def wait_all_free(self, timeout_s: float = 15.0) -> float:
        """Seconds until every worker's pool audit says all free and consistent (fails after timeout_s)."""
        t0 = time.monotonic()
        while True:
            audits = self.audits()
            if all(a["all_free"] and a["consistent"] for a in audits.values()):
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise AssertionError(f"pools not all free after {timeout_s}s: {audits}")
            time.sleep(0.05)

    def stats(self, wid: str) -> dict:
        return self.workers[wid].stats()
