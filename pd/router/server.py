"""The router: an OpenAI-compatible HTTP server in front of the P/D workers.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both in
pd.router.completions), `GET /v1/models[/{id}]`, `GET /health`,
`GET /metrics` (Prometheus text, from the last worker poll) and
`GET /pd/workers` (each worker's last stats, its KV index state, EXACT or
DEGRADED, and size, and the prefill planner's figures for it; `?refresh=1` polls
now, pool audits included, at most once per `refresh_min_interval_s`, see
pd.router.refresh) and `GET /pd/planner` (the planner's mode and all its
figures, pd.router.planner). Who may call what (API keys on /v1/, the admin key
alone on /pd/* and a protected /metrics) and each tenant's cache salt: pd.router.tenancy.

Guarantees:
- client input is validated before any worker is touched; errors are
  OpenAI-style JSON with a proper status code (400 bad input, 401 bad key,
  403 an API key on an admin endpoint, 429 too many waiting refreshes,
  404 unknown model or route, 500 a bug here, 502/503/504 worker trouble),
  never aiohttp's plain-text pages;
- client-supplied `kv_transfer_params` are dropped (never forwarded);
- a streamed request whose worker fails gets an error event and `[DONE]`,
  never a hang; a client that disconnects aborts its request on the worker;
- a background health loop polls every worker: a failed health probe
  (`max_failed_polls` polls in a row) takes it out of the rotation, and calls
  waiting on it stop at once; a worker out of the rotation keeps being probed
  (every `readmit_interval_s`, faster than the poll) and comes back after
  `num_readmit_probes` good probes in a row (settings:
  pd.router.recovery.RecoverySettings); an on-demand refresh counts toward
  neither (how often a client asks must not decide a worker's liveness);
- `/health` answers 503 `starting`, with the reason, until a worker of each needed role has
  answered a health probe (pd.router.readiness; `wait_ready` waits for that), and from then
  on `ok`, `degraded` or `unavailable` (pd.router.recovery.health_report);
- a `/metrics` scrape serves the figures of the last poll: it never calls a
  worker, so scrapers cost the workers nothing;
- a client costs bounded connections and time: header, body and idle timeouts and
  connection caps per peer and in total (`pd.cluster.http_guard`, `router.connections`);
  `stop()` drains requests in progress, then ends the streams still running cleanly.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import web

from pd.router import openai_api as oa
from pd.router.admission import AdmissionGate, AdmissionLimits
from pd.router.completions import (GENERATION_PATHS, CompletionEndpoints, count_outcome, error_response,
                                   internal_error)
from pd.router.openai_responses import model_card, models_response
from pd.router.openapi import openapi_handler
from pd.cluster.config import DeployConfig, Mode
from pd.cluster.http_guard import ConnectionGuard, GuardedSite, GuardLimits
from pd.router.dispatch import Dispatcher
from pd.router.metrics import CONTENT_TYPE, RouterMetrics, WorkerFigures
from pd.router.recovery import RecoverySettings, health_report
from pd.router.choice import POLICIES, Role, WorkerEndpoint, WorkerPool
from pd.engine.text.tokenizer import Tokenizer, load_tokenizer
from pd.router.worker_client import ClientTimeouts, WorkerCallError, WorkerClient
from kvcache.hashing import BlockHasher
from pd.cluster.kv_wire import deployment_hash_seed
from pd.router.kv_feed import KVFeed
from pd.router.kv_index import KVIndex
from pd.router.readiness import Readiness
from pd.router.refresh import RefreshBusy, RefreshLimiter
from pd.router.tenancy import Tenancy
from pd.router.timeline import STAGES
from pd.router.planner.route import RoutePlanner

logger = logging.getLogger(__name__)



class Router:
    def __init__(self, config: DeployConfig, endpoints: list[WorkerEndpoint], secret: str,
                 tokenizer: Tokenizer | None = None, policy: str | None = None,
                 metrics_require_key: bool | None = None, policy_options: dict | None = None,
                 kv_index_max_entries: int | None = None, recovery: RecoverySettings | None = None) -> None:
        """`policy`, `metrics_require_key`, `policy_options`, `kv_index_max_entries` and
        `recovery` default to the config's router section (`policy`, `metrics_auth`, the
        `prefix_*_weight`s, `kv_index_max_entries`, the recovery settings)."""
        self.config = config
        self.recovery = recovery or RecoverySettings.from_router_config(config.router)
        rc = config.router
        policy = policy or rc.policy
        if metrics_require_key is None:
            metrics_require_key = rc.metrics_auth
        if policy_options is None and policy == "prefix_aware":
            policy_options = {"queue_weight": rc.prefix_queue_weight, "running_weight": rc.prefix_running_weight}
        kv_index_max_entries = kv_index_max_entries or rc.kv_index_max_entries
        self.tokenizer = tokenizer or load_tokenizer(config.model.path)
        if policy not in POLICIES:
            raise ValueError(f"router policy {policy!r} is unknown; use one of {sorted(POLICIES)}")
        self.metrics = RouterMetrics(config.model.name, self._worker_figures)
        self.metrics.declare_ttft_stages(STAGES)
        self.client = WorkerClient(secret, ClientTimeouts(connect_s=rc.connect_timeout_s, stall_s=rc.request_timeout_s,
                                                          total_s=rc.request_timeout_s))
        self.kv_index: KVIndex | None = None
        self.kv_feed: KVFeed | None = None
        if config.cache.enable_prefix_caching:
            hasher = BlockHasher(config.cache.block_size, config.cache.hash_algorithm, deployment_hash_seed(secret))
            self.kv_index = KVIndex(hasher, max_entries=kv_index_max_entries)
            self.kv_feed = KVFeed(self.kv_index, secret, self.client, self.metrics)
        self.pool = WorkerPool(POLICIES[policy](**(policy_options or {})), self.kv_index, self.metrics,
                               num_readmit_probes=self.recovery.num_readmit_probes)
        for endpoint in endpoints:
            self.pool.add(endpoint)
        self.tenancy = Tenancy(rc, secret, metrics_require_key, self.metrics)  # keys, auth throttle, cache salts
        self._colocated = config.topology.mode is Mode.COLOCATED
        self.planner = RoutePlanner(rc.planner, self.metrics, config.cache.block_size,
                                    config.scheduler.max_num_batched_tokens)
        self.dispatcher = Dispatcher(self.pool, self.client, self.metrics, self._colocated, self.recovery,
                                     self.planner, rc.first_token_from_prefill)
        self._failed_polls: dict[str, int] = {}
        # "serving" only once a worker of each needed role answered a health probe (pd.router.readiness)
        self.readiness = Readiness((Role.BOTH,) if self._colocated else (Role.PREFILL, Role.DECODE),
                                   lambda: [w.endpoint for w in self.pool.all()])
        serving = (Role.BOTH,) if self._colocated else (Role.DECODE,)
        self.gate = AdmissionGate(
            lambda: rc.max_in_flight_per_worker * max(1, sum(len(self.pool.healthy(r)) for r in serving)),
            AdmissionLimits(rc.max_queued_requests, rc.queue_timeout_s, rc.retry_after_s))
        self.endpoints = CompletionEndpoints(config, self.tokenizer, self.dispatcher, self.metrics, self.gate,
                                             tenancy=self.tenancy)
        self._refresh = RefreshLimiter(lambda: self.poll_workers(audit=True, readmit=False, on_demand=True),
                                       rc.refresh_min_interval_s)
        self._runner: web.AppRunner | None = None
        self._health_task: asyncio.Task | None = None
        self.url: str | None = None

    # -- life cycle -------------------------------------------------------
    async def start(self, host: str | None = None, port: int | None = None) -> str:
        await self.client.open()
        # header/body/idle timeouts and connection caps (pd.cluster.http_guard): the guard's middleware
        # runs after the key check, so a refused request's body is never read
        self.conn_guard = ConnectionGuard(GuardLimits.from_section(self.config.router.connections), "router")
        app = web.Application(middlewares=[self._api_key, self.conn_guard.middleware],
                              client_max_size=self.config.router.max_body_bytes)
        app.add_routes([
            web.post("/v1/completions", self.endpoints.completions),
            web.post("/v1/chat/completions", self.endpoints.chat),
            web.get("/v1/models", self._models),
            web.get("/v1/models/{model_id}", self._model),
            web.get("/health", self._health),
            web.get("/metrics", self._metrics),
            web.get("/pd/workers", self._workers),
            web.get("/pd/planner", self._planner),
            web.get("/openapi.json", openapi_handler(self.config, self.endpoints.vocab_size)),
        ])
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=2.0,
                                     **self.conn_guard.runner_options())
        await self._runner.setup()
        host = host or self.config.router.host
        site = GuardedSite(self._runner, self.conn_guard, host, self.config.router.port if port is None else port)
        await site.start()
        bound = self._runner.addresses[-1][1]
        self.url = f"http://{host}:{bound}"
        await self._subscribe_kv_events()
        await self.poll_workers()
        self._health_task = asyncio.create_task(self._health_loop())
        self.endpoints.tune_process()  # GC and GIL settings that keep the loop free while a large body parses
        return self.url

    async def _subscribe_kv_events(self) -> None:
        """Subscribes the KV index to every worker's event stream; a worker that hashes prefixes
        differently from the router refuses the start (HashingMismatch)."""
        if self.kv_feed is None:
            return
        for load in self.pool.all():
            try:
                health = await self.client.get_json(load.endpoint.url, "/internal/health",
                                                    timeout_s=self.recovery.stats_timeout_s)
            except WorkerCallError as exc:
                logger.warning("worker %s: no health answer, KV index entries wait: %s", load.endpoint.worker_id, exc)
                continue
            if health.get("kv_events"):
                self.kv_feed.connect(load.endpoint.worker_id, load.endpoint.url, health["kv_events"])

    async def stop(self, drain_s: float = 2.0) -> None:
        """Closes the port, gives requests in progress `drain_s` to finish (streams still running
        then end with an error event and `data: [DONE]`), then tears down."""
        if self.kv_feed is not None:
            await self.kv_feed.close()
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self._runner is not None:
            for site in list(self._runner.sites):
                await site.stop()  # no new connections while the ones in progress drain
            await self.conn_guard.drain(drain_s)
            await self._runner.cleanup()
            self._runner = None
        await self.dispatcher.drain()
        self.endpoints.close()
        await self.client.close()

    async def _health_loop(self) -> None:
        """A full poll every `health_interval_s`; in between, while a worker is out of the
        rotation, a probe of it every `readmit_interval_s` (a resumed worker is back quickly)."""
        loop = asyncio.get_running_loop()
        interval = self.config.router.health_interval_s
        next_poll = loop.time() + interval
        while True:
            wake = next_poll if not self.pool.dead() else min(next_poll, loop.time() + self.recovery.readmit_interval_s)
            await asyncio.sleep(max(0.0, wake - loop.time()))
            try:
                if loop.time() >= next_poll:
                    next_poll = loop.time() + interval
                    await self.poll_workers()
                else:
                    await self._probe_out_of_rotation()
            except Exception:  # the loop must outlive any single bad poll
                logger.exception("worker poll failed")

    async def _probe_out_of_rotation(self) -> None:
        """One probe of each worker out of the rotation, counted toward its re-admission."""
        loads = self.pool.dead()
        results = await asyncio.gather(*(self._probe(w) for w in loads))
        for load, error in zip(loads, results, strict=True):
            if self.pool.record_probe(load.endpoint.worker_id, error is None):
                self._failed_polls[load.endpoint.worker_id] = 0

    async def poll_workers(self, audit: bool = False, readmit: bool = True, on_demand: bool = False) -> None:
        """Refreshes every healthy worker's stats (with a pool audit, taken under the
        engine's step lock, only when `audit`) and probes the others. Liveness is the health
        probe alone (a slow stats answer from a busy worker is not a death): a worker whose
        probe fails `max_failed_polls` times in a row leaves the rotation; one out of it is
        re-admitted after `num_readmit_probes` good probes in a row, counted only when
        `readmit` (the health loop's paced polls, not on-demand refreshes). An `on_demand` poll
        (`?refresh=1`) counts nothing toward either: how often clients ask must not decide liveness."""
        readmit = readmit and not on_demand
        loads = [w for w in self.pool.all() if w.healthy or readmit]
        results = await asyncio.gather(*(self._poll_one(w, audit) if w.healthy else self._probe(w) for w in loads))
        for load, error in zip(loads, results, strict=True):
            worker_id = load.endpoint.worker_id
            if not load.healthy:
                if self.pool.record_probe(worker_id, error is None):
                    self._failed_polls[worker_id] = 0
                continue
            if error is None:
                self._failed_polls[worker_id] = 0
                continue
            if on_demand:
                logger.warning("on-demand poll: worker %s did not answer (not counted): %s", worker_id, error)
                continue
            self._failed_polls[worker_id] = self._failed_polls.get(worker_id, 0) + 1
            limit = self.recovery.max_failed_polls
            if self._failed_polls[worker_id] >= limit:
                self.pool.mark_dead(worker_id, f"{limit} failed polls: {error}")
        if self.kv_feed is not None:  # a dead worker holds nothing: its entries go
            for load in self.pool.all():
                if not load.healthy:
                    self.kv_feed.drop(load.endpoint.worker_id)

    def replace_endpoint(self, endpoint: WorkerEndpoint, reason: str = "restarted") -> None:
        """A worker that came back at a new URL (`pd.deploy.restarts`): out of the rotation, its KV
        index entries gone, until its new address passes the re-admission probes (its index then
        starts from a snapshot of its fresh engine)."""
        self.pool.replace_endpoint(endpoint, reason)
        self._failed_polls.pop(endpoint.worker_id, None)
        if self.kv_feed is not None:
            self.kv_feed.drop(endpoint.worker_id)

    async def wait_ready(self, timeout_s: float) -> None:
        """Returns once a worker of each needed role has answered a health probe; raises
        `pd.router.readiness.NotReady`, naming the roles and workers that did not, after `timeout_s`."""
        await self.readiness.wait(timeout_s)

    async def _probe(self, load) -> str | None:
        """None when the worker's health probe answered; else why not."""
        endpoint = load.endpoint
        try:
            await self.client.get_json(endpoint.url, "/internal/health")
        except WorkerCallError as exc:
            self.readiness.failed(endpoint, str(exc))
            return str(exc)
        self.readiness.answered(endpoint)
        return None

    async def _poll_one(self, load, audit: bool) -> str | None:
        """The health probe (None when it answered, else why not), with the stats fetched beside it."""
        path = "/internal/stats?audit=1" if audit else "/internal/stats"
        stats = asyncio.ensure_future(self.client.get_json(load.endpoint.url, path,
                                                           timeout_s=self.recovery.stats_timeout_s))
        error = await self._probe(load)
        if error is not None:
            stats.cancel()
            with contextlib.suppress(asyncio.CancelledError, WorkerCallError):
                await stats
            return error
        try:
            stats_answer = await stats
            self.pool.update_stats(load.endpoint.worker_id, stats_answer)
            if self.kv_feed is not None:
                self.kv_feed.observe(load.endpoint.worker_id, load.endpoint.url, stats_answer.get("kv_events"))
        except WorkerCallError as exc:  # alive but slow or failing stats: keep the last figures
            logger.info("stats of worker %s: %s", load.endpoint.worker_id, exc)
        return None

    # -- middleware -------------------------------------------------------
    @web.middleware
    async def _api_key(self, request: web.Request, handler):
        """Keys, then the handler; each request to a generation endpoint is counted once in
        `pdkv_requests_total`, refused, answered, failed or left (pd.router.completions.count_outcome)."""
        if request.path not in GENERATION_PATHS:
            return await self._answer(request, handler)
        response = None
        try:
            response = await self._answer(request, handler)
            return response
        finally:  # also when cancelled (the client left, or shutdown): then there is no response
            self.metrics.record_outcome(count_outcome(request, response))

    async def _answer(self, request: web.Request, handler) -> web.StreamResponse:
        refused = self.tenancy.authorize(request)  # API keys on /v1/, the admin key on /pd/* (pd.router.tenancy)
        if refused is not None:
            return error_response(refused)
        try:
            return await handler(request)
        except oa.APIError as exc:
            return error_response(exc)
        except web.HTTPException as exc:  # aiohttp's own 404/405/413: answer in OpenAI's shape too
            return error_response(oa.APIError(exc.status, exc.reason, code=str(exc.status)))
        except Exception as exc:  # noqa: BLE001 - never aiohttp's plain-text 500
            logger.exception("%s %s from %s failed", request.method, request.path, self.tenancy.address(request))
            return error_response(internal_error(exc))

    # -- endpoints --------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(models_response(self.config.model.name, self.config.scheduler.max_model_len))

    async def _model(self, request: web.Request) -> web.Response:
        model_id = request.match_info["model_id"]
        if model_id != self.config.model.name:
            raise oa.APIError(404, f"model '{model_id}' does not exist; this server serves '{self.config.model.name}'",
                              param="model", code="model_not_found")
        return web.json_response(model_card(model_id, self.config.scheduler.max_model_len))

    async def _health(self, request: web.Request) -> web.Response:
        if not self.readiness.ready:  # starting: some needed role has no worker that ever answered
            body = {"status": "starting", "reason": self.readiness.report(),
                    "missing_roles": [r.value for r in self.readiness.missing_roles()],
                    "workers": {w.endpoint.worker_id: w.healthy for w in self.pool.all()}}
            return web.json_response(body, status=503, headers={"Retry-After": "1"})
        body, status = health_report(self.pool, self._colocated)  # ok, degraded (serving) or unavailable
        return web.json_response(body, status=status)

    async def _metrics(self, request: web.Request) -> web.Response:
        # The last poll's figures: polling here would let every scraper load every worker.
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    def _worker_figures(self) -> list[WorkerFigures]:
        return [WorkerFigures(w.endpoint.worker_id, w.endpoint.role.value, w.healthy, w.stats)
                for w in self.pool.all()]

    async def _workers(self, request: web.Request) -> web.Response:
        headers = {}
        if request.query.get("refresh"):
            try:  # paced and shared (pd.router.refresh): at most one poll per refresh_min_interval_s
                started = await self._refresh.refresh()
            except RefreshBusy as exc:
                return error_response(oa.APIError(429, str(exc), err_type="rate_limit_error",
                                                  code="refresh_rate_limited"), {"Retry-After": str(exc.retry_after_s)})
            headers = {"X-PDKV-Poll-Started": f"{started:.6f}", "X-PDKV-Polls": str(self._refresh.num_polls)}
        body = {w.endpoint.worker_id: {"role": w.endpoint.role.value, "url": w.endpoint.url, "healthy": w.healthy,
                                       "num_in_flight": w.num_in_flight, "num_queued_tokens": w.num_queued_tokens,
                                       "kv_index": (self.kv_index.describe(w.endpoint.worker_id)
                                                    if self.kv_index else None),
                                       "planner": self.planner.figures.describe_worker(w.endpoint.worker_id),
                                       "stats": w.stats} for w in self.pool.all()}
        return web.json_response(body, headers=headers)

    async def _planner(self, request: web.Request) -> web.Response:
        return web.json_response(self.planner.describe())

