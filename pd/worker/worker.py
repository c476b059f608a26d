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
- an engine whose step loop died makes `health()` say `error` at once (the HTTP API then
  answers 503, so the router takes the worker out) and calls `on_engine_death`, which under
  Ray ends the process so that the actor restarts;
- a device fault (CUDA out of memory, an illegal access: `pd.engine.step_isolation`) fails the
  requests of its step with `error_cause` DEVICE_FAULT_CAUSE; the worker then does as for a dead
  loop (unhealthy, `on_engine_death` once), and every other request it holds ends its stream
  without a finish (`WorkerUnavailable`), as a lost worker's would, so the router serves it elsewhere;
- `stop()` is idempotent and releases the HTTP port, the engine thread and
  the connector's sockets.

Tensor parallelism: a worker whose role has TP > 1 is rank 0 of a gang (`gang`, given by the Ray
actor: `pd.worker.gang`); it starts the gang before its engine, hands the engine the gang's group,
and reports the gang in `health()["tp"]`. A gang that lost a rank (`gang_failed`) is a dead engine:
`health()` says `error`, new requests are refused, and `on_engine_death` is called once. A prefill or
decode gang moves its KV rank to rank: the gang binds its KV control before its followers, every rank
runs an agent on its own pool, and rank 0's connector (built with the gang's control,
`pd.worker.wiring`) grants and loads through every rank, so any P TP meets any D TP.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, cast

from pydantic import ValidationError

from connectors.params import TransferParams
from pd.cluster.config import DeployConfig, Mode
from pd.cluster.http_guard import GuardLimits
from pd.cluster.messages import FinishReason as WireFinishReason
from pd.cluster.messages import DEVICE_FAULT_CAUSE, GenerateRequest, KVTransferParams, StepTiming, TokenEvent
from pd.cluster.roles import Role
from pd.engine.inputs import CheckedRequest
from pd.engine.outputs import FinishReason
from pd.cluster.schema import describe
from pd.cluster.tracing import Tracing
from pd.cluster.tracing_config import resolve_tracing
from pd.worker.http_api import WorkerHTTPServer, WorkerUnavailable
from pd.worker.lease_trace import LeaseSpans
from pd.worker.request_trace import WorkerTrace, start_trace

if TYPE_CHECKING:  # torch-heavy: imported when a worker really starts
    from connectors.base import KVConnector
    from pd.engine.engine import Engine
    from pd.engine.step_isolation import DeviceFault
    from pd.worker.kv_events import KVEventPublisher

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


class Worker:
    def __init__(self, spec: WorkerSpec, on_engine_death: Callable[[BaseException], None] | None = None,
                 gang: Any = None) -> None:
        self.spec = spec
        self._on_engine_death = on_engine_death
        self._gang = gang  # rank 0's gang (pd.worker.gang.Gang) with TP > 1, else None
        self._gang_failure: BaseException | None = None
        self._engine: Engine | None = None
        self._connector: KVConnector | None = None
        self._http = WorkerHTTPServer(self, spec.secret,
                                      GuardLimits.from_section(spec.config.router.connections, worker=True))
        self._started_at = time.time()
        self._tracing = Tracing.off()  # started with the engine (config `tracing`, pd.cluster.tracing)
        self._lease_spans: LeaseSpans | None = None  # P with tracing on: the connector reports its leases
        self._num_aborted = 0
        self._num_rejected = 0
        self._kv_events: KVEventPublisher | None = None  # once started with prefix caching
        self._death_reported = False  # on_engine_death is called once, whatever ended the engine
        self.url: str | None = None
        from pd.worker.faults import WorkerFaults, parse_worker_faults

        role_key = "colocated" if spec.role is Role.BOTH else spec.role.value
        plan = parse_worker_faults(getattr(spec.config.faults, role_key))
        self._faults = WorkerFaults(plan, spec.host) if plan is not None else None

    # -- life cycle -------------------------------------------------------
    async def start(self, port: int = 0) -> str:
        """Builds and starts the engine, then the HTTP API; returns its URL."""
        import torch

        from pd.worker.wiring import build_engine  # torch-heavy: imported when a worker really starts

        # Before the engine exists: torch and the fused kernels (at::parallel_for) read it on every
        # op. Under Ray the process starts with OMP_NUM_THREADS=1 when its num_cpus is below 1.
        torch.set_num_threads(self.spec.config.topology.resolved_threads_per_worker)
        group = None
        if self._gang is not None:  # (off the event loop: it waits for the other ranks to start and join)
            group = await asyncio.to_thread(self._gang.start, self.gang_failed)
        try:
            self._engine, self._connector = build_engine(self.spec) if group is None else \
                build_engine(self.spec, tp=group, gang_control=self._gang.control)
        except BaseException:
            if self._gang is not None:
                self._gang.stop()
            raise
        if self._engine.config.enable_kv_events:
            from pd.worker.kv_events import KVEventPublisher

            self._kv_events = KVEventPublisher(self.spec.worker_id, self._engine.config.engine_id,
                                               self.spec.secret, self.spec.host)
            self._engine.kv_event_sink = self._kv_events.publish
        self._engine.on_death = self._engine_died
        self._engine.start()
        self._tracing = Tracing.start(resolve_tracing(self.spec.config.tracing), f"pdkv-{self.spec.role.value}",
                                      {"pdkv.worker_id": self.spec.worker_id})
        if self._tracing.enabled and self._connector is not None and self.spec.role is Role.PREFILL:
            spans = LeaseSpans(self._tracing)
            if self._connector.report_leases(spans.on_report):
                self._lease_spans = spans
        port = await self._http.start(self.spec.host, port)
        self.url = f"http://{self.spec.host}:{port}"
        logger.info("worker %s (%s) serving on %s", self.spec.worker_id, self.spec.role.value, self.url)
        return self.url

    def _engine_died(self, exc: BaseException) -> None:
        logger.error("worker %s: engine step loop died (%s: %s); reporting unhealthy", self.spec.worker_id,
                     type(exc).__name__, exc)
        self._report_death(exc)

    def gang_failed(self, exc: BaseException) -> None:
        """A rank of this worker's gang died or hung (the gang's monitor): the worker is lost as a whole."""
        if self._gang_failure is None:
            self._gang_failure = exc
            logger.error("worker %s: %s; reporting unhealthy", self.spec.worker_id, exc)
            self._report_death(exc)

    def _report_death(self, exc: BaseException) -> None:
        if not self._death_reported:
            self._death_reported = True
            if self._on_engine_death is not None:
                self._on_engine_death(exc)

    def _device_fault(self) -> DeviceFault | None:
        """The engine's latched device fault, reported once (`on_engine_death`); None while there is none."""
        fault = self._engine.fault_marks.device_fault if self._engine is not None else None
        if fault is not None and not self._death_reported:
            logger.error("worker %s: %s; reporting unhealthy, restarting", self.spec.worker_id, fault)
            self._report_death(fault)
        return fault

    async def stop(self) -> None:
        await self._http.stop()
        if self._faults is not None:
            self._faults.close()
        if self._gang is not None:
            self._gang.closing()  # the followers' loops end now: not a failure
        if self._engine is not None:
            self._engine.shutdown()  # (the connector reports the leases it ends: before tracing closes)
            self._engine = None
        if self._gang is not None:
            self._gang.stop()
        if self._lease_spans is not None:
            self._lease_spans.close()
        self._tracing.close()
        if self._kv_events is not None:  # after the engine: nothing publishes any more
            self._kv_events.close()

    # -- requests ---------------------------------------------------------
    def parse_job(self, body: Any) -> CheckedRequest:
        """Validates an internal generate request (`GenerateRequest`) against this worker's role, and
        has the engine check it (`Engine.check_request`: vocabulary and capacity); raises ValueError
        naming the field. The one check at the worker's edge: the engine takes the result as it is,
        kv_transfer_params typed (`connectors.params.TransferParams`) from here to the connector.
        Raises WorkerUnavailable once the engine's loop died."""
        engine = self._engine
        if engine is None:
            raise WorkerUnavailable(f"worker {self.spec.worker_id} is not running")
        if engine.dead is not None:
            raise WorkerUnavailable(f"worker {self.spec.worker_id}: engine step loop died: "
                                    f"{type(engine.dead).__name__}")
        if self._gang_failure is not None:
            raise WorkerUnavailable(f"worker {self.spec.worker_id}: {self._gang_failure}")
        if self._device_fault() is not None:
            raise WorkerUnavailable(f"worker {self.spec.worker_id}: its device failed; restarting")
        try:
            request = GenerateRequest.model_validate(body)
        except ValidationError as exc:
            raise ValueError(describe(exc)) from None
        wire = request.kv_transfer_params
        params = wire.to_params() if wire is not None else None
        if params is not None and params.do_remote_prefill and self.spec.role is not Role.DECODE:
            raise ValueError(f"a {self.spec.role.value} worker does not take remote-prefilled requests")
        if params is not None and params.do_remote_decode and self.spec.role is not Role.PREFILL:
            raise ValueError(f"a {self.spec.role.value} worker does not hand requests to remote decode")
        return engine.check_request(request.request_id, request.prompt_token_ids, request.sampling.to_params(),
                                    params, request.cache_salt)

    def begin_trace(self, job: CheckedRequest, headers: Any) -> WorkerTrace | None:
        """The request's spans (pd.worker.request_trace), parented on the caller's; None with tracing off."""
        return start_trace(self._tracing, self.spec.role, self.spec.worker_id, job, headers,
                           self.spec.config.transfer.data_path, self._lease_spans)

    def refuse(self, body: Any) -> None:
        """A request refused at the edge (`parse_job` raised ValueError): counted, and the producer named
        in its kv_transfer_params, when they parse, frees its blocks now rather than when its lease runs out."""
        self._num_rejected += 1
        raw = body.get("kv_transfer_params") if isinstance(body, dict) else None
        try:
            params = KVTransferParams.model_validate(raw).to_params() if raw is not None else None
        except ValidationError:
            return  # names no producer this worker could tell
        self.release_remote(params)

    def release_remote(self, params: TransferParams | None) -> None:
        """Tells the producer named in a refused (or never started) request's kv_transfer_params to
        free its blocks now, rather than when its lease runs out."""
        if self._connector is not None and params is not None:
            self._connector.release_remote(params)

    async def generate(self, job: CheckedRequest, trace_context: str | None = None) -> AsyncIterator[TokenEvent]:
        """Yields one event per engine output for the request (see `pd.worker.http_api`).
        `trace_context`: D's pull span (`WorkerTrace.pull_context`), passed on to P in the PULL frames."""
        engine = self._require_engine()
        faults = self._faults
        params = job.kv_transfer_params
        if faults is not None:
            await faults.at("worker.request_received")
            params = faults.route(params)
            for where in faults.engine_marks():
                engine.fault_marks.mark(job.request_id, where)
        if trace_context is not None and params is not None:
            params = dataclasses.replace(params, trace_context=trace_context)
        if params is not job.kv_transfer_params:
            job = dataclasses.replace(job, kv_transfer_params=params)
        try:
            async for out in engine.stream(job):
                if faults is not None:
                    await faults.at("worker.prefill_done" if out.finished and self.spec.role is Role.PREFILL
                                    else "worker.decode_token")
                answer = out.kv_transfer_params if out.finished else None
                cause = out.error_cause.value if out.error_cause is not None else None
                if out.error is not None and self._device_fault() is not None:  # (no step ran after it)
                    cause = DEVICE_FAULT_CAUSE
                yield TokenEvent(token_ids=list(out.new_token_ids), finished=out.finished,
                                 finish_reason=_reason_name(out.finish_reason),
                                 kv_transfer_params=KVTransferParams.from_params(answer) if answer else None,
                                 error=out.error, num_cached_tokens=out.num_cached_tokens, error_cause=cause,
                                 timing=_wire_timing(out.timing, engine.page_pool.page_size_bytes))
        except RuntimeError as exc:
            from pd.engine.step_isolation import is_device_fault

            fault = self._device_fault()
            origin = exc.__cause__ or exc  # the engine's "engine stopped" carries why its loop ended
            # A device fault latched in a step, or a CUDA error that ended the loop outside one (a KV copy):
            # this request was not in a failing step; it is lost with the worker, never failed by it
            if fault is None and not is_device_fault(origin):
                raise
            why = fault.cause_text if fault is not None else f"{type(origin).__name__}: {origin}"
            raise WorkerUnavailable(f"worker {self.spec.worker_id}: its device failed ({why}); "
                                    f"request {job.request_id} goes elsewhere") from exc

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
    @property
    def kv_events(self):
        """The KV event publisher (`pd.worker.kv_events.KVEventPublisher`), None before start or
        without prefix caching."""
        return self._kv_events

    def kv_events_replay(self, after_seq: int | None) -> dict:
        """The KV event replay answer (`pd.worker.kv_events.replay_answer`)."""
        from pd.worker.kv_events import replay_answer

        if self._kv_events is None:
            raise RuntimeError(f"worker {self.spec.worker_id} publishes no KV events")
        return replay_answer(self._kv_events, self._require_engine(), after_seq)

    def _kv_events_info(self) -> dict | None:
        if self._kv_events is None or self._engine is None:
            return None
        from pd.worker.wiring import kv_hashing_identity

        return {**self._kv_events.info(), "hashing": kv_hashing_identity(self._engine),
                "num_blocks": self._engine.page_pool.num_blocks}

    def health(self) -> dict:
        from pd.worker.wiring import kv_listen_ports

        dead = self._engine.dead if self._engine is not None else None
        dead = dead or self._gang_failure or self._device_fault()
        status = "stopped" if self._engine is None else "error" if dead is not None else "ok"
        out = {"status": status, "worker_id": self.spec.worker_id,
               "engine_error": f"{type(dead).__name__}: {dead}" if dead is not None else None,
               "role": self.spec.role.value, "pid": os.getpid(), "uptime_s": round(time.time() - self._started_at, 3),
               "num_threads": self._engine.num_threads if self._engine is not None else None,
               "kv_events": self._kv_events_info(), "kv_ports": kv_listen_ports(self._connector)}
        if self._gang is not None:
            out["tp"] = self._gang.health()
        return out

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
            out["kv_events"] = self._kv_events_info()
            if audit and self._gang is not None:  # every rank's pool: rank 0's above, the followers' views here
                out["audit"] = self._gang.audit(out["audit"], self._engine.page_pool.num_blocks,
                                                self._outstanding_requests())
        except Exception as exc:  # stats must not take the worker down
            logger.exception("stats failed")
            out["error"] = f"{type(exc).__name__}: {exc}"
        return out

    def _outstanding_requests(self) -> int:
        """Requests a gang's followers may still hold block tables for: those rank 0's runner holds, and
        those it released whose release goes to the followers with the next plan (the TP runner's set)."""
        return self._require_engine().runner.num_held_requests

    def _require_engine(self):
        if self._engine is None:
            raise RuntimeError(f"worker {self.spec.worker_id} is not running")
        return self._engine


def _wire_timing(timing, page_size_bytes: int) -> StepTiming | None:
    if timing is None:
        return None
    return StepTiming(queue_s=max(0.0, timing.queue_s), load_s=max(0.0, timing.load_s),
                      compute_s=max(0.0, timing.compute_s), num_computed_tokens=timing.num_computed_tokens,
                      num_loaded_tokens=timing.num_loaded_tokens, num_loaded_blocks=timing.num_loaded_blocks,
                      num_loaded_bytes=timing.num_loaded_blocks * page_size_bytes,
                      num_batched_tokens=timing.num_batched_tokens)


def _reason_name(reason: FinishReason | None) -> WireFinishReason | None:
    # (the engine's reasons are the wire Literal's values; TokenEvent validates it)
    return None if reason is None else cast("WireFinishReason", FinishReason(reason).value)
