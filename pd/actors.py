"""Ray hosting for P/D workers: one async actor per `pd.worker.Worker`.

Only plain values cross Ray calls (str, bytes, ints): the deployment config
travels as JSON text, answers come back as JSON text. Ray's pickling only
ever sees those, never an object of ours; the data plane (requests, tokens,
KV blocks) does not touch Ray at all — it goes over the worker's HTTP API and
the ZMQ connector.

Guarantees: GPU workers ask Ray for `num_gpus=1`, CPU workers for the
fraction of a CPU in `topology.cpus_per_worker`; workers spread over nodes
when the cluster has several; `start_workers` either returns every worker
started or stops those it started and raises.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os

import ray

from pd.deploy_config import DeployConfig, Mode
from pd.routing import Role, WorkerEndpoint

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 180.0
CALL_TIMEOUT_S = 10.0


@ray.remote(max_restarts=0, max_concurrency=1000)
class WorkerActor:
    """Hosts one `Worker`; every method takes and returns str/int only."""

    def __init__(self, worker_id: str, role: str, config_json: str, secret: str) -> None:
        # PDKV_LOG_LEVEL reaches workers through the environment (pd.launch sets it for a local Ray).
        logging.basicConfig(level=os.environ.get("PDKV_LOG_LEVEL", "INFO").upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        from pd.worker import Worker, WorkerSpec

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

    async def stats(self) -> str:
        return json.dumps(self._worker.stats())

    async def stop(self) -> int:
        await self._worker.stop()
        return 0


@dataclasses.dataclass
class StartedWorker:
    endpoint: WorkerEndpoint
    actor: ray.actor.ActorHandle


def worker_roles(config: DeployConfig) -> list[tuple[str, Role]]:
    """(worker id, role) for every worker the topology asks for."""
    topo = config.topology
    if topo.mode is Mode.COLOCATED:
        return [(f"both-{i}", Role.BOTH) for i in range(topo.num_colocated)]
    return [(f"prefill-{i}", Role.PREFILL) for i in range(topo.num_prefill)] + \
           [(f"decode-{i}", Role.DECODE) for i in range(topo.num_decode)]


def actor_options(config: DeployConfig) -> dict:
    """Ray resources of one worker; SPREAD places workers on distinct nodes where it can."""
    num_gpus = 1 if config.topology.device == "cuda" else 0
    return {"num_cpus": config.topology.cpus_per_worker, "num_gpus": num_gpus, "scheduling_strategy": "SPREAD"}


def start_workers(config: DeployConfig, secret: str, timeout_s: float = START_TIMEOUT_S) -> list[StartedWorker]:
    """Starts every worker of the topology as an actor and waits for their URLs."""
    config_json = config.to_json()
    roles = worker_roles(config)
    actors = [WorkerActor.options(**actor_options(config)).remote(wid, role.value, config_json, secret)
              for wid, role in roles]
    try:
        answers = ray.get([a.start.remote() for a in actors], timeout=timeout_s)
    except Exception:
        stop_workers(actors)
        raise
    started = []
    for (wid, role), actor, answer in zip(roles, actors, answers):
        info = json.loads(answer)
        started.append(StartedWorker(WorkerEndpoint(wid, role, info["url"], info["node_id"]), actor))
        logger.info("worker %s (%s) on node %s at %s", wid, role.value, info["node_id"][:8], info["url"])
    return started


def stop_workers(actors: list, timeout_s: float = CALL_TIMEOUT_S) -> None:
    """Asks each actor to stop cleanly, then kills it; never raises for an already dead actor."""
    refs = []
    for actor in actors:
        try:
            refs.append(actor.stop.remote())
        except Exception:  # noqa: BLE001 - a dead actor cannot be asked
            pass
    if refs:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for ref in ready:
            try:
                ray.get(ref, timeout=0)
            except Exception as exc:  # noqa: BLE001 - already dead is fine
                logger.debug("worker stop: %s", exc)
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001
            pass
