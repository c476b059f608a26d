"""Bringing restarted worker actors back into the router's rotation.

Ray restarts a worker actor whose process died (`pd.worker.actor`: SIGKILL, OOM,
an engine step loop that died), with the same worker id and role. The new
incarnation serves nothing until its `start()` runs, and it listens on a new
port with a fresh engine. `WorkerRestarts` watches every worker the router has
out of the rotation: it calls the actor's `start()` (idempotent: a live worker
answers its current URL) and, when the answer names a new URL, hands it to the
router (`Router.replace_endpoint`), which re-admits the worker after its usual
probes; its KV index entries then start from a snapshot. Requests meanwhile go
to the other workers, as for any worker out of the rotation.

A frozen worker (SIGSTOP) answers nothing until it resumes, then answers its
old URL: nothing changes. An actor past its restarts is logged and left out.

Guarantees: at most one start call in flight per worker, each with a timeout;
nothing here raises into the router's loop; `stop()` cancels every task.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging

import ray

from pd.deploy.placement import StartedWorker
from pd.router.server import Router

logger = logging.getLogger(__name__)

# One start call's wait. A call sent while Ray still thinks a killed actor alive can hang; a
# fresh call each round reaches the new incarnation. A slow start outlives several calls:
# each waits in the actor for the same start and returns its URL.
CALL_TIMEOUT_S = 15.0


class WorkerRestarts:
    def __init__(self, router: Router, workers: list[StartedWorker], interval_s: float,
                 call_timeout_s: float = CALL_TIMEOUT_S) -> None:
        self._router = router
        self._workers = workers
        self._interval_s = interval_s
        self._call_timeout_s = call_timeout_s
        self._calls: dict[str, asyncio.Task] = {}
        self._task: asyncio.Task | None = None
        self.num_restarts: dict[str, int] = {w.endpoint.worker_id: 0 for w in workers}
        self._last_error: dict[str, str] = {}  # logged once, not every round

    async def start(self) -> None:
        """Starts watching (on the router's loop)."""
        if self._task is None:
            self._task = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._calls.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._task = None
        self._calls.clear()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            for worker in self._workers:
                wid = worker.endpoint.worker_id
                call = self._calls.get(wid)
                if self._router.pool.get(wid).healthy or (call is not None and not call.done()):
                    continue
                self._calls[wid] = asyncio.create_task(self._revive(worker))

    async def _revive(self, worker: StartedWorker) -> None:
        wid = worker.endpoint.worker_id
        try:
            answer = await asyncio.wait_for(worker.actor.start.remote(), self._call_timeout_s)
            info = json.loads(answer)
        except asyncio.TimeoutError:  # frozen, or still starting: asked again next round
            logger.info("worker %s: no start answer within %.0f s", wid, self._call_timeout_s)
            return
        except ray.exceptions.ActorUnavailableError:  # Ray is restarting it: asked again next round
            logger.debug("worker %s: actor restarting", wid)
            return
        except ray.exceptions.RayActorError as exc:  # died during the call, or past its restarts
            why = str(exc).splitlines()[0]
            if self._last_error.get(wid) != why:
                self._last_error[wid] = why
                logger.warning("worker %s: actor unavailable: %s", wid, why)
            return
        except Exception:  # noqa: BLE001 - the watch must go on
            logger.exception("worker %s: start call failed", wid)
            return
        self._last_error.pop(wid, None)
        load = self._router.pool.get(wid)
        if info["url"] == load.endpoint.url:
            return  # the same incarnation (e.g. it was frozen): the probes re-admit it
        endpoint = dataclasses.replace(load.endpoint, url=info["url"], node_id=info.get("node_id", ""))
        self._router.replace_endpoint(endpoint, f"restarted by Ray as pid {info.get('pid')}")
        worker.endpoint = endpoint
        self.num_restarts[wid] += 1
