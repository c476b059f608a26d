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
- a client that disconnects closes the worker stream, which aborts the request.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from pd.cluster.config import DeployConfig
from pd.cluster.messages import Sampling
from pd.router import openai_api as oa
from pd.router.admission import AdmissionGate, Overloaded
from pd.router.dispatch import Dispatcher
from pd.router.metrics import RouterMetrics
from pd.router.planner.explain import RouteNote
from pd.router.openai_responses import SSE_DONE, ChatFormat, CompletionFormat, Piece, Usage, sse_error
from pd.router.text_stream import TextStream

logger = logging.getLogger(__name__)

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


@dataclasses.dataclass(frozen=True)
class Job:
    """One validated request, ready to run: its prompts as token ids and how to shape the output."""

    prompts: list[list[int]]
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    output: CompletionFormat | ChatFormat


@dataclasses.dataclass
class _Tally:
    num_tokens: int = 0
    num_cached_tokens: int = 0
    route: RouteNote = dataclasses.field(default_factory=RouteNote)  # where the prompt went and why


class CompletionEndpoints:
    def __init__(self, config: DeployConfig, tokenizer: Any, dispatcher: Dispatcher, metrics: RouterMetrics,
                 gate: AdmissionGate) -> None:
        self._config = config
        self._tokenizer = tokenizer
        self._vocab_size = int(tokenizer.vocab_size)
        self._dispatcher = dispatcher
        self._metrics = metrics
        self._gate = gate

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, self._completion_job)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, self._chat_job)

    # -- requests -> jobs -------------------------------------------------
    def _completion_job(self, body: Any) -> Job:
        req = oa.parse_completion_request(body, served_model=self._config.model.name, vocab_size=self._vocab_size)
        limit = self._config.router.max_prompts_per_request
        if len(req.prompts) > limit:
            raise oa.APIError(400, f"at most {limit} prompts per request", param="prompt")
        prompts = [self._checked_prompt(self._tokenizer.encode(p) if isinstance(p, str) else list(p), req.max_tokens)
                   for p in req.prompts]
        return Job(prompts, req.sampling(req.max_tokens), req.stop_strings, req.stream,
                   CompletionFormat(self._config.model.name, req.include_usage,
                                    prompts if req.return_token_ids else None))

    def _chat_job(self, body: Any) -> Job:
        req = oa.parse_chat_request(body, served_model=self._config.model.name, vocab_size=self._vocab_size)
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
                   ChatFormat(self._config.model.name, req.include_usage, ids if req.return_token_ids else None))

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
    async def _handle(self, request: web.Request, build: Callable[[Any], Job]) -> web.StreamResponse:
        arrived = time.perf_counter()
        try:
            job = build(await _read_json(request))
        except oa.APIError as exc:
            return self._refuse(exc)
        try:
            admitted = await self._gate.acquire(len(job.prompts))
        except Overloaded as exc:
            return self._refuse(oa.server_error(exc.message, status=exc.status, code="overloaded"),
                                headers={"Retry-After": str(exc.retry_after_s)})
        try:
            if job.stream:
                return await self._stream(request, job, arrived)
            return await self._respond(job, arrived)
        finally:
            self._gate.release(admitted)

    def _refuse(self, exc: oa.APIError, headers: dict | None = None) -> web.Response:
        self._metrics.record_outcome(f"error_{exc.status}")
        return error_response(exc, headers)

    async def _respond(self, job: Job, arrived: float) -> web.Response:
        tallies = [_Tally() for _ in job.prompts]
        tasks = [asyncio.create_task(self._collect(job, f"{job.output.id}-{i}", ids, arrived, tally))
                 for i, (ids, tally) in enumerate(zip(job.prompts, tallies, strict=True))]
        try:
            outputs = await asyncio.gather(*tasks)
        except oa.APIError as exc:
            return self._refuse(exc)
        finally:
            for task in tasks:  # one prompt failed (or the client left): stop the others too
                task.cancel()
        usage = Usage.of(sum(len(p) for p in job.prompts), sum(t.num_tokens for t in tallies),
                         sum(t.num_cached_tokens for t in tallies))
        self._metrics.record_outcome("ok")
        body = job.output.response(outputs, usage)
        for choice, tally in zip(body["choices"], tallies, strict=True):
            choice["pdkv_route"] = tally.route.as_dict()
        return web.json_response(body)

    async def _collect(self, job: Job, request_id: str, prompt_ids: list[int], arrived: float,
                       tally: _Tally) -> tuple[str, str | None, list[int]]:
        pieces: list[str] = []
        token_ids: list[int] = []
        reason = None
        async for piece in self._pieces(job, request_id, prompt_ids, arrived, tally):
            pieces.append(piece.text)
            token_ids.extend(piece.token_ids)
            reason = piece.finish_reason
        return "".join(pieces), reason, token_ids

    async def _stream(self, request: web.Request, job: Job, arrived: float) -> web.StreamResponse:
        response = web.StreamResponse(headers=_SSE_HEADERS)
        await response.prepare(request)
        output, tally, error = job.output, _Tally(), None
        try:
            # The opening chunk (chat: the role delta) goes out with the first token, not before the
            # prefill: clients such as `vllm bench serve` take the first chunk's arrival as the TTFT.
            first = output.first_chunk()
            async for piece in self._pieces(job, f"{output.id}-0", job.prompts[0], arrived, tally):
                if first is not None:
                    await response.write(first)
                    first = None
                for chunk in output.chunks(piece):
                    await response.write(chunk)
            usage = output.usage_chunk(Usage.of(len(job.prompts[0]), tally.num_tokens, tally.num_cached_tokens))
            if usage is not None:
                await response.write(usage)
            self._metrics.record_outcome("ok")
        except ConnectionResetError:  # the client left; its worker stream is closed already
            return response
        except oa.APIError as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - the stream has started: the error must travel inside it
            logger.exception("streamed request %s failed", output.id)
            error = internal_error(exc)
        try:
            if error is not None:
                self._metrics.record_outcome(f"error_{error.status}")
                logger.warning("streamed request %s failed: %s", output.id, error.message)
                await response.write(sse_error(error))
            await response.write(SSE_DONE)
            await response.write_eof()
        except ConnectionResetError:
            pass
        return response

    async def _pieces(self, job: Job, request_id: str, prompt_ids: list[int], arrived: float,
                      tally: _Tally) -> AsyncIterator[Piece]:
        """Yields the output step by step (the last with its finish reason); records latency metrics."""
        text = TextStream(self._tokenizer, job.stop)
        last = None
        finish: str | None = None
        self._metrics.record_prompt_tokens(len(prompt_ids))
        events = self._dispatcher.stream_tokens(request_id, prompt_ids, job.sampling, tally.route)
        async with contextlib.aclosing(events) as stream:
            async for event in stream:
                now = time.perf_counter()
                if event.token_ids:
                    self._metrics.record_tokens(len(event.token_ids), now - (arrived if last is None else last),
                                                first=last is None)
                    last = now
                new = text.push(event.token_ids)
                tally.num_tokens = len(text.token_ids)
                tally.num_cached_tokens = max(tally.num_cached_tokens, event.num_cached_tokens)
                if text.stopped:
                    finish = "stop"
                    yield Piece(new, event.token_ids, finish, tally.route.as_dict())
                    break
                if event.finish_reason is not None:
                    new += text.flush()  # the held-back tail may itself complete a stop string
                    finish = "stop" if text.stopped else event.finish_reason
                    yield Piece(new, event.token_ids, finish, tally.route.as_dict())
                    break
                if event.token_ids:
                    yield Piece(new, event.token_ids)
        self._metrics.record_request_end(finish, time.perf_counter() - arrived)


async def _read_json(request: web.Request) -> Any:
    try:
        return await request.json()
    except (ValueError, RecursionError):  # bad JSON, bad UTF-8, or nesting deep enough to blow the stack
        raise oa.APIError(400, "request body is not valid JSON") from None


def internal_error(exc: BaseException) -> oa.APIError:
    """A bug's answer: its type only (the details, which may hold internals, go to the log)."""
    return oa.server_error(f"internal server error ({type(exc).__name__}); the router logged the details",
                           status=500, code="internal_error")


def error_response(exc: oa.APIError, headers: dict | None = None) -> web.Response:
    return web.json_response(exc.to_dict(), status=exc.status, headers=headers)
