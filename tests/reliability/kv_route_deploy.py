"""xPyD in this process for the KV routing tests: real Workers (engine, ZMQ connector,
KV event publisher, HTTP API) and the real Router with its KV index, over loopback."""
from __future__ import annotations

import collections
import time

import requests

from rel_deploy import SECRET, LocalDeployment
from pd.cluster.roles import Role, WorkerEndpoint
from pd.router.kv_index import IndexState
from pd.router.server import Router
from pd.worker.kv_events import cached_copies
from pd.worker.worker import Worker, WorkerSpec


class KVDeployment(LocalDeployment):
    """`num_prefill` P + `num_decode` D workers (or `num_colocated` BOTH) and a router with `policy`."""

    def __init__(self, config, num_prefill=2, num_decode=2, policy="prefix_aware", **router_kwargs):
        super().__init__(config)
        colocated = config.topology.mode.value == "colocated"
        self.roles = ([(f"both-{i}", Role.BOTH) for i in range(num_prefill)] if colocated else
                      [(f"prefill-{i}", Role.PREFILL) for i in range(num_prefill)]
                      + [(f"decode-{i}", Role.DECODE) for i in range(num_decode)])
        self.policy = policy
        self.router_kwargs = router_kwargs
        self.ports: dict[str, int] = {}

    def __enter__(self):
        self._thread.start()
        endpoints = []
        for wid, role in self.roles:
            worker = Worker(WorkerSpec(wid, role, self.config, SECRET))
            self.workers[wid] = worker
            url = self.run(worker.start())
            self.ports[wid] = int(url.rsplit(":", 1)[1])
            endpoints.append(WorkerEndpoint(wid, role, url))
        self.router = Router(self.config, endpoints, SECRET, policy=self.policy, **self.router_kwargs)
        self.url = self.run(self.router.start())
        self.wait_exact()
        return self

    def restart(self, wid: str) -> None:
        """Stops a worker and starts a fresh one under the same name and HTTP port."""
        old = self.workers[wid]
        self.run(old.stop())
        worker = Worker(WorkerSpec(wid, old.spec.role, self.config, SECRET))
        self.workers[wid] = worker
        self.run(worker.start(self.ports[wid]))

    def complete(self, prompt: str, max_tokens: int = 3, timeout_s: float = 30.0) -> dict:
        """One non-streamed completion through the router; asserts it was answered 200."""
        r = requests.post(self.url + "/v1/completions", timeout=timeout_s,
                          json={"model": "pdkv-tiny", "prompt": prompt, "max_tokens": max_tokens})
        assert r.status_code == 200, r.text
        return r.json()

    def counter(self, name: str, **labels) -> float:
        """The sum of the router's samples called `name` whose labels include `labels`."""
        return sum(s.value for m in self.router.metrics.registry.collect() for s in m.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    @property
    def index(self):
        return self.router.kv_index

    def wait_exact(self, timeout_s: float = 10.0) -> None:
        """Until every worker's index entry is EXACT and at the worker's published seq."""
        deadline = time.monotonic() + timeout_s
        while True:
            lagging = {}
            for wid, worker in self.workers.items():
                seq = worker.kv_events.seq
                d = self.index.describe(wid)
                if d is None or d["state"] != IndexState.EXACT.value or d["seq"] != seq:
                    lagging[wid] = (d, seq)
            if not lagging:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"index not caught up after {timeout_s}s: {lagging}")
            time.sleep(0.02)

    def cached_hashes(self, wid: str) -> dict[int, set[bytes]]:
        """The worker's actual prefix cache, read from its block pool between steps."""
        return {g: set(hs) for g, hs in self.cached_copies(wid).items()}

    def cached_copies(self, wid: str) -> dict[int, dict[bytes, int]]:
        """The worker's prefix cache with how many blocks hold each hash (its block pool, between steps)."""
        engine = self.workers[wid]._engine
        groups = engine.kv_snapshot(lambda groups: cached_copies(engine, groups))
        return {g: dict(collections.Counter(hs)) for g, hs in groups.items() if hs}
