"""The Ray actor that hosts one `pd.worker.worker.Worker` (Ray at the edge only).

Only plain values cross Ray calls (str, bytes, ints): the deployment config
travels as JSON text, answers come back as JSON text. Ray's pickling only
ever sees those, never an object of ours; the data plane (requests, tokens,
KV blocks) does not touch Ray at all: it goes over the worker's HTTP API and
the ZMQ connector.
"""
from __future__ import annotations

import json
import logging
import os

import ray

from pd.cluster.config import DeployConfig
from pd.cluster.roles import Role


@ray.remote(max_restarts=0, max_concurrency=1000)
class WorkerActor:
    """Hosts one `Worker`; every method takes and returns str/int only."""

    def __init__(self, worker_id: str, role: str, config_json: str, secret: str) -> None:
        # PDKV_LOG_LEVEL reaches workers through the environment (pd.deploy.launch sets it for a local Ray).
        logging.basicConfig(level=os.environ.get("PDKV_LOG_LEVEL", "INFO").upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        from pd.worker.worker import Worker, WorkerSpec

        config = DeployConfig.from_json(config_json)
        host = config.transfer.host
        if host in ("auto", "0.0.0.0"):
            host = ray.util.get_node_ip_address()
        self._worker = Worker(WorkerSpec(worker_id, Role(role), config, secret, host))

    async def start(self) -> str:
        url = await self._worker.start()
        return json.dumps({"url": url, "node_id": ray.get_runtime_context().get_node_id()})

    async def health(self) -> str:
        return json.dumps(self._worker.health())

    async def stats(self, audit: bool = False) -> str:
        return json.dumps(self._worker.stats(audit))

    async def stop(self) -> int:
        await self._worker.stop()
        return 0
