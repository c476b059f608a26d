"""`kv_transfer_params`: parsing and validation of the per-request transfer fields.

Field names are the ones users of vLLM's P/D connectors know (`KV_PARAM_KEYS`).
The dict arrives from clients through the router, so it is untrusted: every
field is type- and range-checked here, once, and a request with malformed
params is refused a remote load (it is computed locally) rather than
half-trusted.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

from connectors.base import KV_PARAM_KEYS, KV_STREAM_KEY

MAX_BLOCKS_PER_GROUP = 1 << 20
STREAM_KEY = KV_STREAM_KEY  # the producer publishes the blocks as its prefill completes them
MAX_TRACE_CONTEXT_LEN = 55  # a W3C traceparent of version 00, the one form passed on
_TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")


class InvalidKVParams(ValueError):
    """kv_transfer_params that ask for a remote prefill but do not describe one."""


@dataclasses.dataclass(frozen=True)
class RemotePrefill:
    """Where a decode request's prompt KV lives on its producer."""

    engine_id: str
    host: str
    port: int
    request_id: str
    block_ids: tuple[tuple[int, ...], ...]  # per KV cache group, end-aligned to num_tokens (streamed: empty)
    num_tokens: int  # streamed: 0 (the consumer takes the prompt's length)
    streamed: bool = False  # the producer publishes the blocks while it prefills (`STREAM_KEY`)


def wants_remote_prefill(params: dict[str, Any] | None) -> bool:
    return params is not None and params.get("do_remote_prefill") is True


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    return params is not None and params.get("do_remote_decode") is True


def wants_stream(params: dict[str, Any] | None) -> bool:
    """The request's KV is streamed (`transfer.streaming: chunk` or `layer`): set by the router on both legs."""
    return params is not None and params.get(STREAM_KEY) is True


def parse_remote_prefill(params: dict[str, Any], num_groups: int) -> RemotePrefill:
    """Validates the fields a consumer needs; raises `InvalidKVParams` with the first problem.
    A streamed request (`streaming: true`) names its producer and request only: no blocks yet."""
    if not isinstance(params, dict):
        raise InvalidKVParams("kv_transfer_params must be a dict")
    streamed = params.get(STREAM_KEY, False)
    if type(streamed) is not bool:
        raise InvalidKVParams(f"{STREAM_KEY} must be a bool, got {streamed!r:.60}")

    def need(key: str, kind: type) -> Any:
        value = params.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise InvalidKVParams(f"{key} must be a {kind.__name__}, got {value!r:.60}")
        return value

    engine_id = need("remote_engine_id", str)
    host = need("remote_host", str)
    port = need("remote_port", int)
    request_id = need("remote_request_id", str)
    if not engine_id or not host or not request_id:
        raise InvalidKVParams("remote_engine_id, remote_host and remote_request_id must be non-empty")
    if not 0 < port < 65536:
        raise InvalidKVParams(f"remote_port {port} out of range")
    if streamed:
        if params.get("remote_block_ids") is not None:
            raise InvalidKVParams("a streamed request names no remote_block_ids (the producer publishes them)")
        return RemotePrefill(engine_id, host, port, request_id, (), 0, streamed=True)
    num_tokens = need("remote_num_tokens", int)
    groups = params.get("remote_block_ids")
    if num_tokens < 0:
        raise InvalidKVParams(f"remote_num_tokens {num_tokens} is negative")
    if not isinstance(groups, (list, tuple)) or len(groups) != num_groups:
        raise InvalidKVParams(f"remote_block_ids must hold one list per KV cache group ({num_groups})")
    block_ids = []
    for g in groups:
        if not isinstance(g, (list, tuple)) or len(g) > MAX_BLOCKS_PER_GROUP:
            raise InvalidKVParams("each remote_block_ids entry must be a list of block ids")
        if not all(type(b) is int and b > 0 for b in g):
            raise InvalidKVParams("remote block ids must be positive ints (block 0 is the null block)")
        block_ids.append(tuple(g))
    return RemotePrefill(engine_id, host, port, request_id, tuple(block_ids), num_tokens)


def make_remote_prefill_params(engine_id: str, host: str, port: int, request_id: str,
                               block_ids: list[list[int]], num_tokens: int) -> dict[str, Any]:
    """The dict a producer returns with a finished prefill (what the decode side is sent)."""
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_host": host,
        "remote_port": port,
        "remote_request_id": request_id,
        "remote_block_ids": [list(g) for g in block_ids],
        "remote_num_tokens": num_tokens,
    }
    assert set(params) == set(KV_PARAM_KEYS) - {STREAM_KEY}
    return params


def make_stream_params(engine_id: str, host: str, port: int, request_id: str) -> dict[str, Any]:
    """What the decode side is sent for a streamed request: its producer and request, no blocks."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
            "remote_host": host, "remote_port": port, "remote_request_id": request_id, STREAM_KEY: True}


def valid_trace_context(value: Any) -> str | None:
    """`value` if it is a W3C traceparent (version 00: lowercase hex, non-zero ids), else None.
    It comes from a peer or a request: anything else is dropped, never an error."""
    if type(value) is not str or len(value) != MAX_TRACE_CONTEXT_LEN or not _TRACEPARENT.fullmatch(value):
        return None
    return value
