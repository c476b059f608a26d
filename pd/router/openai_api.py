"""OpenAI `/v1/completions` request validation and response shaping.

`parse_completion_request` turns a JSON body into a frozen `CompletionRequest`
or raises `APIError` (400 with the offending parameter named). The shaping
functions build the JSON objects OpenAI clients expect: a completion, its
stream chunks, a final usage chunk, the model list and errors.

Guarantees: client-supplied `kv_transfer_params` (and any other internal
field) never survive parsing — only the fields below are read; a request that
parses is within the server's limits (`max_model_len`).
"""
from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any

MAX_STOP_SEQUENCES = 8


class APIError(Exception):
    """An error returned to the client as OpenAI-style JSON with `status`."""

    def __init__(self, status: int, message: str, *, err_type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.param, self.code = status, message, err_type, param, code

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}


def server_error(message: str, status: int = 503, code: str = "worker_unavailable") -> APIError:
    return APIError(status, message, err_type="server_error", code=code)


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    """One validated completion request; `prompts` holds one entry per choice group."""

    model: str
    prompts: tuple[str | tuple[int, ...], ...]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    echo: bool
    user: str | None
    return_token_ids: bool = False  # extension (as in vLLM): choices also carry the generated token ids


def _number(body: dict, name: str, default: float, lo: float, hi: float, integer: bool = False) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        kind = "an integer" if integer else "a number"
        raise APIError(400, f"'{name}' must be {kind}, got {json.dumps(value)}", param=name)
    if not lo <= value <= hi:
        raise APIError(400, f"'{name}' must be between {lo} and {hi}, got {value}", param=name)
    return value


def _prompts(raw: Any, vocab_size: int) -> tuple[str | tuple[int, ...], ...]:
    def token_ids(ids: list) -> tuple[int, ...]:
        if not ids:
            raise APIError(400, "'prompt' must not be empty", param="prompt")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise APIError(400, f"'prompt' token ids must be integers in [0, {vocab_size}), got {t!r}",
                               param="prompt")
        return tuple(ids)

    if isinstance(raw, str):
        if not raw:
            raise APIError(400, "'prompt' must not be empty", param="prompt")
        return (raw,)
    if isinstance(raw, list) and raw:
        if all(isinstance(p, str) for p in raw):
            if any(not p for p in raw):
                raise APIError(400, "'prompt' must not contain empty strings", param="prompt")
            return tuple(raw)
        if all(isinstance(p, list) for p in raw):
            return tuple(token_ids(p) for p in raw)
        return (token_ids(raw),)
    raise APIError(400, "'prompt' must be a string, a list of strings, a list of token ids or a list of such lists",
                   param="prompt")


def parse_completion_request(body: Any, *, served_model: str, vocab_size: int) -> CompletionRequest:
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    model = body.get("model") or served_model
    if model != served_model:
        raise APIError(404, f"model '{model}' does not exist; this server serves '{served_model}'",
                       param="model", code="model_not_found")
    if "prompt" not in body:
        raise APIError(400, "'prompt' is required", param="prompt")
    prompts = _prompts(body["prompt"], vocab_size)
    n = _number(body, "n", 1, 1, 1, integer=True)
    best_of = body.get("best_of")
    if best_of not in (None, n):
        raise APIError(400, "'best_of' is not supported", param="best_of")
    if body.get("echo"):
        raise APIError(400, "'echo' is not supported", param="echo")
    if body.get("logprobs") is not None:
        raise APIError(400, "'logprobs' is not supported", param="logprobs")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) and s for s in stop):
        stops = tuple(stop)
    else:
        raise APIError(400, "'stop' must be a string or a list of non-empty strings", param="stop")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise APIError(400, f"'stop' allows at most {MAX_STOP_SEQUENCES} sequences", param="stop")
    stop_token_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_token_ids, list) or not all(isinstance(t, int) and 0 <= t < vocab_size
                                                       for t in stop_token_ids):
        raise APIError(400, "'stop_token_ids' must be a list of token ids", param="stop_token_ids")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "'stream' must be a boolean", param="stream")
    if stream and len(prompts) > 1:
        raise APIError(400, "streaming supports one prompt per request", param="prompt")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise APIError(400, "'stream_options' must be an object", param="stream_options")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise APIError(400, "'seed' must be an integer", param="seed")
    return CompletionRequest(
        model=model,
        prompts=prompts,
        max_tokens=_number(body, "max_tokens", 16, 1, 1 << 20, integer=True),
        temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
        top_p=float(_number(body, "top_p", 1.0, 1e-6, 1.0)),
        top_k=_number(body, "top_k", -1, -1, 1 << 20, integer=True),
        seed=seed,
        stop=stops,
        stop_token_ids=tuple(stop_token_ids),
        ignore_eos=bool(body.get("ignore_eos", False)),
        stream=stream,
        include_usage=bool(stream_options.get("include_usage", True)),
        echo=bool(body.get("echo", False)),
        user=body.get("user") if isinstance(body.get("user"), str) else None,
        return_token_ids=bool(body.get("return_token_ids", False)),
    )


def new_completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def usage_dict(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


def completion_response(completion_id: str, model: str, choices: list[dict], usage: dict) -> dict:
    return {"id": completion_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage}


def choice(index: int, text: str, finish_reason: str | None, token_ids: list[int] | None = None) -> dict:
    out = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        out["token_ids"] = token_ids
    return out


def stream_chunk(completion_id: str, model: str, created: int, choices: list[dict], usage: dict | None = None) -> bytes:
    body = {"id": completion_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def sse_error(error: APIError) -> bytes:
    return b"data: " + json.dumps(error.to_dict()).encode() + b"\n\n"


def models_response(model: str, max_model_len: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "pdkv",
                                        "max_model_len": max_model_len}]}
