"""A worker's internal HTTP API (router -> worker), on aiohttp.

Endpoints (all require `Authorization: Bearer <deployment secret>`):
- `POST /internal/generate`: a `pd.cluster.messages.GenerateRequest` (JSON) in, NDJSON out:
  one `TokenEvent` per line, the last one with `finished: true`;
- `GET /internal/health`: liveness and identity (503 while the worker cannot serve, e.g. its engine died);
- `GET /internal/stats`: engine, KV cache and transfer figures (`?audit=1`: with a pool audit);
- `POST /internal/reset_prefix_cache`: drops cached blocks that nothing references;
- `GET /internal/kv_events?after=N`: the KV event batches after seq N, or a snapshot of every
  cached hash when the history no longer reaches back (or when `after` is absent).
- `POST /internal/abort`: JSON `{request_id}`: aborts that request and ends any KV lease
  kept for it (the router's call when its client left after the prefill hop started).

Guarantees:
- a request whose client goes away (router closed the stream) is aborted in
  the engine, so its blocks are freed; that is logged once at INFO, never as an error;
- bad input gets a 400 JSON error naming the field; a wrong or missing secret
  gets 401 before any body is read;
- a request this worker can no longer finish through no fault of its own (its device failed in
  another request's step: `WorkerUnavailable`) ends its stream without a finished event, as if the
  worker had gone, so the router serves it elsewhere instead of failing it;
- `stop()` closes the listening socket and every open stream;
- a client costs bounded connections and time: header, body and idle timeouts and connection
  caps (`pd.cluster.http_guard`, settings `router.connections`, with the worker's keep-alive).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

from aiohttp import web

from pd.cluster.http_guard import ConnectionGuard, GuardedSite, GuardLimits
from pd.cluster.messages import TokenEvent

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 1024 * 1024


class WorkerUnavailable(RuntimeError):
    """This worker cannot take requests now (its engine died): answered 503, so the router
    tries another worker and takes this one out."""


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


class JobHandler(Protocol):
    """What the HTTP API serves; `pd.worker.worker.Worker` is the one implementation."""

    def parse_job(self, body: Any) -> Any: ...
    def begin_trace(self, job: Any, headers: Any) -> Any: ...
    def refuse(self, body: Any) -> None: ...
    def release_remote(self, params: Any) -> None: ...
    def generate(self, job: Any, trace_context: str | None = None) -> AsyncIterator[TokenEvent]: ...
    def abort(self, request_id: str) -> None: ...
    def health(self) -> dict: ...
    def stats(self, audit: bool = False) -> dict: ...
    def reset_prefix_cache(self) -> bool: ...
    def kv_events_replay(self, after_seq: int | None) -> dict: ...


class WorkerHTTPServer:
    def __init__(self, worker: JobHandler, secret: str, limits: GuardLimits | None = None) -> None:
        """`limits`: what one client may hold open (default: `GuardLimits()`'s, with a worker's keep-alive)."""
        self._worker = worker
        self._secret = secret.encode()
        self._limits = limits or GuardLimits(keepalive_timeout_s=75.0)
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    def _authorised(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        try:
            given = header.encode("utf-8")
        except UnicodeEncodeError:  # a non-UTF-8 header arrives as surrogate escapes: not our secret
            return False
        return hmac.compare_digest(given, b"Bearer " + self._secret)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if not self._authorised(request):
            return _error(401, "missing or wrong worker secret")
        return await handler(request)

    async def start(self, host: str, port: int = 0) -> int:
        # timeouts and connection caps (pd.cluster.http_guard), after the secret check: a refused
        # request's body is never read
        self.conn_guard = ConnectionGuard(self._limits, "worker-http")
        app = web.Application(middlewares=[self._auth, self.conn_guard.middleware], client_max_size=MAX_BODY_BYTES)
        app.add_routes([
            web.post("/internal/generate", self._generate),
            web.get("/internal/health", self._health),
            web.get("/internal/stats", self._stats),
            web.post("/internal/reset_prefix_cache", self._reset_prefix_cache),
            web.get("/internal/kv_events", self._kv_events),
            web.post("/internal/abort", self._abort),
        ])
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0,
                                     **self.conn_guard.runner_options())
        await self._runner.setup()
        site = GuardedSite(self._runner, self.conn_guard, host, port)
        await site.start()
        self.port = self._runner.addresses[-1][1]  # port 0 -> the one the OS picked
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        health = self._worker.health()  # 503 unless serving (e.g. its engine loop died): probes fail at once
        return web.json_response(health, status=200 if health.get("status") == "ok" else 503)

    async def _stats(self, request: web.Request) -> web.Response:
        audit = request.query.get("audit") in ("1", "true")
        return web.json_response(await asyncio.to_thread(self._worker.stats, audit))

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        return web.json_response({"reset": await asyncio.to_thread(self._worker.reset_prefix_cache)})

    async def _kv_events(self, request: web.Request) -> web.Response:
        raw = request.query.get("after")
        try:
            after = int(raw) if raw is not None else None
        except ValueError:
            return _error(400, "after must be an integer sequence number")
        try:
            return web.json_response(await asyncio.to_thread(self._worker.kv_events_replay, after))
        except RuntimeError as exc:
            return _error(404, str(exc))

    async def _abort(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            return _error(400, "body must be JSON")
        request_id = body.get("request_id") if isinstance(body, dict) else None
        if not isinstance(request_id, str) or not request_id or len(request_id) > 256:
            return _error(400, "request_id must be a non-empty string of at most 256 characters")
        self._worker.abort(request_id)
        return web.json_response({"aborted": request_id})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = None
        try:
            body = await request.json()
            job = self._worker.parse_job(body)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            return _error(400, "body must be JSON")
        except WorkerUnavailable as exc:
            return _error(503, str(exc))
        except ValueError as exc:
            self._worker.refuse(body)  # the producer must not keep blocks for a refused request
            return _error(400, str(exc))
        trace = self._worker.begin_trace(job, request.headers)  # None with tracing off
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson",
                                               **(trace.response_headers() if trace is not None else {})})
        try:
            await response.prepare(request)
        except BaseException as exc:
            if trace is not None:
                trace.end(error="aborted")
            if isinstance(exc, ConnectionError):  # the router left before the stream began: nothing ran
                logger.info("request %s: router went away before its stream started", job.request_id)
                self._worker.release_remote(job.kv_transfer_params)  # P's leased blocks go now, not at lease end
                return response  # (aiohttp's own write of the end then fails quietly)
            raise
        finished = False
        try:
            async for event in self._worker.generate(job, trace.pull_context if trace is not None else None):
                finished = event.finished
                if trace is not None:
                    trace.on_event(event)
                await response.write(event.model_dump_json(exclude_none=True).encode() + b"\n")
        except ConnectionError:  # the router closed the stream (its client left): not an error, no traceback
            logger.info("request %s: router went away, aborting", job.request_id)
            return response
        except WorkerUnavailable as exc:  # lost with this worker: the stream ends unfinished, the router retries
            logger.warning("request %s: %s", job.request_id, exc)
        except asyncio.CancelledError:
            logger.info("request %s: router went away, aborting", job.request_id)
            raise
        except Exception as exc:  # the stream has started: report in-band, never hang the router
            logger.exception("request %s failed", job.request_id)
            if not finished:
                await _write_quietly(response, TokenEvent(finished=True, finish_reason="error",
                                                          error=f"{type(exc).__name__}: {exc}"))
        finally:
            if not finished:
                self._worker.abort(job.request_id)
            if trace is not None:
                trace.end(error=None if finished else "aborted")
        try:
            await response.write_eof()
        except ConnectionError:  # gone after the last event: everything was sent
            logger.debug("request %s: router went away at the end of its stream", job.request_id)
        return response


async def _write_quietly(response: web.StreamResponse, event: TokenEvent) -> None:
    try:
        await response.write(event.model_dump_json(exclude_none=True).encode() + b"\n")
    except ConnectionError:
        pass
