"""A P/D worker: one engine in one role, with its connector and internal HTTP API.

`Worker` is a plain class (no Ray): it can run in a test, in a bare process,
or inside the Ray actor of `pd.deploy.placement`. Roles:
- `prefill`: runs prompts with `do_remote_decode`, keeps their blocks for a
  decode worker to pull (the connector's producer side);
- `decode`: admits requests whose prompt KV arrives from a prefill worker
  (the connector's consumer side) and decodes;
- `both`: colocated mode, no connector, no transfer.

Guarantees:
- every request that enters `generate` leaves the engine: it finishes, or it
  is aborted when its consumer stops listening (`abort`);
- `stats()` never raises: a failing part is reported as an error string;
- `stop()` is idempotent and releases the HTTP port, the engine thread and
  the connector's sockets.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from connectors.base import KV_PARAM_KEYS
from pd.cluster.config import DeployConfig, Mode
from pd.cluster.roles import Role
from pd.engine.outputs import FinishReason
from pd.engine.sampling import SamplingParams
from pd.worker.http_api import WorkerHTTPServer

if TYPE_CHECKING:  # torch-heavy: imported when a worker really starts
    from connectors.base import KVConnector
    from pd.engine.engine import Engine

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """Who a worker is: id, role, the deployment config, the deployment secret
    (authenticates its HTTP API and its KV side channel) and its host address."""

    worker_id: str
    role: Role
    config: DeployConfig
    secret: str
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("worker_id must not be empty")
        if len(self.secret) < 16:
            raise ValueError("secret must be at least 16 characters")
        colocated = self.config.topology.mode is Mode.COLOCATED
        if colocated != (self.role is Role.BOTH):
            raise ValueError(f"role {self.role.value} does not fit topology mode {self.config.topology.mode.value}")


@dataclasses.dataclass(frozen=True)
class GenerateJob:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    kv_transfer_params: dict | None


_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self._engine: Engine | None = None
        self._connector: KVConnector | None = None
        self._http = WorkerHTTPServer(self, spec.secret)
        self._started_at = time.time()
        self._num_aborted = 0
        self._num_rejected = 0
        self.url: str | None = None
        from pd.worker.faults import WorkerFaults, parse_worker_faults

        role_key = "colocated" if spec.role is Role.BOTH else spec.role.value
        plan = parse_worker_faults(getattr(spec.config.faults, role_key))
        self._faults = WorkerFaults(plan, spec.host) if plan is not None else None

    # -- life cycle -------------------------------------------------------
    async def start(self, port: int = 0) -> str:
        """Builds and starts the engine, then the HTTP API; returns its URL."""
        from pd.worker.wiring import build_engine  # torch-heavy: imported when a worker really starts

        self._engine, self._connector = build_engine(self.spec)
        self._engine.start()
        port = await self._http.start(self.spec.host, port)
        self.url = f"http://{self.spec.host}:{port}"
        logger.info("worker %s (%s) serving on %s", self.spec.worker_id, self.spec.role.value, self.url)
        return self.url

    async def stop(self) -> None:
        await self._http.stop()
        if self._faults is not None:
            self._faults.close()
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    # -- requests ---------------------------------------------------------
    def parse_job(self, body: Any) -> GenerateJob:
        """Validates an internal generate request; raises ValueError naming the field."""
        if not isinstance(body, dict):
            raise ValueError("body must be a JSON object")
        request_id = body.get("request_id")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        ids = body.get("prompt_token_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be a non-empty list of integers")
        sampling = body.get("sampling") or {}
        if not isinstance(sampling, dict) or set(sampling) - _SAMPLING_FIELDS:
            raise ValueError(f"sampling must be an object with keys from {sorted(_SAMPLING_FIELDS)}")
        params = body.get("kv_transfer_params")
        if params is not None and (not isinstance(params, dict) or set(params) - set(KV_PARAM_KEYS)):
            raise ValueError(f"kv_transfer_params must be an object with keys from {list(KV_PARAM_KEYS)}")
        if params and params.get("do_remote_prefill") and self.spec.role is not Role.DECODE:
            raise ValueError(f"a {self.spec.role.value} worker does not take remote-prefilled requests")
        if params and params.get("do_remote_decode") and self.spec.role is not Role.PREFILL:
            raise ValueError(f"a {self.spec.role.value} worker does not hand requests to remote decode")
        try:
            sp = SamplingParams(**{k: (tuple(v) if k == "stop_token_ids" else v) for k, v in sampling.items()})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"sampling: {exc}") from None
        self._check_fits(len(ids) + sp.max_tokens)
        return GenerateJob(request_id, tuple(ids), sp, params)

    def _check_fits(self, num_tokens: int) -> None:
        """Refuses a request whose whole sequence can never fit in this worker's KV pool
        (it would wait for blocks forever, keeping its producer's lease alive)."""
        if self._engine is not None:
            self._engine.check_fits(num_tokens)

    def release_remote(self, body: Any) -> None:
        """Tells the producer named in a refused request's kv_transfer_params to free its
        blocks now, rather than when its lease runs out."""
        self._num_rejected += 1
        params = body.get("kv_transfer_params") if isinstance(body, dict) else None
        if self._connector is not None and isinstance(params, dict):
            self._connector.release_remote(params)

    async def generate(self, job: GenerateJob) -> AsyncIterator[dict]:
        """Yields one event per engine output for the request (see `pd.worker.http_api`)."""
        engine = self._require_engine()
        faults = self._faults
        params = job.kv_transfer_params
        if faults is not None:
            await faults.at("worker.request_received")
            params = faults.route(params)
        async for out in engine.generate(job.request_id, list(job.prompt_token_ids), job.sampling,
                                         kv_transfer_params=params):
            if faults is not None:
                await faults.at("worker.prefill_done" if out.finished and self.spec.role is Role.PREFILL
                                else "worker.decode_token")
            yield {
                "token_ids": list(out.new_token_ids),
                "finished": bool(out.finished),
                "finish_reason": _reason_name(out.finish_reason),
                "kv_transfer_params": out.kv_transfer_params if out.finished else None,
                "error": out.error,
                "error_cause": out.error_cause.value if out.error_cause is not None else None,
            }

    def abort(self, request_id: str) -> None:
        """Aborts a request whose consumer went away (counted in stats as `num_aborted`); harmless
        for a request that already finished or never came: a lease kept for it still ends at once."""
        if self._engine is not None:
            self._num_aborted += 1
            self._engine.abort_request(request_id)
            if self._connector is not None:  # a finished prefill nobody will pull: free its blocks now, not at expiry
                self._connector.abort_lease(request_id)

    def reset_prefix_cache(self) -> bool:
        return bool(self._require_engine().kv_cache_manager.reset_prefix_cache())

    # -- observability ----------------------------------------------------
    def health(self) -> dict:
        return {"status": "ok" if self._engine is not None else "stopped", "worker_id": self.spec.worker_id,
                "role": self.spec.role.value, "pid": os.getpid(), "uptime_s": round(time.time() - self._started_at, 3)}

    def stats(self, audit: bool = False) -> dict:
        """Engine, KV cache and transfer figures; with a pool audit (`audit`) only when asked,
        since the audit walks the pool under the engine's step lock."""
        from pd.worker.wiring import engine_stats

        out: dict[str, Any] = {"worker_id": self.spec.worker_id, "role": self.spec.role.value, "url": self.url,
                               "num_aborted": self._num_aborted, "num_rejected": self._num_rejected}
        if self._engine is None:
            out["error"] = "engine not running"
            return out
        try:
            out.update(engine_stats(self._engine, self._connector, audit=audit))
        except Exception as exc:  # stats must not take the worker down
            logger.exception("stats failed")
            out["error"] = f"{type(exc).__name__}: {exc}"
        return out

    def _require_engine(self):
        if self._engine is None:
            raise RuntimeError(f"worker {self.spec.worker_id} is not running")
        return self._engine


def _reason_name(reason: FinishReason | None) -> str | None:
    return None if reason is None else FinishReason(reason).value
