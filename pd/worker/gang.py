"""Rank 0's side of a TP gang: its followers, their rendezvous, and the monitor that makes the gang
the unit of health (Ray at the edge: this runs inside the worker's own actor, `pd.worker.actor`).

`Gang.start(on_failure)` (once per incarnation of rank 0):
1. reaps the followers an earlier incarnation of this worker left (their pids, recorded in a file of
   this node's temp dir named after the worker and the deployment's secret): SIGKILLs those still
   alive and waits until they are gone, so that no two gangs hold one device;
2. opens a fresh rendezvous on the worker's host (a port the OS picks: `open_rendezvous`) and, for a
   prefill or decode gang, binds the gang's KV control (`GangControl`: an ipc socket in a fresh private
   directory, so the gang packed on this node reaches it) that every rank's KV agent registers on;
3. creates a `ShardActor` per rank 1..tp-1 in bundles 1..tp-1 of the worker's placement group (found
   by name), calls their `run()`, and joins the group as rank 0; returns the `TPGroup` for the engine
   (and `control` for its connector, which owns it from then on: it stops every rank's agent);
4. starts the monitor: a thread that `ray.wait`s on the followers' `run()` references and checks their
   pids. A follower that ends (killed, its process gone, its group failed) calls `on_failure` once,
   well within a second of Ray or the kernel noticing; the worker then reports unhealthy and its
   process exits, so Ray restarts rank 0, which starts over at 1. The engine's own collectives fail
   on a dead rank too (its runner then ends the engine loop): whichever comes first.

Rank 0's own death ends the followers: they are actors it owns (Ray ends them with their owner), and
their next collective fails (a follower then exits on its own). `stop()` (after the engine sent
`stop`) kills the followers and waits for their pids. Every wait has a timeout.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pd.cluster.config import DeployConfig
from pd.worker.process_env import worker_env

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0  # a follower actor placed and answering (its process imports pd and ray)
REAP_TIMEOUT_S = 15.0  # an old follower's process gone after SIGKILL (device memory freed with it)
WATCH_INTERVAL_S = 0.2  # the monitor's pid check between ray.wait rounds


class GangFailed(RuntimeError):
    """A rank of a TP gang died or its group failed: the whole gang has to be rebuilt."""


class Gang:
    """Worker `worker_id`'s TP gang of `size` ranks as seen from rank 0 (see the module docstring)."""

    def __init__(self, worker_id: str, role: str, config_json: str, secret: str, host: str, size: int,
                 group_name: str = "") -> None:
        self.worker_id, self.role, self.size, self.host = worker_id, role, size, host
        self._config_json, self._secret, self._group_name = config_json, secret, group_name
        self._config = DeployConfig.from_json(config_json)
        self._followers: list = []
        self._runs: list = []
        self._ranks: list[dict] = []  # rank, pid, node_id of each follower
        self._failed: str | None = None
        self._closing = threading.Event()
        self._monitor: threading.Thread | None = None
        self._group: Any = None  # rank 0's TPGroup once joined
        self.control: Any = None  # the gang's KV control (connectors.zmq.gang.GangControl), P or D gangs

    # -- life cycle -------------------------------------------------------
    def start(self, on_failure: Callable[[BaseException], None]):
        """Builds the gang; returns rank 0's `TPGroup`. Raises (having ended every follower) when a rank
        does not join in time."""
        from pd.engine.parallel.group import TPGroup, open_rendezvous

        reap(pid_file(self.worker_id, self._secret))
        topo = self._config.topology
        rendezvous = open_rendezvous(self.host, self.size, join_timeout_s=READY_TIMEOUT_S)
        try:
            if self.role != "both":  # KV moves rank to rank: each rank's agent registers here
                from connectors.zmq.gang.gang_control import GangControl

                self.control = GangControl(self.size)
            self._followers = [self._follower(rank, rendezvous.address) for rank in range(1, self.size)]
            answers = ray.get([f.ready.remote() for f in self._followers], timeout=READY_TIMEOUT_S)
            self._ranks = [{"rank": r, **json.loads(a)} for r, a in enumerate(answers, start=1)]
            self._record()
            self._runs = [f.run.remote() for f in self._followers]
            device = "cuda:0" if topo.device == "cuda" else "cpu"
            self._group = TPGroup(0, self.size, rendezvous, device, timeout_s=topo.tp_timeout_s,
                                  join_timeout_s=READY_TIMEOUT_S)
        except BaseException:
            self.closing()
            self.stop()
            raise
        self._monitor = threading.Thread(target=self._watch, args=(on_failure,), name="pd-tp-monitor", daemon=True)
        self._monitor.start()
        logger.info("worker %s: TP gang of %d up (followers %s)", self.worker_id, self.size,
                    [r["pid"] for r in self._ranks])
        return self._group

    def _follower(self, rank: int, address: str):
        from pd.worker.shard_actor import ShardActor

        topo = self._config.topology
        options: dict = {"num_cpus": topo.cpus_per_worker, "num_gpus": topo.gpus_per_worker if topo.device == "cuda"
                         else 0, "runtime_env": {"env_vars": worker_env()}}
        if self._group_name:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=ray.util.get_placement_group(self._group_name), placement_group_bundle_index=rank)
        # (ray.remote made ShardActor an actor class; mypy sees the plain class)
        return ShardActor.options(**options).remote(  # type: ignore[attr-defined]
            self.worker_id, self.role, rank, self.size, address, self._config_json, self._secret, self.host,
            self.control.address if self.control is not None else "")

    def closing(self) -> None:
        """The worker is stopping: followers that end from now on are not a failure."""
        self._closing.set()

    def stop(self) -> None:
        """Ends every follower and waits for its process (after the engine sent `stop`); idempotent."""
        self._closing.set()
        for follower in self._followers:
            try:
                ray.kill(follower, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        here = ray.get_runtime_context().get_node_id()
        _wait_gone([r["pid"] for r in self._ranks if r.get("node_id") == here], REAP_TIMEOUT_S)
        self._followers, self._runs = [], []
        if self._group is not None:
            self._group.close()
            self._group = None
        if self.control is not None:  # (closed already by the connector's shutdown, unless none was built)
            self.control.close(timeout_s=1.0)
            self.control = None
        pid_file(self.worker_id, self._secret).unlink(missing_ok=True)

    # -- monitor ----------------------------------------------------------
    def _watch(self, on_failure: Callable[[BaseException], None]) -> None:
        here = ray.get_runtime_context().get_node_id()
        local = {r["rank"]: r["pid"] for r in self._ranks if r.get("node_id") == here}
        runs = dict(zip(self._runs, self._ranks, strict=True))
        while not self._closing.is_set():
            ready, _ = ray.wait(list(runs), num_returns=1, timeout=WATCH_INTERVAL_S)
            why = None
            if ready:
                rank = runs[ready[0]]
                why = f"TP rank {rank['rank']} (pid {rank['pid']}) ended: {_outcome(ready[0])}"
            else:
                gone = [rank for rank, pid in local.items() if not _running(pid)]
                if gone:
                    why = f"TP rank {gone[0]} (pid {local[gone[0]]}) is gone"
            if why is not None and not self._closing.is_set():
                self._failed = why
                logger.error("worker %s: %s; the gang is lost", self.worker_id, why)
                on_failure(GangFailed(f"TP gang lost a rank: {why}"))
                return

    # -- reports ----------------------------------------------------------
    def health(self) -> dict:
        """`{size, ranks: [{rank, pid, alive}]}`; a follower is alive while its run goes on and its
        process exists (checked where it shares rank 0's node)."""
        here = ray.get_runtime_context().get_node_id()
        ranks = [{"rank": 0, "pid": os.getpid(), "alive": True}]
        for rank in self._ranks:
            alive = self._failed is None and not self._closing.is_set()
            if alive and rank.get("node_id") == here:
                alive = _running(rank["pid"])
            ranks.append({"rank": rank["rank"], "pid": rank["pid"], "alive": alive})
        out: dict = {"size": self.size, "ranks": ranks}
        if self._failed is not None:
            out["error"] = self._failed
        return out

    def audit(self, rank0: dict, num_blocks: int, outstanding: int, timeout_s: float = 10.0) -> dict:
        """Rank 0's pool audit extended to every rank: `all_free` only when rank 0's is, and every follower
        answered with a pool of rank 0's size (the same block ids) holding no more block-table rows than
        rank 0 has requests `outstanding` (live, or finished with their release still to go out in the
        next plan); `ranks` holds each rank's answer."""
        answers: list[dict] = []
        try:
            raw = ray.get([f.audit.remote() for f in self._followers], timeout=timeout_s)
            answers = [json.loads(a) for a in raw]
        except Exception as exc:  # noqa: BLE001 - a rank that cannot answer fails the audit
            answers = [{"rank": r["rank"], "detail": f"no audit: {type(exc).__name__}: {exc}"} for r in self._ranks]
        problems = []
        for a in answers:
            if "num_blocks" not in a:
                problems.append(f"rank {a['rank']}: {a.get('detail') or 'no audit'}")
            elif a["num_blocks"] != num_blocks:
                problems.append(f"rank {a['rank']}: {a['num_blocks']} blocks, rank 0 has {num_blocks}")
            elif a["num_rows_held"] > outstanding:
                problems.append(f"rank {a['rank']}: holds the block tables of {a['num_rows_held']} requests, "
                                f"rank 0 has {outstanding} outstanding")
            a["all_free"] = not problems or not problems[-1].startswith(f"rank {a['rank']}:")
        out = dict(rank0)
        out["ranks"] = [{"rank": 0, **rank0}] + answers
        if problems:
            out["all_free"] = False
            out["detail"] = "; ".join(filter(None, [rank0.get("detail", ""), *problems]))
        return out

    def _record(self) -> None:
        """The followers' pids (with their start times, against pid reuse) for a later incarnation to reap."""
        entries = []
        for rank in self._ranks:
            try:
                entries.append({"pid": rank["pid"], "started": psutil.Process(rank["pid"]).create_time()})
            except psutil.Error:
                continue  # not on this node, or already gone
        pid_file(self.worker_id, self._secret).write_text(json.dumps(entries))


def _outcome(ref) -> str:
    try:
        return f"returned {ray.get(ref, timeout=1.0)}"
    except Exception as exc:  # noqa: BLE001 - what ended the rank is the message
        return str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__


def pid_file(worker_id: str, secret: str) -> Path:
    """Where a worker's gang records its followers' pids on this node (one file per worker and deployment)."""
    key = hashlib.sha256(f"{secret}|{worker_id}".encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"pdkv-gang-{key}.json"


def reap(path: Path, timeout_s: float = REAP_TIMEOUT_S) -> int:
    """SIGKILLs the recorded followers of an earlier gang still alive (the same pid and start time) and
    waits until they are gone; returns how many it ended. A file that does not parse is ignored."""
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return 0
    alive = []
    for entry in entries if isinstance(entries, list) else []:
        try:
            proc = psutil.Process(int(entry["pid"]))
            if abs(proc.create_time() - float(entry["started"])) < 0.01:
                os.kill(proc.pid, signal.SIGKILL)
                alive.append(proc.pid)
        except (psutil.Error, OSError, KeyError, TypeError, ValueError):
            continue  # gone already, or not ours any more
    if alive:
        logger.warning("killed %d follower(s) of an earlier gang: %s", len(alive), alive)
        _wait_gone(alive, timeout_s)
    path.unlink(missing_ok=True)
    return len(alive)


def _wait_gone(pids: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while _running(pid):
            if time.monotonic() > deadline:
                logger.warning("process %d still present after %.0f s", pid, timeout_s)
                return
            time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
