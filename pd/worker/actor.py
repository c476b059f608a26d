"""The Ray actor that hosts one `pd.worker.worker.Worker` (Ray at the edge only).

Only plain values cross Ray calls (str, bytes, ints): the deployment config
travels as JSON text, answers come back as JSON text. Ray's pickling only
ever sees those, never an object of ours; the data plane (requests, tokens,
KV blocks) does not touch Ray at all: it goes over the worker's HTTP API and
the ZMQ connector.

Restarts: a worker process that dies (SIGKILL, OOM, its engine's step loop
dying or a device fault in a step, either of which ends the process after
`DEATH_GRACE_S` so that callers get their error events first) is restarted by Ray up to `MAX_RESTARTS` times, with the
same worker id, role and config. The new incarnation builds a fresh engine
(a fresh engine id, empty cache) and listens on a new port once `start()` is
called again; `pd.deploy.restarts` does that and tells the router.

Tensor parallelism: with its role's TP above 1 the actor is rank 0 of a gang (`pd.worker.gang`): it
is given its placement group's name (`gang_group`, a string) and, in `start()`, creates the other
ranks there. A rank that dies takes the whole worker down the same way (unhealthy at once, the
process exits after `DEATH_GRACE_S`), and the restarted actor builds a new gang.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import threading

import ray

from pd.cluster.config import DeployConfig
from pd.cluster.roles import Role

logger = logging.getLogger(__name__)

MAX_RESTARTS = 10
DEATH_GRACE_S = 1.0
DEATH_EXIT_CODE = 70  # EX_SOFTWARE


def _exit_process(worker_id: str) -> None:
    logger.error("worker %s: exiting so that Ray restarts it", worker_id)
    logging.shutdown()
    os._exit(DEATH_EXIT_CODE)


def _exit_after_engine_death(worker_id: str):
    """The engine's death callback (runs on the engine's thread): the health endpoint answers 503
    meanwhile, so in-flight error events reach their callers; then a clean slate. A plain function,
    not an actor method: every method of the actor is a Ray call taking plain values only."""
    def engine_died(exc: BaseException) -> None:
        threading.Timer(DEATH_GRACE_S, _exit_process, (worker_id,)).start()
    return engine_died


@ray.remote(max_restarts=MAX_RESTARTS, max_task_retries=0, max_concurrency=1000)
class WorkerActor:
    """Hosts one `Worker`; every method takes and returns str/int only."""

    def __init__(self, worker_id: str, role: str, config_json: str, secret: str, gang_group: str = "") -> None:
        # PDKV_LOG_LEVEL reaches workers through the environment (pd.deploy.launch sets it for a local Ray).
        logging.basicConfig(level=os.environ.get("PDKV_LOG_LEVEL", "INFO").upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        from pd.worker.worker import Worker, WorkerSpec

        config = DeployConfig.from_json(config_json)
        host = config.transfer.host
        if host in ("auto", "0.0.0.0"):
            host = ray.util.get_node_ip_address()
        self._worker_id = worker_id
        tp = config.topology.tp_of(role)
        gang = None
        if tp > 1:
            from pd.worker.gang import Gang

            gang = Gang(worker_id, role, config_json, secret, host, tp, gang_group)
        self._worker = Worker(WorkerSpec(worker_id, Role(role), config, secret, host),
                              on_engine_death=_exit_after_engine_death(worker_id), gang=gang)
        self._url: str | None = None
        self._start_lock = asyncio.Lock()  # (binds to Ray's actor loop at first use)

    async def start(self) -> str:
        """Starts the worker (once per incarnation; later calls answer the same) and says where it is."""
        async with self._start_lock:
            if self._url is None:
                self._url = await self._worker.start()
        return json.dumps({"url": self._url, "node_id": ray.get_runtime_context().get_node_id(),
                           "pid": os.getpid()})

    async def health(self) -> str:
        return json.dumps(self._worker.health())

    async def stats(self, audit: bool = False) -> str:
        return json.dumps(self._worker.stats(audit))

    async def stop(self) -> int:
        await self._worker.stop()
        return 0
