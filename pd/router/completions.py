"""The router's generation endpoints: `POST /v1/completions` and `POST /v1/chat/completions`.

Both run the same flow: validate (pd.router.openai_api), turn the prompt or
the chat messages into token ids, wait for admission, run each prompt through
the `Dispatcher`, detokenise incrementally (`TextStream`, stop strings) and
shape the output for the endpoint (pd.router.openai_responses).

Guarantees:
- input is validated before any worker is touched; every refusal is
  OpenAI error JSON naming the field;
- chat messages are rendered with the tokenizer's chat template and encoded
  by `Tokenizer.encode_chat`: a checkpoint's template writes its own BOS, so
  none is added on top and a prompt never starts with two;
- a stream that fails after it started ends with an error event and
  `data: [DONE]`, whatever the failure (worker trouble or a bug here);
- a client that disconnects closes the worker stream, which aborts the request;
- every request to these endpoints is counted once in `pdkv_requests_total`, under one outcome
  (`count_outcome`, called by the router's middleware: refusals before the handler count too);
  a stream's outcome is set as it ends (`OUTCOME`), anything else's is its status;
- a body over `INLINE_BODY_BYTES` is decoded, validated, templated and tokenized
  on a one-thread pool, off the event loop: the loop, `/health` and every
  other request go on meanwhile (waiting only for GIL hand-offs and GC pauses,
  which `CompletionEndpoints.tune_process` keeps short).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from pd.cluster.config import DeployConfig
from pd.cluster.messages import Sampling
from pd.cluster.tracing import Tracing
from pd.cluster.tracing_config import resolve_tracing
from pd.router import openai_api as oa
from pd.router.admission import AdmissionGate, Overloaded
from pd.router.dispatch import Dispatcher
from pd.router.metrics import RouterMetrics
from pd.router.planner.explain import RouteNote
from pd.router.openai_responses import SSE_DONE, ChatFormat, CompletionFormat, Piece, Usage, sse_error
from pd.router.text_stream import TextStream
from pd.router.timeline import Timeline
from pd.router.process_tuning import PROCESS_TUNING
from pd.router.tenancy import Tenancy

logger = logging.getLogger(__name__)

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})  # what pdkv_requests_total counts
OUTCOME = web.RequestKey("pdkv_outcome", str)  # a stream's outcome: its status (200) does not say it
CLIENT_DISCONNECTED = "client_disconnected"
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# Bodies up to this size are parsed, validated and tokenized on the event loop: that takes well under a
# millisecond, less than a hop to a thread. Larger ones (a 1 MiB chat body takes 100+ ms) go to the pool.
INLINE_BODY_BYTES = 32 * 1024
# One thread: the work holds the GIL for most of its time, so more threads would not go faster, and a
# second body parsed beside the first doubles the objects alive, hence the length of every GC pause (measured
# with 16 concurrent 1 MB bodies: /health p50 2 ms with one thread, 26-52 ms with two).
NUM_PARSE_THREADS = 1


@dataclasses.dataclass(frozen=True)
class Job:
    """One validated request, ready to run: its prompts as token ids and how to shape the output."""

    prompts: list[list[int]]
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    output: CompletionFormat | ChatFormat
    cache_salt: str | None = None  # the client's; the tenant's salt is folded in before it runs


@dataclasses.dataclass
class _Tally:
    num_tokens: int = 0
    num_cached_tokens: int = 0
    route: RouteNote = dataclasses.field(default_factory=RouteNote)  # where the prompt went and why


class CompletionEndpoints:
    """The generation endpoints. Request bodies larger than `INLINE_BODY_BYTES` are decoded, validated,
    templated and tokenized on a bounded thread pool (`NUM_PARSE_THREADS` threads), never on the event
    loop, so a large body stalls neither `/health` nor other requests for its whole processing time."""

    def __init__(self, config: DeployConfig, tokenizer: Any, dispatcher: Dispatcher, metrics: RouterMetrics,
                 gate: AdmissionGate, tenancy: Tenancy | None = None) -> None:
        self._config = config
        self._tenancy = tenancy  # cache salts per tenant (pd.router.tenancy); None: the client's salt as given
        self._tokenizer = tokenizer
        self.vocab_size = int(tokenizer.vocab_size)
        self._dispatcher = dispatcher
        self._metrics = metrics
        self._gate = gate
        self._parsers = ThreadPoolExecutor(NUM_PARSE_THREADS, thread_name_prefix="pd-router-parse")
        self._tuned = False  # holds the process settings of `tune_process`
        self._tracing = Tracing.start(resolve_tracing(config.tracing), "pdkv-router")  # off: Tracing.off()

    def tune_process(self) -> None:
        """Called once the router is up; `close` undoes it. The parse thread shares the GIL and the
        collector with the event loop, so three process settings decide how long the loop waits for it:
        - every object alive now (config, tokenizer, libraries) leaves the cyclic collector's reach: a
          collection a large body sets off stops every thread, and then walks that body's objects only,
          not the whole process (measured: one 1 MB chat body spent 230 ms of its 0.8 s in a full
          collection, 8 ms once frozen);
        - young collections come every `GC_GEN0_THRESHOLD` new objects, not every 700: a 29k-message body
          no longer sets off dozens of them, and a full one every hundred;
        - a thread hands the GIL on after `GIL_SWITCH_INTERVAL_S`, not Python's 5 ms: the loop, woken by a
          socket, waits that long at most (measured, 16 concurrent 1 MB bodies: a small completion's
          slowest answer 190-210 ms instead of 650-730 ms)."""
        if not self._tuned:
            self._tuned = True
            PROCESS_TUNING.hold()

    def close(self) -> None:
        """Ends the parse thread (a request still parsing finishes first) and undoes `tune_process`."""
        self._parsers.shutdown(wait=False, cancel_futures=True)
        self._tracing.close()
        if self._tuned:
            self._tuned = False
            PROCESS_TUNING.release()


    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, self._completion_job, "text_completion")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, self._chat_job, "chat")

    # -- requests -> jobs -------------------------------------------------
    def _completion_job(self, body: Any) -> Job:
        req = oa.parse_completion_request(body, served_model=self._config.model.name, vocab_size=self.vocab_size)
        limit = self._config.router.max_prompts_per_request
        if len(req.prompts) > limit:
            raise oa.APIError(400, f"at most {limit} prompts per request", param="prompt")
        prompts = [self._checked_prompt(self._tokenizer.encode(p) if isinstance(p, str) else list(p), req.max_tokens)
                   for p in req.prompts]
        return Job(prompts, req.sampling(req.max_tokens), req.stop_strings, req.stream,
                   CompletionFormat(self._config.model.name, req.include_usage,
                                    prompts if req.return_token_ids else None), req.cache_salt)

    def _chat_job(self, body: Any) -> Job:
        req = oa.parse_chat_request(body, served_model=self._config.model.name, vocab_size=self.vocab_size)
        messages = [m.rendered() for m in req.messages]
        try:
            ids = self._tokenizer.encode_chat(messages, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - a template refusing the conversation (jinja raise_exception etc.)
            raise oa.APIError(400, f"the messages do not fit the model's chat template: {exc}",
                              param="messages") from None
        max_tokens = req.max_new_tokens
        if max_tokens is None:  # as OpenAI: up to the context length
            max_tokens = max(1, self._config.scheduler.max_model_len - len(ids))
        return Job([self._checked_prompt(ids, max_tokens)], req.sampling(max_tokens), req.stop_strings, req.stream,
                   ChatFormat(self._config.model.name, req.include_usage, ids if req.return_token_ids else None),
                   req.cache_salt)

    def _checked_prompt(self, ids: list[int], max_tokens: int) -> list[int]:
        limit = self._config.scheduler.max_model_len
        if not ids:
            raise oa.APIError(400, "the prompt is empty", param="prompt")
        if len(ids) + max_tokens > limit:
            raise oa.APIError(400, f"this model's maximum context length is {limit} tokens; the prompt has "
                                   f"{len(ids)} tokens and max_tokens is {max_tokens}", param="max_tokens",
                              code="context_length_exceeded")
        max_prompt = self._config.router.max_prompt_tokens or limit - 1
        if len(ids) > max_prompt:
            raise oa.APIError(400, f"the prompt has {len(ids)} tokens; this server accepts at most {max_prompt}",
                              param="prompt", code="prompt_too_long")
        return ids

    # -- serving ----------------------------------------------------------
    async def _handle(self, request: web.Request, build: Callable[[Any], Job], operation: str) -> web.StreamResponse:
        """Serves one request; its timeline (pd.router.timeline) ends with it, whatever the way out."""
        timeline = Timeline.begin(request.headers, self._tracing, operation, self._config.model.name,
                                  self._config.router.report_cached_tokens)
        try:
            response = await self._serve(request, build, timeline)
            timeline.status = response.status
            return response
        finally:
            timeline.finish(self._metrics)

    async def _serve(self, request: web.Request, build: Callable[[Any], Job], timeline: Timeline) -> web.StreamResponse:
        try:
            raw = await request.read()  # over router.max_body_bytes: 413 (the middleware answers it)
            charset = request.charset or "utf-8"
            if len(raw) <= INLINE_BODY_BYTES:
                job = build(timeline.parsed(decode_json(raw, charset)))
            else:
                job = await asyncio.get_running_loop().run_in_executor(
                    self._parsers, lambda: build(timeline.parsed(decode_json(raw, charset))))
            timeline.mark("tokenized")
        except oa.APIError as exc:
            return self._refuse(exc)
        if timeline.span is not None:
            timeline.describe_job(job.sampling.max_tokens, job.sampling.temperature, job.sampling.top_p,
                                  job.output.id, job.prompts)
        if self._tenancy is not None:  # per_api_key: the tenant's own prefix cache (pd.router.tenancy)
            job = dataclasses.replace(job, cache_salt=self._tenancy.cache_salt(self._tenancy.tenant(request),
                                                                               job.cache_salt))
        try:
            admitted = await self._gate.acquire(len(job.prompts))
            timeline.mark("admitted")
        except Overloaded as exc:
            return self._refuse(oa.server_error(exc.message, status=exc.status, code="overloaded"),
                                headers={"Retry-After": str(exc.retry_after_s)})
        try:
            if job.stream:
                return await self._stream(request, job, timeline)
            return await self._respond(job, timeline)
        finally:
            self._gate.release(admitted)

    def _reported(self, num_cached_tokens: int) -> int | None:
        """None (usage without prompt_tokens_details) unless `router.report_cached_tokens`: a hit
        count tells a client what others sent, where the prefix cache is shared."""
        return num_cached_tokens if self._config.router.report_cached_tokens else None

    def _route(self, tally: _Tally) -> dict | None:
        """The `pdkv_route` extension, only with `router.report_route`: it names workers and their
        predicted TTFTs, which tell a client about other clients' load and cache."""
        return tally.route.as_dict() if self._config.router.report_route else None

    def _refuse(self, exc: oa.APIError, headers: dict | None = None) -> web.Response:
        return error_response(exc, headers)  # counted by its status (count_outcome)

    async def _respond(self, job: Job, timeline: Timeline) -> web.Response:
        tallies = [_Tally() for _ in job.prompts]
        tasks = [asyncio.create_task(self._collect(job, f"{job.output.id}-{i}", ids, timeline, tally))
                 for i, (ids, tally) in enumerate(zip(job.prompts, tallies, strict=True))]
        try:
            outputs = await asyncio.gather(*tasks)
        except oa.APIError as exc:
            return self._refuse(exc)
        finally:
            for task in tasks:  # one prompt failed (or the client left): stop the others too
                task.cancel()
        usage = Usage.of(sum(len(p) for p in job.prompts), sum(t.num_tokens for t in tallies),
                         self._reported(sum(t.num_cached_tokens for t in tallies)))
        body = job.output.response(outputs, usage)
        if self._config.router.report_route:
            for choice, tally in zip(body["choices"], tallies, strict=True):
                choice["pdkv_route"] = tally.route.as_dict()
        if timeline.want_extension:  # x-pdkv-timing: 1
            body["pdkv_timing"] = timeline.extension()
        return web.json_response(body)

    async def _collect(self, job: Job, request_id: str, prompt_ids: list[int], timeline: Timeline,
                       tally: _Tally) -> tuple[str, str | None, list[int]]:
        pieces: list[str] = []
        token_ids: list[int] = []
        reason = None
        async for piece in self._pieces(job, request_id, prompt_ids, timeline, tally):
            pieces.append(piece.text)
            token_ids.extend(piece.token_ids)
            reason = piece.finish_reason
        return "".join(pieces), reason, token_ids

    async def _stream(self, request: web.Request, job: Job, timeline: Timeline) -> web.StreamResponse:
        response = web.StreamResponse(headers=_SSE_HEADERS)
        try:
            await response.prepare(request)
        except ConnectionError:  # the client left before the stream began: nothing was sent to a worker
            logger.info("client left before its stream %s began", job.output.id)
            timeline.error = request[OUTCOME] = CLIENT_DISCONNECTED
            return response
        output, tally, error = job.output, _Tally(), None
        try:
            # The opening chunk (chat: the role delta) goes out with the first token, not before the
            # prefill: clients such as `vllm bench serve` take the first chunk's arrival as the TTFT.
            first = output.first_chunk()
            async for piece in self._pieces(job, f"{output.id}-0", job.prompts[0], timeline, tally):
                wrote = first is not None
                if first is not None:
                    await response.write(first)
                    first = None
                for chunk in output.chunks(piece):
                    await response.write(chunk)
                    wrote = True
                if wrote:  # text held back (a stop string may be forming) is not a first chunk yet
                    timeline.mark("first_chunk")
            usage = timeline.final_chunk(output.usage_chunk(Usage.of(len(job.prompts[0]), tally.num_tokens,
                                                                     self._reported(tally.num_cached_tokens))),
                                         output.id, output.created, output.model, _chunk_object(output))
            if usage is not None:
                await response.write(usage)
        except ConnectionResetError:  # the client left; its worker stream is closed already
            timeline.error = request[OUTCOME] = CLIENT_DISCONNECTED
            return response
        except asyncio.CancelledError:  # the client left, or router shutdown past its drain time
            if client_gone(request):
                timeline.error = request[OUTCOME] = CLIENT_DISCONNECTED
                raise
            request[OUTCOME] = "error_503"  # the stream still ends as one
            with contextlib.suppress(ConnectionError, RuntimeError):
                await response.write(sse_error(oa.server_error("the router is shutting down", status=503,
                                                               code="shutting_down")))
                await response.write(SSE_DONE)
                await response.write_eof()
            raise
        except oa.APIError as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - the stream has started: the error must travel inside it
            logger.exception("streamed request %s failed", output.id)
            error = internal_error(exc)
        try:
            if error is not None:
                timeline.error = error.code or str(error.status)
                request[OUTCOME] = f"error_{error.status}"
                logger.warning("streamed request %s failed: %s", output.id, error.message)
                await response.write(sse_error(error))
            await response.write(SSE_DONE)
            await response.write_eof()
        except ConnectionResetError:  # left before the end: an error already set stays the outcome
            if OUTCOME not in request:
                request[OUTCOME] = CLIENT_DISCONNECTED
            timeline.error = timeline.error or CLIENT_DISCONNECTED
            return response
        if error is None:  # all written; a client gone by now did not read it all
            request[OUTCOME] = CLIENT_DISCONNECTED if client_gone(request) else "ok"
        return response

    async def _pieces(self, job: Job, request_id: str, prompt_ids: list[int], timeline: Timeline,
                      tally: _Tally) -> AsyncIterator[Piece]:
        """Yields the output step by step (the last with its finish reason); records latency metrics."""
        text = TextStream(self._tokenizer, job.stop)
        last = None
        finish: str | None = None
        self._metrics.record_prompt_tokens(len(prompt_ids))
        events = self._dispatcher.stream_tokens(request_id, prompt_ids, job.sampling, tally.route,
                                                cache_salt=job.cache_salt, timeline=timeline)
        arrived = timeline.arrived
        async with contextlib.aclosing(events) as stream:
            async for event in stream:
                now = time.perf_counter()
                if event.token_ids:
                    if last is None:
                        timeline.mark("first_token", now)
                    self._metrics.record_tokens(len(event.token_ids), now - (arrived if last is None else last),
                                                first=last is None)
                    last = now
                new = text.push(event.token_ids)
                tally.num_tokens = len(text.token_ids)
                tally.num_cached_tokens = max(tally.num_cached_tokens, event.num_cached_tokens)
                if text.stopped:
                    finish = "stop"
                    yield Piece(new, event.token_ids, finish, self._route(tally))
                    break
                if event.finish_reason is not None:
                    new += text.flush()  # the held-back tail may itself complete a stop string
                    finish = "stop" if text.stopped else event.finish_reason
                    yield Piece(new, event.token_ids, finish, self._route(tally))
                    break
                if event.token_ids:
                    yield Piece(new, event.token_ids)
        self._metrics.record_request_end(finish, time.perf_counter() - arrived)
        timeline.prompt_done(len(prompt_ids), tally.num_tokens, tally.num_cached_tokens, finish)


def _chunk_object(output: CompletionFormat | ChatFormat) -> str:
    return "chat.completion.chunk" if isinstance(output, ChatFormat) else "text_completion"


def _keep(obj: dict) -> dict:
    return obj


def decode_json(raw: bytes, charset: str = "utf-8") -> Any:
    """A request body's JSON. The object hook is a Python function on purpose: the C parser calls it for
    every object, which lets the interpreter hand the GIL to the event loop while a large body is parsed
    on a pool thread (without it one `json.loads` holds the GIL for the whole body)."""
    try:
        return json.loads(raw.decode(charset), object_hook=_keep)
    except (ValueError, RecursionError):  # bad JSON, bad UTF-8, or nesting deep enough to blow the stack
        raise oa.APIError(400, "request body is not valid JSON") from None
    except LookupError:  # a Content-Type charset Python does not know
        raise oa.APIError(400, f"unknown charset '{charset}' in Content-Type") from None


def client_gone(request: web.Request) -> bool:
    """Whether the request's connection is closed or closing (its client left)."""
    transport = request.transport
    return transport is None or transport.is_closing()


def count_outcome(request: web.Request, response: web.StreamResponse | None) -> str:
    """The one outcome a request to a generation endpoint counts under (docs/observability.md): a stream's
    own (`OUTCOME`); else, with no `response` (the handler was cancelled), `client_disconnected` or, the
    client still there, `error_503` (the router shutting down); else `client_disconnected` when the client
    left before its answer was sent, or `ok` / `error_<status>`."""
    if OUTCOME in request:
        return request[OUTCOME]
    if client_gone(request):
        return CLIENT_DISCONNECTED
    if response is None:
        return "error_503"
    return "ok" if response.status < 400 else f"error_{response.status}"


def internal_error(exc: BaseException) -> oa.APIError:
    """A bug's answer: its type only (the details, which may hold internals, go to the log)."""
    return oa.server_error(f"internal server error ({type(exc).__name__}); the router logged the details",
                           status=500, code="internal_error")


def error_response(exc: oa.APIError, headers: dict | None = None) -> web.Response:
    """The error as OpenAI JSON, with `headers` (default: the error's own)."""
    return web.json_response(exc.to_dict(), status=exc.status, headers=headers if headers is not None else exc.headers)
