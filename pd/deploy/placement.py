"""Placement of P/D worker actors on a Ray cluster: reserve, start, stop.

Guarantees: GPU workers ask Ray for `topology.gpus_per_worker` of a GPU (1: each
its own GPU; 0.5: two workers share one, which is how P and D run on a one-GPU
box), CPU workers for no GPU; every worker for `topology.cpus_per_worker` CPUs;
`topology.placement` reserves one placement-group bundle per worker, spread
over nodes (`spread`) or packed onto few (`pack`), or none (`none`, each
actor scheduled with Ray's SPREAD strategy); `start_workers` either returns
every worker started or stops those it started and raises.

Tensor parallelism (`pd.cluster.tp_config`): a worker of TP t is a gang of t ranks, each asking for
the per-rank resources above. As soon as any role has TP > 1, every worker gets a placement group of
its own (`reserve_gangs`): STRICT_PACK, t bundles, so that a gang always lands on one node (NCCL and
shared memory between its ranks); `topology.placement` then no longer applies between workers. Rank 0
(the `WorkerActor`) runs in bundle 0 and is given the group's name (a plain string); it creates its
followers in bundles 1..t-1 (`pd.worker.gang`). `stop_workers` kills rank 0, which takes its followers
with it, and `release_placement` removes the groups. With TP 1 everywhere nothing of this changes.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import time

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pd.cluster.config import DeployConfig, Mode, Placement
from pd.cluster.gpu_share import gpus_needed, workers_per_gpu
from pd.cluster.roles import Role, WorkerEndpoint
from pd.worker.actor import WorkerActor
from pd.worker.process_env import worker_env

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 180.0
CALL_TIMEOUT_S = 10.0
PLACEMENT_TIMEOUT_S = 120.0  # room for an autoscaler to add nodes


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


def worker_tp(config: DeployConfig, role: Role) -> int:
    """The ranks of a worker of `role` (its TP degree)."""
    return config.topology.tp_of(role.value)


def uses_gangs(config: DeployConfig) -> bool:
    """Whether any worker the topology starts spans several ranks (then each gets its own group)."""
    return any(worker_tp(config, role) > 1 for _, role in worker_roles(config))


def num_ranks(config: DeployConfig) -> int:
    """Processes (ranks) of every worker together: what the topology asks Ray for."""
    return sum(worker_tp(config, role) for _, role in worker_roles(config))


def worker_gpus(config: DeployConfig) -> float:
    """The GPU share each worker asks Ray for: `topology.gpus_per_worker` on cuda, none on cpu."""
    return config.topology.gpus_per_worker if config.topology.device == "cuda" else 0.0


def worker_bundle(config: DeployConfig) -> dict[str, float]:
    """Ray resources of one worker rank (one placement-group bundle)."""
    bundle = {"CPU": float(config.topology.cpus_per_worker)}
    if config.topology.device == "cuda":
        bundle["GPU"] = worker_gpus(config)
    return bundle


def resource_shortfall(config: DeployConfig, cluster_resources: dict) -> str | None:
    """Why the cluster's total resources cannot hold the topology, or None if they can.

    GPU shares below 1 count whole GPUs: a GPU holds floor(1 / share) workers (Ray never splits
    one worker's share over two GPUs), so 2 workers at 0.6 need 2 GPUs, at 0.5 one. With TP > 1 every
    rank counts (`num_ranks`; a gang also needs its ranks' resources on one node, which the group's
    placement timeout reports)."""
    n = num_ranks(config)
    what = "workers" if n == config.topology.num_workers else "worker ranks"
    for key, per_worker in worker_bundle(config).items():
        have = float(cluster_resources.get(key, 0.0))
        if key == "GPU" and per_worker < 1.0:
            need = gpus_needed(n, per_worker)
            detail = f"{n} {what} at {per_worker:g} GPU each, {workers_per_gpu(per_worker)} per GPU"
        else:
            need, detail = per_worker * n, f"{n} {what} x {per_worker:g}"
        if have + 1e-9 < need:
            hint = (" (device: cuda asks topology.gpus_per_worker of a GPU per worker; use device: cpu on a "
                    "machine without GPUs)" if key == "GPU" else "")
            return f"the topology needs {need:g} {key} ({detail}), the Ray cluster has {have:g}{hint}"
    return None


def reserve_placement(config: DeployConfig, timeout_s: float = PLACEMENT_TIMEOUT_S) -> PlacementGroup | None:
    """One bundle per worker (in `worker_roles` order) per `topology.placement`; None for `none`.

    Raises RuntimeError naming the shortfall when the group is not placed within `timeout_s`.
    """
    placement = config.topology.placement
    if placement is Placement.NONE:
        return None
    n = config.topology.num_workers
    strategy = "SPREAD" if placement is Placement.SPREAD else "PACK"
    pg = placement_group([worker_bundle(config) for _ in range(n)], strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except (ray.exceptions.GetTimeoutError, TimeoutError):
        remove_placement_group(pg)
        why = resource_shortfall(config, ray.cluster_resources()) or f"available now: {ray.available_resources()}"
        raise RuntimeError(f"could not reserve {n} worker bundles of {worker_bundle(config)} "
                           f"({strategy}) within {timeout_s:g} s: {why}") from None
    logger.info("placement group of %d bundles %s (%s) ready", n, worker_bundle(config), strategy)
    return pg


def reserve_gangs(config: DeployConfig, timeout_s: float = PLACEMENT_TIMEOUT_S) -> list[PlacementGroup]:
    """One STRICT_PACK group of tp bundles per worker (in `worker_roles` order), each with a fresh
    unique name that rank 0 looks it up by. Either every group is placed within `timeout_s`, or every
    one is removed and RuntimeError names what the cluster lacks."""
    tag = secrets.token_hex(4)  # two deployments (or a test's several) never share a name
    roles = worker_roles(config)
    groups: list[PlacementGroup | None] = [None] * len(roles)
    deadline = time.monotonic() + timeout_s
    try:  # the largest gangs first, each placed before the next asks (first fit decreasing: pods of the
        # largest TP, as in deploy/kuberay-rayservice-tp.yaml, are never half taken by small gangs)
        for i in sorted(range(len(roles)), key=lambda i: -worker_tp(config, roles[i][1])):
            wid, role = roles[i]
            group = groups[i] = placement_group([worker_bundle(config)] * worker_tp(config, role),
                                                strategy="STRICT_PACK", name=f"pdkv-gang-{wid}-{tag}")
            ray.get(group.ready(), timeout=max(0.0, deadline - time.monotonic()))
    except (ray.exceptions.GetTimeoutError, TimeoutError):
        release_placement([g for g in groups if g is not None])
        why = resource_shortfall(config, ray.cluster_resources()) or (
            f"each gang needs its ranks on one node; available now: {ray.available_resources()}")
        sizes = [worker_tp(config, role) for _, role in worker_roles(config)]
        raise RuntimeError(f"could not reserve one node per worker gang (ranks {sizes}, each rank "
                           f"{worker_bundle(config)}) within {timeout_s:g} s: {why}") from None
    logger.info("%d gang placement groups (STRICT_PACK) ready", len(groups))
    return [g for g in groups if g is not None]


def reserve_for(config: DeployConfig, timeout_s: float = PLACEMENT_TIMEOUT_S):
    """What a deployment reserves: `reserve_gangs` when any worker has TP > 1, else `reserve_placement`."""
    return reserve_gangs(config, timeout_s) if uses_gangs(config) else reserve_placement(config, timeout_s)


def release_placement(pg: PlacementGroup | list[PlacementGroup] | None) -> None:
    """Removes a group from `reserve_placement` (or the groups of `reserve_gangs`); never raises."""
    for one in pg if isinstance(pg, list) else [pg]:
        if one is None:
            continue
        try:
            remove_placement_group(one)
        except Exception as exc:  # noqa: BLE001 - the cluster may already be gone
            logger.debug("placement group removal: %s", exc)


def actor_options(config: DeployConfig, pg: PlacementGroup | None = None, bundle_index: int = 0) -> dict:
    """Ray options of worker `bundle_index`: its resources, inside its bundle when `pg` is given."""
    options: dict[str, object] = {"num_cpus": config.topology.cpus_per_worker, "num_gpus": worker_gpus(config),
                                  "runtime_env": {"env_vars": worker_env()}}
    if pg is None:
        options["scheduling_strategy"] = "SPREAD"
    else:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle_index)
    return options


def start_workers(config: DeployConfig, secret: str, timeout_s: float = START_TIMEOUT_S,
                  pg: PlacementGroup | list[PlacementGroup] | None = None) -> list[StartedWorker]:
    """Starts every worker of the topology as an actor (worker i in bundle i of `pg`; with a list of
    gang groups, in bundle 0 of group i, given its name) and waits for their URLs."""
    config_json = config.to_json()
    roles = worker_roles(config)
    gangs = pg if isinstance(pg, list) else None
    # (ray.remote made WorkerActor an actor class; mypy sees the plain class)
    actors = [WorkerActor.options(  # type: ignore[attr-defined]
                  **(actor_options(config, gangs[i], 0) if gangs else actor_options(config, pg, i))).remote(
                  wid, role.value, config_json, secret, _group_name(gangs[i]) if gangs else "")
              for i, (wid, role) in enumerate(roles)]
    try:
        answers = ray.get([a.start.remote() for a in actors], timeout=timeout_s)
    except Exception:
        stop_workers(actors)
        raise
    started = []
    for (wid, role), actor, answer in zip(roles, actors, answers, strict=True):
        info = json.loads(answer)
        started.append(StartedWorker(WorkerEndpoint(wid, role, info["url"], info["node_id"]), actor))
        logger.info("worker %s (%s) on node %s at %s", wid, role.value, info["node_id"][:8], info["url"])
    return started


def _group_name(pg: PlacementGroup) -> str:
    # (the name given at creation: what rank 0 finds the group by, `ray.util.get_placement_group`)
    return str(ray.util.placement_group_table(pg).get("name") or "")


def stop_workers(actors: list, timeout_s: float = CALL_TIMEOUT_S) -> None:
    """Asks each actor to stop cleanly (a gang's rank 0 stops its followers), then kills it (Ray ends
    the followers a rank 0 owns with it); never raises for an already dead actor."""
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
