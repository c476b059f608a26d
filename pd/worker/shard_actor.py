"""The Ray actor of a TP gang's rank r > 0: one `pd.engine.parallel.follower.Follower` (Ray at the edge only).

Rank 0 (`pd.worker.gang.Gang`, inside the worker's own actor) creates one `ShardActor` per other rank
in its gang's placement group, gives it the gang's rendezvous address, then calls `run()`, which joins
the TP group, builds the rank's model shard and page pool, and serves rank 0's step plans until rank 0
sends `stop` (run returns) or the group fails (a peer died or hung). On a prefill or decode gang it also
starts the rank's KV agent (`connectors.zmq.gang.rank_agent.RankAgent`) on its pool, registered on the
gang's control (rank 0's `GangControl`, address given at creation): the rank serves (P) or pulls (D)
its own KV heads on rank 0's command. A prefill rank's pool is shareable, so a D rank on this host maps
it; rank 0's connector stops every agent when it shuts down (this rank closes its own after `stop`).

Guarantees:
- plain values only cross Ray: the deployment config as JSON text, strings and ints in, JSON text out;
  nothing of ours is pickled (the step plans go over gloo as msgpack, never through Ray);
- `max_restarts=0`: a rank is never restarted alone; the gang is the unit of restart (rank 0's process
  exits, Ray restarts it, and it builds a whole new gang);
- a follower whose group fails ends its own process (`FAILED_EXIT_CODE`) instead of lingering with its
  device memory, so `run()`'s reference fails at rank 0 at once; and as an actor rank 0 created, it is
  ended by Ray when rank 0's process dies.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

import ray

from pd.cluster.config import DeployConfig
from pd.cluster.roles import Role

logger = logging.getLogger(__name__)

FAILED_EXIT_CODE = 71  # a follower whose gang failed: distinct from a worker's own death (70)


def _exit(code: int) -> None:
    logging.shutdown()
    os._exit(code)


@ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=4)
class ShardActor:
    """Rank `rank` of worker `worker_id`'s gang of `size`; every method takes and returns str/int only."""

    def __init__(self, worker_id: str, role: str, rank: int, size: int, address: str, config_json: str,
                 secret: str, host: str, kv_control: str = "") -> None:
        logging.basicConfig(level=os.environ.get("PDKV_LOG_LEVEL", "INFO").upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._worker_id, self._role, self._rank, self._size = worker_id, Role(role), rank, size
        self._address, self._config_json, self._secret, self._host = address, config_json, secret, host
        self._kv_control = kv_control  # the gang's GangControl address ("" on a colocated gang: no KV moves)
        self._follower: Any = None  # (pd.engine.parallel.follower.Follower, built in run())
        self._agent: Any = None  # (its RankAgent on a P or D gang)

    def ready(self) -> str:
        """Where this rank runs: {"pid", "node_id"} (rank 0 waits for the pid when it reaps a gang)."""
        return json.dumps({"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()})

    def run(self) -> str:
        """Joins the gang and serves its step plans; returns once rank 0 said `stop`. Any failure ends
        this process (its caller's reference then raises), never a half-working rank."""
        try:
            import torch

            from pd.engine.parallel.follower import Follower
            from pd.engine.parallel.group import TPGroup
            from pd.worker.wiring import engine_config_for, gang_faults, gang_heads
            from pd.worker.worker import WorkerSpec

            config = DeployConfig.from_json(self._config_json)
            topo = config.topology
            torch.set_num_threads(topo.resolved_threads_per_worker)
            spec = WorkerSpec(self._worker_id, self._role, config, self._secret, self._host)
            engine_config = engine_config_for(spec)
            device = _rank_device(topo.device)
            group = TPGroup(self._rank, self._size, self._address, device, timeout_s=topo.tp_timeout_s,
                            join_timeout_s=JOIN_TIMEOUT_S)
            prefill = self._role is Role.PREFILL
            follower = self._follower = Follower(engine_config, group, shareable_pool=prefill)
            agent = None
            if self._kv_control:
                from connectors.zmq.gang.rank_agent import RankAgent

                heads, geometry = gang_heads(engine_config, self._size, self._rank)
                agent = self._agent = RankAgent(self._kv_control, follower.page_pool, geometry, heads, serve=prefill,
                                  host=self._host, faults=gang_faults(spec))
            logger.info("worker %s TP rank %d/%d serving (pid %d)", self._worker_id, self._rank, self._size,
                        os.getpid())
            follower.run()
            if agent is not None:  # rank 0 stops its followers, then its connector stops every agent: wait
                agent.join(timeout=AGENT_STOP_S)  # for that stop (answered), or rank 0's control waits for it
                agent.close()
            follower.close()
            group.close()
        except BaseException as exc:  # noqa: BLE001 - any failure ends the rank (module docstring)
            logger.error("worker %s TP rank %d/%d: %s: %s; exiting", self._worker_id, self._rank, self._size,
                         type(exc).__name__, exc)
            _exit(FAILED_EXIT_CODE)
        logger.info("worker %s TP rank %d/%d stopped", self._worker_id, self._rank, self._size)
        return json.dumps({"rank": self._rank, "stopped": True})

    def audit(self) -> str:
        """This rank's view of the gang's pool: its size in blocks (the same block ids as rank 0's) and
        the requests whose block tables it still holds (`num_rows_held`). Rank 0's KVCacheManager does
        the gang's block accounting; a follower lets a request's row go with the next plan after rank 0
        finished it, so rank 0 judges the count (`pd.worker.gang.Gang.audit`). On a P or D gang, also the
        KV bytes this rank's agent landed (`kv_bytes_received`) and the slices it served (`kv_slices_served`)."""
        follower = self._follower
        runner = getattr(follower, "runner", None)
        if follower is None or runner is None:
            return json.dumps({"rank": self._rank, "all_free": False, "detail": "not serving"})
        out = {"rank": self._rank, "num_blocks": int(follower.page_pool.num_blocks),
               "num_rows_held": int(runner.inputs.rows.num_assigned), "num_steps": follower.num_steps}
        agent = self._agent
        if agent is not None:
            out["kv_bytes_received"] = int(agent.received_bytes)
            out["kv_slices_served"] = int(agent.server.served_slices) if agent.server is not None else 0
        return json.dumps(out)


JOIN_TIMEOUT_S = 120.0  # ranks still importing torch and loading weights
AGENT_STOP_S = 10.0  # rank 0's connector stops this rank's agent just after the followers' `stop`


def _rank_device(device: str) -> str:
    # Ray gives each rank's actor its own GPU (CUDA_VISIBLE_DEVICES), so its device is cuda:0
    return "cuda:0" if device == "cuda" else "cpu"
