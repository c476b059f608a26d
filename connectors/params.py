"""`kv_transfer_params`: the per-request transfer fields, typed, and their validation.

Field names are the ones users of vLLM's P/D connectors know (`KV_PARAM_KEYS`).
`TransferParams` is the one form they take inside a process: a worker parses the
wire's JSON into it once (`pd.cluster.messages.KVTransferParams.to_params`), a
library user's dict is parsed once by `TransferParams.from_dict`, and from there
it travels unchanged through the engine and the KV cache's `Request` to the
connector, which reads it here. Whether a request's params describe a usable
remote prefill is judged once, by the consumer, where the number of KV cache
groups is known (`parse_remote_prefill`): a request whose params do not is refused
a remote load (it is computed locally) rather than half-trusted.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

# Field names users of vLLM's P/D connectors already know.
KV_PARAM_KEYS = (
    "do_remote_prefill",
    "do_remote_decode",
    "remote_engine_id",
    "remote_host",
    "remote_port",
    "remote_request_id",
    "remote_block_ids",
    "remote_num_tokens",
    "streaming",  # pdkv's own: the producer publishes the blocks while it prefills (`transfer.streaming`)
)
KV_STREAM_KEY = "streaming"
# Beside them, set by the decode worker (never by a client): its W3C `traceparent` for the pull, carried
# opaque in the PULL frames to the producer (`valid_trace_context` checks the form).
KV_TRACE_CONTEXT_KEY = "trace_context"

MAX_BLOCKS_PER_GROUP = 1 << 20
MAX_TRACE_CONTEXT_LEN = 55  # a W3C traceparent of version 00, the one form passed on
_TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")


class InvalidKVParams(ValueError):
    """kv_transfer_params that ask for a remote prefill but do not describe one."""


@dataclasses.dataclass(frozen=True)
class TransferParams:
    """A request's kv_transfer_params (vLLM's field names; `streaming` is pdkv's own).

    Guarantees: each field has its declared type (the wire model or `from_dict` checked it
    where the params entered the process); nothing here says the fields are complete or
    consistent: that is `parse_remote_prefill`'s judgement. `trace_context` is set by a decode
    worker only (its pull span, passed opaque to the producer), never read from a client.
    """

    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_engine_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None
    remote_block_ids: tuple[tuple[int, ...], ...] | None = None  # per KV cache group
    remote_num_tokens: int | None = None
    streaming: bool = False
    trace_context: str | None = None

    @classmethod
    def from_dict(cls, params: Mapping[str, Any]) -> TransferParams:
        """A library caller's dict (`KV_PARAM_KEYS`, plus `trace_context`), type-checked once:
        InvalidKVParams names the first wrong field. A trace context not in W3C form is dropped."""
        if not isinstance(params, Mapping):
            raise InvalidKVParams(f"kv_transfer_params must be a mapping, got {type(params).__name__}")
        unknown = sorted(set(params) - set(KV_PARAM_KEYS) - {KV_TRACE_CONTEXT_KEY})
        if unknown:
            raise InvalidKVParams(f"kv_transfer_params: unknown key(s) {unknown}")
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            value = params.get(field.name)
            if value is None:
                continue
            if field.name == KV_TRACE_CONTEXT_KEY:
                values[field.name] = valid_trace_context(value)
            elif field.name == "remote_block_ids":
                values[field.name] = _block_id_groups(value)
            else:
                kind = _FIELD_KINDS[field.name]
                if type(value) is not kind:
                    raise InvalidKVParams(f"kv_transfer_params.{field.name} must be a {kind.__name__}, "
                                          f"got {value!r:.60}")
                values[field.name] = value
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """vLLM's dict form: the fields that are set (block ids as lists), no trace context."""
        out: dict[str, Any] = {}
        for key in KV_PARAM_KEYS:
            value = getattr(self, key)
            if key == "remote_block_ids" and value is not None:
                value = [list(g) for g in value]
            if value is not None and not (key == KV_STREAM_KEY and value is False):
                out[key] = value
        return out


_FIELD_KINDS = {"do_remote_prefill": bool, "do_remote_decode": bool, "remote_engine_id": str, "remote_host": str,
                "remote_port": int, "remote_request_id": str, "remote_num_tokens": int, KV_STREAM_KEY: bool}


def _block_id_groups(value: Any) -> tuple[tuple[int, ...], ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(g, (list, tuple)) for g in value):
        raise InvalidKVParams("kv_transfer_params.remote_block_ids must be a list of lists of block ids")
    if not all(type(b) is int for g in value for b in g):
        raise InvalidKVParams("kv_transfer_params.remote_block_ids must hold ints")
    return tuple(tuple(g) for g in value)


@dataclasses.dataclass(frozen=True)
class RemotePrefill:
    """Where a decode request's prompt KV lives on its producer."""

    engine_id: str
    host: str
    port: int
    request_id: str
    block_ids: tuple[tuple[int, ...], ...]  # per KV cache group, end-aligned to num_tokens (streamed: empty)
    num_tokens: int  # streamed: 0 (the consumer takes the prompt's length)
    streamed: bool = False  # the producer publishes the blocks while it prefills (`KV_STREAM_KEY`)


# The KV cache's `Request` holds its params as an opaque object (kvcache knows no connector): these
# read them, and anything but a `TransferParams` asks for nothing.
def wants_remote_prefill(params: object) -> bool:
    return isinstance(params, TransferParams) and params.do_remote_prefill


def wants_remote_decode(params: object) -> bool:
    return isinstance(params, TransferParams) and params.do_remote_decode


def wants_stream(params: object) -> bool:
    """The request's KV is streamed (`transfer.streaming: chunk` or `layer`): set by the router on both legs."""
    return isinstance(params, TransferParams) and params.streaming


def trace_context_of(params: object) -> str | None:
    return params.trace_context if isinstance(params, TransferParams) else None


def parse_remote_prefill(params: object, num_groups: int) -> RemotePrefill:
    """Judges whether `params` describe a remote prefill this consumer (`num_groups` KV cache groups)
    can load; raises `InvalidKVParams` with the first problem. A streamed request (`streaming`)
    names its producer and request only: no blocks yet."""
    if not isinstance(params, TransferParams):
        raise InvalidKVParams(f"kv_transfer_params must be TransferParams, got {type(params).__name__}")
    engine_id, host, port, request_id = (params.remote_engine_id, params.remote_host, params.remote_port,
                                         params.remote_request_id)
    if not engine_id or not host or not request_id:
        raise InvalidKVParams("remote_engine_id, remote_host and remote_request_id must be non-empty")
    if port is None or not 0 < port < 65536:
        raise InvalidKVParams(f"remote_port {port} out of range")
    if params.streaming:
        if params.remote_block_ids is not None:
            raise InvalidKVParams("a streamed request names no remote_block_ids (the producer publishes them)")
        return RemotePrefill(engine_id, host, port, request_id, (), 0, streamed=True)
    num_tokens, groups = params.remote_num_tokens, params.remote_block_ids
    if num_tokens is None or num_tokens < 0:
        raise InvalidKVParams(f"remote_num_tokens must be a non-negative int, got {num_tokens}")
    if groups is None or len(groups) != num_groups:
        raise InvalidKVParams(f"remote_block_ids must hold one list per KV cache group ({num_groups})")
    for g in groups:
        if len(g) > MAX_BLOCKS_PER_GROUP:
            raise InvalidKVParams(f"a remote_block_ids entry holds over {MAX_BLOCKS_PER_GROUP} blocks")
        if not all(b > 0 for b in g):
            raise InvalidKVParams("remote block ids must be positive (block 0 is the null block)")
    return RemotePrefill(engine_id, host, port, request_id, groups, num_tokens)


def make_remote_prefill_params(engine_id: str, host: str, port: int, request_id: str,
                               block_ids: list[list[int]], num_tokens: int) -> TransferParams:
    """What a producer returns with a finished prefill (what the decode side is sent)."""
    return TransferParams(do_remote_prefill=True, remote_engine_id=engine_id, remote_host=host, remote_port=port,
                          remote_request_id=request_id, remote_block_ids=tuple(tuple(g) for g in block_ids),
                          remote_num_tokens=num_tokens)


def make_stream_params(engine_id: str, host: str, port: int, request_id: str) -> TransferParams:
    """What the decode side is sent for a streamed request: its producer and request, no blocks."""
    return TransferParams(do_remote_prefill=True, remote_engine_id=engine_id, remote_host=host, remote_port=port,
                          remote_request_id=request_id, streaming=True)


def valid_trace_context(value: Any) -> str | None:
    """`value` if it is a W3C traceparent (version 00: lowercase hex, non-zero ids), else None.
    It comes from a peer or a request: anything else is dropped, never an error."""
    if type(value) is not str or len(value) != MAX_TRACE_CONTEXT_LEN or not _TRACEPARENT.fullmatch(value):
        return None
    return value
