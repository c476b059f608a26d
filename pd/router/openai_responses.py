"""OpenAI response schemas: completions, chat completions, their stream chunks, models, SSE framing.

`CompletionFormat` and `ChatFormat` shape one request's output for its
endpoint, so the generation flow (pd.router.completions) is written once.

Guarantees: a stream carries a usage chunk (`choices: []`) only when the
client asked for it (`stream_options.include_usage`); every chunk's JSON has
the fields the `openai` client reads; `usage.prompt_tokens_details.cached_tokens`
is present (0 when nothing was cached) unless `router.report_cached_tokens` is false,
which leaves `prompt_tokens_details` out. With `return_token_ids` (vLLM's
extension) the token ids come along, and are absent otherwise: completions'
choices carry `prompt_token_ids` (a stream: on its first chunk) and `token_ids`;
chat responses carry `prompt_token_ids` (a stream: on its first chunk) and each
choice `token_ids`; a stream's chunks, joined, carry every generated id once, in
order, as the non-streamed response does. `pdkv_route` (where a prompt was prefilled and
why) is there only with `router.report_route` (off by default).
"""
from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, model_serializer
from pydantic_core import to_json

from pd.router.openai_api import APIError

SSE_DONE = b"data: [DONE]\n\n"


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None  # None (left out): router.report_cached_tokens is off

    @classmethod
    def of(cls, num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int | None = 0) -> Usage:
        details = None if num_cached_tokens is None else PromptTokensDetails(cached_tokens=num_cached_tokens)
        return cls(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                   total_tokens=num_prompt_tokens + num_completion_tokens, prompt_tokens_details=details)

    @model_serializer(mode="wrap")
    def _without_absent_details(self, handler):
        out = handler(self)
        if out.get("prompt_tokens_details", 0) is None:
            del out["prompt_tokens_details"]
        return out


class _OptionalIds(BaseModel):
    """A body whose token-id fields (an extension) are left out of the JSON when not asked for."""

    @model_serializer(mode="wrap")
    def _without_absent_ids(self, handler):
        out = handler(self)
        for name in ("token_ids", "prompt_token_ids", "pdkv_route"):
            if name in out and out[name] is None:
                del out[name]
        return out


class CompletionChoice(_OptionalIds):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None
    token_ids: list[int] | None = None  # extension: only with `return_token_ids`
    prompt_token_ids: list[int] | None = None  # extension: only with `return_token_ids` (a stream: first chunk)
    pdkv_route: dict | None = None  # extension: where the prompt was prefilled and why, on the last chunk


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_OptionalIds):
    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: str | None
    token_ids: list[int] | None = None  # extension: only with `return_token_ids`


class ChatCompletion(_OptionalIds):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None  # extension: only with `return_token_ids`


class ChatDelta(BaseModel):
    """A stream step: `role` on the first chunk, `content` on content chunks, empty on the last."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _only_what_changed(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(_OptionalIds):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # extension: this chunk's new ids, only with `return_token_ids`
    pdkv_route: dict | None = None  # extension: on the last chunk (see CompletionChoice)


class ChatCompletionChunk(_OptionalIds):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # extension: on the first chunk, only with `return_token_ids`


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "pdkv"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


@dataclasses.dataclass(frozen=True)
class Piece:
    """One step of one choice's output: new text, new token ids, and the finish reason on the last."""

    text: str
    token_ids: Sequence[int]
    finish_reason: str | None = None
    route: dict | None = None  # the `pdkv_route` extension, on the last piece


def sse(model: BaseModel, *, with_usage: bool = True) -> bytes:
    exclude = None if with_usage else {"usage"}
    return b"data: " + model.model_dump_json(exclude=exclude).encode() + b"\n\n"


def sse_error(error: APIError) -> bytes:
    return b"data: " + json.dumps(error.to_dict()).encode() + b"\n\n"


class CompletionFormat:
    """`/v1/completions` output. `prompt_token_ids` (one list per prompt) is None unless the
    client asked for the token ids (`return_token_ids`)."""

    def __init__(self, model: str, include_usage: bool, prompt_token_ids: list[list[int]] | None = None) -> None:
        self.id, self.model, self.created = f"cmpl-{uuid.uuid4().hex}", model, int(time.time())
        self._include_usage = include_usage
        self._prompt_token_ids = prompt_token_ids
        self._num_chunks = 0

    def _choice(self, index: int, piece: Piece, token_ids: list[int], with_prompt: bool) -> CompletionChoice:
        ids = self._prompt_token_ids
        return CompletionChoice(index=index, text=piece.text, finish_reason=piece.finish_reason,
                                token_ids=token_ids if ids is not None else None,
                                prompt_token_ids=ids[index] if ids is not None and with_prompt else None,
                                pdkv_route=piece.route)

    def first_chunk(self) -> bytes | None:
        return None

    def chunks(self, piece: Piece) -> list[bytes]:
        """One chunk per token event, even when its text is held back (a stop string may start there);
        the first carries the prompt's ids when they were asked for."""
        body = Completion(id=self.id, created=self.created, model=self.model,
                          choices=[self._choice(0, piece, list(piece.token_ids), self._num_chunks == 0)])
        self._num_chunks += 1
        return [sse(body, with_usage=self._include_usage)]

    def usage_chunk(self, usage: Usage) -> bytes | None:
        if not self._include_usage:
            return None
        return sse(Completion(id=self.id, created=self.created, model=self.model, choices=[], usage=usage))

    def response(self, outputs: list[tuple[str, str | None, list[int]]], usage: Usage) -> dict:
        choices = [self._choice(i, Piece(text, (), reason), ids, True) for i, (text, reason, ids) in enumerate(outputs)]
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices,
                          usage=usage).model_dump(mode="json", exclude_none=False)


_MARK = "\u0000pdkv content\u0000"  # stands for a chunk's text while its frame is made


class ChatFormat:
    """`/v1/chat/completions` output: a role delta first, content deltas, then the finish reason.

    `prompt_token_ids` is None unless the client asked for the token ids (`return_token_ids`).
    """

    def __init__(self, model: str, include_usage: bool, prompt_token_ids: list[int] | None = None) -> None:
        self.id, self.model, self.created = f"chatcmpl-{uuid.uuid4().hex}", model, int(time.time())
        self._include_usage = include_usage
        self._prompt_token_ids = prompt_token_ids
        self._content_frame: tuple[bytes, bytes] | None = None  # see _content_chunk
        self._frameless = False  # (no frame can be made for this stream: see _content_chunk)

    @property
    def _with_ids(self) -> bool:
        return self._prompt_token_ids is not None

    def _content_chunk(self, text: str) -> bytes:
        """`_chunk(ChatDelta(content=text))`, byte for byte, without building its models: the stream's
        content chunks differ only in the text, so the bytes around it are made once (the same
        serializer encodes the text). Building the models was about a fifth of the router's event
        loop per streamed token."""
        if self._content_frame is None and not self._frameless:
            whole, mark = self._chunk(ChatDelta(content=_MARK)), to_json(_MARK)
            head, _, tail = whole.partition(mark)
            if whole.count(mark) == 1:
                self._content_frame = (head, tail)
            else:  # the mark cannot be told apart (a model name holding it): chunks are built
                self._frameless = True
        if self._content_frame is None:
            return self._chunk(ChatDelta(content=text))
        head, tail = self._content_frame
        return head + to_json(text) + tail

    def _chunk(self, delta: ChatDelta, finish_reason: str | None = None, token_ids: Sequence[int] = (),
               prompt_token_ids: list[int] | None = None, route: dict | None = None) -> bytes:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason,
                                 token_ids=list(token_ids) if self._with_ids else None, pdkv_route=route)
        body = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice],
                                   prompt_token_ids=prompt_token_ids)
        return sse(body, with_usage=self._include_usage)

    def first_chunk(self) -> bytes | None:
        return self._chunk(ChatDelta(role="assistant", content=""), prompt_token_ids=self._prompt_token_ids)

    def chunks(self, piece: Piece) -> list[bytes]:
        # With token ids asked for, a step whose text is held back (a stop string may start there)
        # still sends its ids, so the chunks carry every id once.
        if self._with_ids:
            has_content = bool(piece.text) or bool(piece.token_ids)
            out = [self._chunk(ChatDelta(content=piece.text), token_ids=piece.token_ids)] if has_content else []
        else:
            out = [self._content_chunk(piece.text)] if piece.text else []
        if piece.finish_reason is not None:
            out.append(self._chunk(ChatDelta(), piece.finish_reason, route=piece.route))
        return out

    def usage_chunk(self, usage: Usage) -> bytes | None:
        if not self._include_usage:
            return None
        return sse(ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage))

    def response(self, outputs: list[tuple[str, str | None, list[int]]], usage: Usage) -> dict:
        choices = [ChatChoice(index=i, message=ChatMessageOut(content=text), finish_reason=reason,
                              token_ids=ids if self._with_ids else None)
                   for i, (text, reason, ids) in enumerate(outputs)]
        return ChatCompletion(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage,
                              prompt_token_ids=self._prompt_token_ids).model_dump(mode="json")


def model_card(model: str, max_model_len: int) -> dict:
    return ModelCard(id=model, max_model_len=max_model_len).model_dump(mode="json")


def models_response(model: str, max_model_len: int) -> dict:
    return ModelList(data=[ModelCard(id=model, max_model_len=max_model_len)]).model_dump(mode="json")
