"""The router's OpenAPI document, served at `GET /openapi.json`.

It is generated from the same pydantic models that validate requests
(pd.router.openai_api) and shape responses (pd.router.openai_responses), so
the document cannot drift from what the router accepts. It describes
`POST /v1/completions` and `POST /v1/chat/completions`: the request bodies,
the JSON and event-stream answers, and every error status the router returns
(each as OpenAI error JSON).

Guarantees:
- a request the document calls valid is one the validator accepts, except for
  what JSON Schema cannot state: the context length against the prompt's
  token count, `stream_options` without `stream`, one prompt per stream,
  strings holding lone surrogates, a `model` other than the served one (404),
  and integers written as `7.0` (JSON Schema's "integer" takes them, pdkv's
  strict types do not); those get a 4xx, never a 5xx;
- the deployment's own limits are written in: `max_tokens` /
  `max_completion_tokens` at most `max_model_len - 1` (a prompt has at least
  one token), token ids below the vocabulary size, at most
  `max_prompts_per_request` prompts;
- it is built once per router and served as fixed bytes, without the API key
  (as vLLM serves its own): it describes the public interface and holds no
  secret, only the limits above; answering it costs an unauthenticated
  client's connection nothing beyond a static reply.
"""
from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from pd.cluster.config import DeployConfig
from pd.router import openai_api as oa
from pd.router import openai_responses as out
from pd.router.timeline import EXTENSION_KEY, STAGES, TIMING_HEADER

_REF = "#/components/schemas/{model}"


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape: what every refusal (4xx) and failure (5xx) of the router carries."""

    error: ErrorBody


# One server-sent event (OpenAPI 3.1: an event-stream `schema` describes each event): its `data` is a chunk's
# JSON (`#/components/schemas/CompletionChunk` / `ChatCompletionChunk`), an error's, or `[DONE]`.
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
_ERRORS = {
    "400": "invalid request: the body is not JSON, or a field is invalid (`param` names it)",
    "401": "invalid or missing API key",
    "404": "unknown model",
    "413": "body larger than router.max_body_bytes",
    "429": "overloaded: the admission queue is full or timed out (Retry-After says when to retry)",
    "500": "a bug in the router (its log holds the details)",
    "502": "a worker failed the request",
    "503": "no worker can serve, or overloaded",
    "504": "a worker did not answer in time",
}
# The opt-in timing extension (pd.router.timeline): asked for with the header, answered in the JSON body
# (and in the stream's last chunk before [DONE]).
_TIMING_PARAMETER = {"name": TIMING_HEADER, "in": "header", "required": False,
                     "description": f"1: the answer carries `{EXTENSION_KEY}`, where the time to first token went",
                     "schema": {"type": "string", "enum": ["0", "1"]}}
_TIMING_SCHEMA = {
    "type": "object", "required": ["stages", "ttft_s"],
    "properties": {"stages": {"type": "object", "additionalProperties": False,
                              "properties": {stage: {"type": "number", "minimum": 0} for stage in STAGES}},
                   "ttft_s": {"type": ["number", "null"]},
                   "num_cached_tokens": {"type": "integer", "minimum": 0}}}


def build_openapi(config: DeployConfig, vocab_size: int) -> dict[str, Any]:
    """The OpenAPI 3.1 document of this deployment's generation endpoints."""
    mapping, top = models_json_schema(
        [(oa.CompletionRequest, "validation"), (oa.ChatCompletionRequest, "validation"),
         (out.Completion, "serialization"), (out.ChatCompletion, "serialization"),
         (out.ChatCompletionChunk, "serialization"), (ErrorResponse, "serialization")],
        ref_template=_REF)
    schemas = top["$defs"]
    _write_limits(schemas, config, vocab_size)
    for name in ("Completion", "ChatCompletion", "ChatCompletionChunk"):
        schemas[name]["properties"][EXTENSION_KEY] = _TIMING_SCHEMA

    def ref(model: type[BaseModel], mode: str) -> dict:
        return mapping[(model, mode)]  # type: ignore[index]

    def operation(summary: str, request: type[BaseModel], response: type[BaseModel], op_id: str) -> dict:
        responses: dict[str, Any] = {
            "200": {"description": "the completion: JSON, or with `stream: true` server-sent events "
                                   "(`data: <chunk JSON>` lines, an error event if it fails, `data: [DONE]`)",
                    "content": {"application/json": {"schema": ref(response, "serialization")},
                                "text/event-stream": {"schema": _SSE_EVENT}}},
        }
        error = {"application/json": {"schema": ref(ErrorResponse, "serialization")}}
        for status, why in _ERRORS.items():
            responses[status] = {"description": why, "content": error}
        return {"post": {"operationId": op_id, "summary": summary, "parameters": [_TIMING_PARAMETER],
                         "requestBody": {"required": True,
                                         "content": {"application/json": {"schema": ref(request, "validation")}}},
                         "responses": responses}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "pdkv router", "version": "1",
                 "description": f"OpenAI-compatible generation endpoints serving model '{config.model.name}'"},
        "paths": {
            "/v1/completions": operation("Text completion", oa.CompletionRequest, out.Completion,
                                         "createCompletion"),
            "/v1/chat/completions": operation("Chat completion", oa.ChatCompletionRequest, out.ChatCompletion,
                                              "createChatCompletion"),
        },
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}] if config.router.tenant_keys() else [],
    }


def _write_limits(schemas: dict[str, Any], config: DeployConfig, vocab_size: int) -> None:
    max_new = min(oa.MAX_NEW_TOKENS, config.scheduler.max_model_len - 1)
    max_id = vocab_size - 1
    for name, fields in (("CompletionRequest", ("max_tokens",)),
                         ("ChatCompletionRequest", ("max_tokens", "max_completion_tokens"))):
        props = schemas[name]["properties"]
        for field in fields:
            for branch in _branches(props[field]):
                if branch.get("type") == "integer":
                    branch["maximum"] = max_new
        props["stop_token_ids"]["items"]["maximum"] = max_id
    for branch in _branches(schemas["CompletionRequest"]["properties"]["prompt"]):
        items = branch.get("items")
        if items is None:  # a single string
            continue
        if items.get("type") == "integer":  # one prompt of token ids
            items["maximum"] = max_id
        elif items.get("type") == "array":  # several prompts of token ids
            items["items"]["maximum"] = max_id
            branch["maxItems"] = config.router.max_prompts_per_request
        else:  # several text prompts
            branch["maxItems"] = config.router.max_prompts_per_request


def _branches(schema: dict[str, Any]) -> list[dict[str, Any]]:
    return schema.get("anyOf", [schema])


def openapi_handler(config: DeployConfig, vocab_size: int):
    """An aiohttp handler answering `GET /openapi.json` with the fixed document."""
    body = json.dumps(build_openapi(config, vocab_size)).encode()

    async def serve(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    return serve
