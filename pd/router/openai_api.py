"""OpenAI request schemas: `/v1/completions` and `/v1/chat/completions`.

`parse_completion_request` / `parse_chat_request` turn a JSON body into a
frozen pydantic model or raise `APIError` (400, naming the offending field as
`param`, e.g. `temperature` or `messages[0].content`).

Guarantees:
- types are strict: booleans are JSON booleans, integers are not floats or
  booleans, token ids are integers in [0, vocab_size), seeds fit an int64;
- every field pdkv does not implement (`tools`, `logprobs`, `n` > 1,
  penalties, `response_format`, ...) is refused by name unless it carries its
  neutral value, and any other unknown field is refused too: nothing is
  silently ignored;
- the one exception is `kv_transfer_params`, which is dropped: only the
  router's own P/D flow may set it, never a client.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo,
                      field_validator, model_validator)

from pd.cluster.messages import CacheSalt, Sampling
from pd.cluster.schema import describe

MAX_STOP_SEQUENCES = 8
MAX_NEW_TOKENS = 1 << 20
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
_DROPPED = ("kv_transfer_params",)


class APIError(Exception):
    """An error returned to the client as OpenAI-style JSON with `status`."""

    def __init__(self, status: int, message: str, *, err_type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.param, self.code = status, message, err_type, param, code
        self.headers = headers  # sent with the error (429: Retry-After)

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}


def server_error(message: str, status: int = 503, code: str = "worker_unavailable") -> APIError:
    return APIError(status, message, err_type="server_error", code=code)


# -- neutral values of the fields pdkv does not implement ---------------------
def _is_int(value: Any, want: int) -> bool:
    return type(value) is int and value == want


def _is_zero(value: Any) -> bool:
    return type(value) in (int, float) and value == 0


def _is_false(value: Any) -> bool:
    return value is False


def _is_empty(value: Any) -> bool:
    return value in ({}, [])


_COMMON_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "n": lambda v: _is_int(v, 1),
    "best_of": lambda v: _is_int(v, 1),
    "logit_bias": _is_empty,
    "presence_penalty": _is_zero,
    "frequency_penalty": _is_zero,
    "repetition_penalty": lambda v: type(v) in (int, float) and v == 1,
    "min_tokens": _is_zero,
}
COMPLETION_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    **_COMMON_UNSUPPORTED,
    "echo": _is_false,
    "logprobs": lambda v: False,  # any number of logprobs asks for them
    "suffix": lambda v: v == "",
}
CHAT_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    **_COMMON_UNSUPPORTED,
    "logprobs": _is_false,
    "top_logprobs": _is_zero,
    "tools": _is_empty,
    "tool_choice": lambda v: v == "none",
    "parallel_tool_calls": lambda v: isinstance(v, bool),  # meaningless without tools
    "functions": _is_empty,
    "function_call": lambda v: v == "none",
    "response_format": lambda v: v == {"type": "text"},
    "modalities": lambda v: v == ["text"],
    "audio": lambda v: False,
    "prediction": lambda v: False,
    "reasoning_effort": lambda v: False,
    "web_search_options": lambda v: False,
    "store": _is_false,
    "metadata": _is_empty,
    "service_tier": lambda v: v in ("auto", "default"),
}


def _in_vocab(token_id: int, info: ValidationInfo) -> int:
    vocab_size = (info.context or {}).get("vocab_size")
    if vocab_size is not None and token_id >= vocab_size:
        raise ValueError(f"token id {token_id} is outside the vocabulary [0, {vocab_size})")
    return token_id


# A lone surrogate (U+D800-U+DFFF) is valid in JSON ("\\ud800") and in a Python str but has no UTF-8 form:
# text carrying one would fail later, in the tokenizer or wherever it is encoded, so it is refused here.
_SURROGATE = re.compile("[\ud800-\udfff]")


def surrogate_problem(text: str) -> str | None:
    """Why `text` is not encodable Unicode text (None when it is)."""
    found = None if text.isascii() else _SURROGATE.search(text)
    if found is None:
        return None
    return (f"must be valid Unicode text: it holds a lone surrogate (U+{ord(found.group()):04X}) at character "
            f"{found.start()}, which has no UTF-8 encoding")


def _encodable(text: Any) -> Any:
    """Runs before pydantic's own string checks (theirs fail on a surrogate with a vaguer message)."""
    problem = surrogate_problem(text) if isinstance(text, str) else None
    if problem is not None:
        raise ValueError(problem)
    return text


TokenId = Annotated[int, Field(ge=0), AfterValidator(_in_vocab)]
Text = Annotated[str, BeforeValidator(_encodable)]  # every client string: encodable as UTF-8
NonEmpty = Annotated[str, Field(min_length=1), BeforeValidator(_encodable)]
# What a client may send as `prompt` (the JSON schema of the plain validator below, which checks it itself)
_IdList = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
PromptInput = (NonEmpty | Annotated[list[NonEmpty], Field(min_length=1)] | _IdList
               | Annotated[list[_IdList], Field(min_length=1)])
Stop = (Text | Annotated[list[NonEmpty], Field(max_length=MAX_STOP_SEQUENCES)]
        | Annotated[tuple[NonEmpty, ...], Field(max_length=MAX_STOP_SEQUENCES)])


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    """Fields common to both endpoints; `null` means "the default" for each of them."""

    model: Text | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=MAX_NEW_TOKENS)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: Stop = ()
    stop_token_ids: list[TokenId] = []
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # extension (as in vLLM): the output also carries the token ids (completions: each choice's generated
    # ids; chat: the prompt's ids and each choice's generated ids)
    return_token_ids: bool = False
    # as in vLLM: enters the first block's hash, so prompts share cached blocks only with equal salts
    cache_salt: CacheSalt | None = None

    @model_validator(mode="before")
    @classmethod
    def _screen(cls, body: Any) -> Any:
        """Drops nulls (so defaults apply) and `kv_transfer_params`; refuses unimplemented fields by name."""
        if not isinstance(body, dict):
            raise ValueError("request body must be a JSON object")
        table = cls._unsupported_fields()
        kept = {}
        for name, value in body.items():
            if value is None or name in _DROPPED:
                continue
            if name in table:
                if not table[name](value):
                    raise _Refused(name, value)
                continue
            kept[name] = value
        return kept

    @classmethod
    def _unsupported_fields(cls) -> dict[str, Callable[[Any], bool]]:
        raise NotImplementedError

    @field_validator("stop", mode="after")
    @classmethod
    def _stop_tuple(cls, stop: Any) -> tuple[str, ...]:
        if isinstance(stop, str):
            return (stop,) if stop else ()
        return tuple(stop)

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> Any:
        if self.stream_options is not None and not self.stream:
            raise ValueError("'stream_options' is only allowed when 'stream' is true")
        return self

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop)  # a tuple already (`_stop_tuple`); typed as the union the client may send

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self, max_tokens: int) -> Sampling:
        """The worker's sampling parameters (router <-> worker message)."""
        try:
            return Sampling(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                            top_k=max(0, self.top_k), seed=self.seed, stop_token_ids=list(self.stop_token_ids),
                            ignore_eos=self.ignore_eos)
        except ValidationError as exc:  # a value this parser let through but no worker takes
            raise APIError(400, describe(exc)) from None


class CompletionRequest(_SamplingRequest):
    """One validated completion request; `prompt` is normalised to one entry per choice."""

    prompt: tuple[str | tuple[int, ...], ...]
    max_tokens: int = Field(16, ge=1, le=MAX_NEW_TOKENS)

    @classmethod
    def _unsupported_fields(cls) -> dict[str, Callable[[Any], bool]]:
        return COMPLETION_UNSUPPORTED

    @field_validator("prompt", mode="plain", json_schema_input_type=PromptInput)
    @classmethod
    def _prompt(cls, raw: Any, info: ValidationInfo) -> tuple[str | tuple[int, ...], ...]:
        vocab_size = (info.context or {}).get("vocab_size", 1 << 62)

        def token_ids(ids: list) -> tuple[int, ...]:
            if not ids:
                raise ValueError("must not be empty")
            for t in ids:
                if type(t) is not int or not 0 <= t < vocab_size:
                    raise ValueError(f"token ids must be integers in [0, {vocab_size}), got {json.dumps(t)}")
            return tuple(ids)

        if isinstance(raw, str):
            if not raw:
                raise ValueError("must not be empty")
            return (_encodable(raw),)
        if isinstance(raw, list) and raw:
            if all(isinstance(p, str) for p in raw):
                if not all(raw):
                    raise ValueError("must not contain empty strings")
                for i, p in enumerate(raw):
                    problem = surrogate_problem(p)
                    if problem is not None:
                        raise _Refused(f"prompt[{i}]", None, f"'prompt[{i}]': {problem}")
                return tuple(raw)
            if all(isinstance(p, list) for p in raw):
                return tuple(token_ids(p) for p in raw)
            return (token_ids(raw),)
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of such lists")

    @property
    def prompts(self) -> tuple[str | tuple[int, ...], ...]:
        """One entry per choice: text or token ids."""
        return self.prompt

    @model_validator(mode="after")
    def _one_prompt_per_stream(self) -> Any:
        if self.stream and len(self.prompt) > 1:
            raise _Refused("prompt", None, "streaming supports one prompt per request")
        return self


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]
    name: Text | None = None

    def rendered(self) -> dict:
        """The message as a chat template sees it (`developer` is the newer name of `system`)."""
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        out = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)

    @classmethod
    def _unsupported_fields(cls) -> dict[str, Callable[[Any], bool]]:
        return CHAT_UNSUPPORTED

    @property
    def max_new_tokens(self) -> int | None:
        """`max_completion_tokens` (the current name) over `max_tokens`; None: up to the context length."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class _Refused(ValueError):
    def __init__(self, param: str, value: Any, message: str | None = None) -> None:
        super().__init__(message or f"'{param}' is not supported by pdkv (got {_show(value)})")
        self.param = param


_Request = TypeVar("_Request", bound=_SamplingRequest)


def parse_completion_request(body: Any, *, served_model: str, vocab_size: int) -> CompletionRequest:
    return _parse(CompletionRequest, body, served_model, vocab_size)


def parse_chat_request(body: Any, *, served_model: str, vocab_size: int) -> ChatCompletionRequest:
    return _parse(ChatCompletionRequest, body, served_model, vocab_size)


def _parse(cls: type[_Request], body: Any, served_model: str, vocab_size: int) -> _Request:
    try:
        req = cls.model_validate(body, context={"vocab_size": vocab_size})
    except _Refused as exc:
        raise APIError(400, str(exc), param=exc.param) from None
    except ValidationError as exc:
        raise _validation_error(exc) from None
    if req.model is not None and req.model != served_model:
        raise APIError(404, f"model '{req.model}' does not exist; this server serves '{served_model}'",
                       param="model", code="model_not_found")
    return req.model_copy(update={"model": served_model})


def _validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    # among a union's branches, the most specific: the deepest, then a range error over a type error
    error = max(errors, key=lambda e: (len(e["loc"]), not e["type"].endswith("_type")))
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, _Refused):
        return APIError(400, str(cause), param=cause.param)
    param = _param(error["loc"])
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        return APIError(400, f"'{param}' is not supported by pdkv (unknown field)", param=param or None)
    if error["type"] == "missing":
        return APIError(400, f"'{param}' is required", param=param)
    if not param:  # a model-level check: its message names the field
        return APIError(400, message, param=_quoted_field(message))
    if error["type"] != "value_error":  # pdkv's own checks already say what they got
        message += f", got {_show(error.get('input'))}"
    return APIError(400, f"'{param}': {message}", param=param)


# pydantic names union branches in error locations ("str", "list[TextPart]"): not fields, so skipped
_UNION_TAGS = {"str", "int", "float", "bool", "none", "list", "dict", "tuple"}


def _param(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _UNION_TAGS or "[" in part or "-" in part:
            continue
        else:
            out += f".{part}" if out else part
    return out


def _quoted_field(message: str) -> str | None:
    parts = message.split("'")
    return parts[1] if len(parts) > 2 else None


def _show(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."
