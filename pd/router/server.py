"""The router: an OpenAI-compatible HTTP server in front of the P/D workers.

Endpoints: `POST /v1/completions`, `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus text) and `GET /pd/workers` (each worker's last
stats, pool audit included).

Guarantees:
- client input is validated before any worker is touched; errors are
  OpenAI-style JSON with a proper status code (400 bad input, 401 bad key,
  404 unknown model, 502/503/504 worker trouble);
- client-supplied `kv_transfer_params` are dropped (never forwarded);
- a streamed request whose worker fails gets an error event and `[DONE]`,
  never a hang; a client that disconnects aborts its request on the worker;
- a background health loop polls every worker's stats; two failed polls in a
  row take the worker out of the rotation.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time

from aiohttp import web
from pydantic import ValidationError

from pd.router import openai_api as oa
from pd.router.admission import AdmissionGate, AdmissionLimits, Overloaded
from pd.cluster.config import DeployConfig, Mode
from pd.cluster.messages import Sampling
from pd.cluster.schema import describe
from pd.router.dispatch import Dispatcher
from pd.router.metrics import RouterMetrics
from pd.router.choice import POLICIES, Role, WorkerEndpoint, WorkerPool
from pd.router.text_stream import TextStream
from pd.engine.tokenizer import ByteTokenizer, Tokenizer
from pd.router.worker_client import ClientTimeouts, WorkerCallError, WorkerClient

logger = logging.getLogger(__name__)

MAX_FAILED_POLLS = 2
STATS_TIMEOUT_S = 10.0
_FINISH_REASONS = {"stopped": "stop", "stop": "stop", "finished_stopped": "stop", "length": "length",
                   "length_capped": "length", "finished_length_capped": "length"}


class Router:
    def __init__(self, config: DeployConfig, endpoints: list[WorkerEndpoint], secret: str,
                 tokenizer: Tokenizer | None = None, policy: str = "least_loaded") -> None:
        self.config = config
        self.tokenizer = tokenizer or ByteTokenizer()
        self.pool = WorkerPool(POLICIES[policy]())
        for endpoint in endpoints:
            self.pool.add(endpoint)
        rc = config.router
        self.client = WorkerClient(secret, ClientTimeouts(connect_s=rc.connect_timeout_s, stall_s=rc.request_timeout_s,
                                                          total_s=rc.request_timeout_s))
        self.metrics = RouterMetrics()
        self._colocated = config.topology.mode is Mode.COLOCATED
        self.dispatcher = Dispatcher(self.pool, self.client, self.metrics, self._colocated)
        self._vocab_size = int(config.model.architecture.get("vocab_size", self.tokenizer.vocab_size))
        self._failed_polls: dict[str, int] = {}
        serving = (Role.BOTH,) if self._colocated else (Role.DECODE,)
        self.gate = AdmissionGate(
            lambda: rc.max_in_flight_per_worker * max(1, sum(len(self.pool.healthy(r)) for r in serving)),
            AdmissionLimits(rc.max_queued_requests, rc.queue_timeout_s, rc.retry_after_s))
        self._runner: web.AppRunner | None = None
        self._health_task: asyncio.Task | None = None
        self.url: str | None = None

    # -- life cycle -------------------------------------------------------
    async def start(self, host: str | None = None, port: int | None = None) -> str:
        await self.client.open()
        app = web.Application(middlewares=[self._api_key], client_max_size=self.config.router.max_body_bytes)
        app.add_routes([
            web.post("/v1/completions", self._completions),
            web.get("/v1/models", self._models),
            web.get("/health", self._health),
            web.get("/metrics", self._metrics),
            web.get("/pd/workers", self._workers),
        ])
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=2.0)
        await self._runner.setup()
        host = host or self.config.router.host
        site = web.TCPSite(self._runner, host, self.config.router.port if port is None else port)
        await site.start()
        bound = self._runner.addresses[-1][1]
        self.url = f"http://{host}:{bound}"
        await self.poll_workers()
        self._health_task = asyncio.create_task(self._health_loop())
        return self.url

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.client.close()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.router.health_interval_s)
            try:
                await self.poll_workers()
            except Exception:  # the loop must outlive any single bad poll
                logger.exception("worker poll failed")

    async def poll_workers(self) -> None:
        """Refreshes every healthy worker's stats. A worker whose stats and health probe
        both fail `MAX_FAILED_POLLS` times in a row leaves the rotation (a slow stats
        answer from a busy worker is not a death)."""
        loads = [w for w in self.pool.all() if w.healthy]
        results = await asyncio.gather(*(self._poll_one(w) for w in loads))
        for load, error in zip(loads, results):
            worker_id = load.endpoint.worker_id
            if error is None:
                self._failed_polls[worker_id] = 0
                continue
            self._failed_polls[worker_id] = self._failed_polls.get(worker_id, 0) + 1
            if self._failed_polls[worker_id] >= MAX_FAILED_POLLS:
                self.pool.mark_dead(worker_id, f"{MAX_FAILED_POLLS} failed polls: {error}")

    async def _poll_one(self, load) -> str | None:
        """None when the worker answered; else why not."""
        url = load.endpoint.url
        try:
            stats = await self.client.get_json(url, "/internal/stats", timeout_s=STATS_TIMEOUT_S)
            self.pool.update_stats(load.endpoint.worker_id, stats)
            return None
        except WorkerCallError as stats_error:
            try:
                await self.client.get_json(url, "/internal/health")
                return None
            except WorkerCallError as health_error:
                return f"stats: {stats_error}; health: {health_error}"

    # -- middleware -------------------------------------------------------
    @web.middleware
    async def _api_key(self, request: web.Request, handler):
        key = self.config.router.api_key
        if key and request.path.startswith(("/v1/", "/pd/")):
            header = request.headers.get("Authorization", "")
            if not hmac.compare_digest(header.encode(), f"Bearer {key}".encode()):
                return _error_response(oa.APIError(401, "invalid or missing API key", code="invalid_api_key"))
        try:
            return await handler(request)
        except web.HTTPException as exc:  # aiohttp's own 404/405: answer in OpenAI's shape too
            return _error_response(oa.APIError(exc.status, exc.reason, code=str(exc.status)))

    # -- endpoints --------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(oa.models_response(self.config.model.name, self.config.scheduler.max_model_len))

    async def _health(self, request: web.Request) -> web.Response:
        roles = (Role.BOTH,) if self._colocated else (Role.PREFILL, Role.DECODE)
        missing = [r.value for r in roles if not self.pool.healthy(r)]
        body = {"status": "ok" if not missing else "unavailable", "missing_roles": missing,
                "workers": {w.endpoint.worker_id: w.healthy for w in self.pool.all()}}
        return web.json_response(body, status=200 if not missing else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        await self.poll_workers()  # fresh worker figures on every scrape
        workers = [(w.endpoint.worker_id, w.endpoint.role.value, w.healthy, w.stats) for w in self.pool.all()]
        return web.Response(body=self.metrics.render(workers).encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _workers(self, request: web.Request) -> web.Response:
        if request.query.get("refresh"):
            await self.poll_workers()
        body = {w.endpoint.worker_id: {"role": w.endpoint.role.value, "url": w.endpoint.url, "healthy": w.healthy,
                                       "num_in_flight": w.num_in_flight, "stats": w.stats} for w in self.pool.all()}
        return web.json_response(body)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        arrived = time.perf_counter()
        try:
            try:
                body = await request.json()
            except (ValueError, RecursionError):  # bad JSON, bad UTF-8, or nesting deep enough to blow the stack
                raise oa.APIError(400, "request body is not valid JSON") from None
            req = oa.parse_completion_request(body, served_model=self.config.model.name, vocab_size=self._vocab_size)
            if len(req.prompts) > self.config.router.max_prompts_per_request:
                raise oa.APIError(400, f"at most {self.config.router.max_prompts_per_request} prompts per request",
                                  param="prompt")
            prompts = [self._prompt_ids(p, req.max_tokens) for p in req.prompts]
        except oa.APIError as exc:
            self.metrics.requests.inc(outcome=f"error_{exc.status}")
            return _error_response(exc)
        try:
            admitted = await self.gate.acquire(len(prompts))
        except Overloaded as exc:
            self.metrics.requests.inc(outcome=f"error_{exc.status}")
            return _error_response(oa.server_error(exc.message, status=exc.status, code="overloaded"),
                                   headers={"Retry-After": str(exc.retry_after_s)})
        try:
            return await self._serve(request, req, prompts, arrived)
        finally:
            self.gate.release(admitted)

    async def _serve(self, request: web.Request, req: oa.CompletionRequest, prompts: list[list[int]],
                     arrived: float) -> web.StreamResponse:
        completion_id = oa.new_completion_id()
        if req.stream:
            return await self._stream(request, req, completion_id, prompts[0], arrived)
        tasks = [asyncio.create_task(self._collect(req, f"{completion_id}-{i}", ids, arrived))
                 for i, ids in enumerate(prompts)]
        try:
            results = await asyncio.gather(*tasks)
        except oa.APIError as exc:
            self.metrics.requests.inc(outcome=f"error_{exc.status}")
            return _error_response(exc)
        finally:
            for task in tasks:  # one prompt failed (or the client left): stop the others too
                task.cancel()
        choices = [oa.choice(i, text, reason, ids if req.return_token_ids else None)
                   for i, (text, reason, ids) in enumerate(results)]
        usage = oa.usage_dict(sum(len(p) for p in prompts), sum(len(ids) for _, _, ids in results))
        self.metrics.requests.inc(outcome="ok")
        return web.json_response(oa.completion_response(completion_id, req.model, choices, usage))

    def _prompt_ids(self, prompt: str | tuple[int, ...], max_tokens: int) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        limit = self.config.scheduler.max_model_len
        if len(ids) + max_tokens > limit:
            raise oa.APIError(400, f"this model's maximum context length is {limit} tokens; the prompt has "
                                   f"{len(ids)} tokens and max_tokens is {max_tokens}", param="max_tokens",
                              code="context_length_exceeded")
        max_prompt = self.config.router.max_prompt_tokens or limit - 1
        if len(ids) > max_prompt:
            raise oa.APIError(400, f"the prompt has {len(ids)} tokens; this server accepts at most {max_prompt}",
                              param="prompt", code="prompt_too_long")
        return ids

    def _sampling(self, req: oa.CompletionRequest) -> Sampling:
        try:
            return Sampling(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                            top_k=max(0, req.top_k), seed=req.seed, stop_token_ids=list(req.stop_token_ids),
                            ignore_eos=req.ignore_eos)
        except ValidationError as exc:  # a value the OpenAI parser let through but no worker takes
            raise oa.APIError(400, describe(exc)) from None

    async def _tokens(self, req: oa.CompletionRequest, request_id: str, prompt_ids: list[int], arrived: float):
        """Yields (new text, new token ids, finish reason or None, num tokens so far); records latency metrics."""
        text = TextStream(self.tokenizer, req.stop)
        last = None
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        events = self.dispatcher.stream_tokens(request_id, prompt_ids, self._sampling(req))
        async with contextlib.aclosing(events) as stream:
            async for event in stream:
                now = time.perf_counter()
                if event.token_ids:
                    if last is None:
                        self.metrics.ttft.observe(now - arrived)
                    else:
                        self.metrics.itl.observe(now - last)
                    last = now
                    self.metrics.generation_tokens.inc(len(event.token_ids))
                new = text.push(event.token_ids)
                ids = list(event.token_ids)
                if text.stopped:
                    yield new, ids, "stop", len(text.token_ids)
                    break
                if event.finish_reason is not None:
                    reason = _FINISH_REASONS.get(event.finish_reason, event.finish_reason)
                    yield new + text.flush(), ids, reason, len(text.token_ids)
                    break
                if event.token_ids:  # one chunk per token event, even when its text is held back
                    yield new, ids, None, len(text.token_ids)
        self.metrics.e2e.observe(time.perf_counter() - arrived)

    async def _collect(self, req: oa.CompletionRequest, request_id: str, prompt_ids: list[int], arrived: float):
        pieces, token_ids, reason = [], [], None
        async for new, ids, reason, _ in self._tokens(req, request_id, prompt_ids, arrived):
            pieces.append(new)
            token_ids.extend(ids)
        return "".join(pieces), reason, token_ids

    async def _stream(self, request: web.Request, req: oa.CompletionRequest, completion_id: str,
                      prompt_ids: list[int], arrived: float) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        created = int(time.time())
        num_tokens = 0
        try:
            async for new, ids, reason, num_tokens in self._tokens(req, f"{completion_id}-0", prompt_ids, arrived):
                piece = oa.choice(0, new, reason, ids if req.return_token_ids else None)
                await response.write(oa.stream_chunk(completion_id, req.model, created, [piece]))
            if req.include_usage:
                usage = oa.usage_dict(len(prompt_ids), num_tokens)
                await response.write(oa.stream_chunk(completion_id, req.model, created, [], usage))
            self.metrics.requests.inc(outcome="ok")
        except oa.APIError as exc:
            self.metrics.requests.inc(outcome=f"error_{exc.status}")
            logger.warning("streamed request %s failed: %s", completion_id, exc.message)
            await response.write(oa.sse_error(exc))
        await response.write(oa.SSE_DONE)
        await response.write_eof()
        return response


def _error_response(exc: oa.APIError, headers: dict | None = None) -> web.Response:
    return web.json_response(exc.to_dict(), status=exc.status, headers=headers)

