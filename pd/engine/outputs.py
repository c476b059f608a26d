"""What leaves the engine: each request's outputs, why it finished, its timing, and pool audits.
Frozen values, safe to hand to any caller."""
from __future__ import annotations

import dataclasses
import enum

from connectors.metrics import FailureCause
from connectors.params import TransferParams

_new_object = object.__new__


class FinishReason(str, enum.Enum):
    """Why a request ended (the value is what callers see in JSON)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request (new tokens and/or its end)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    kv_transfer_params: TransferParams | None = None  # a producer's answer (connectors.params)
    error: str | None = None
    error_cause: FailureCause | None = None  # set when a KV load failure ended the request
    num_cached_tokens: int = 0  # prompt tokens found in this engine's prefix cache (set on the final output)
    timing: RequestTiming | None = None  # on the request's first output with a token only

    @classmethod
    def step_tokens(cls, request_id: str, new_token_ids: list[int], num_cached_tokens: int = 0,
                    timing: RequestTiming | None = None) -> RequestOutput:
        """`RequestOutput(request_id, new_token_ids, num_cached_tokens=..., timing=...)`, the same frozen
        value, filled in one pass: the frozen constructor's setattr per field costs about 1 µs, and the
        scheduler makes one of these per running request per step."""
        out = _new_object(cls)
        d = out.__dict__  # (fields in declaration order, as the constructor sets them)
        d["request_id"] = request_id
        d["new_token_ids"] = new_token_ids
        d["finished"] = False
        d["finish_reason"] = None
        d["kv_transfer_params"] = None
        d["error"] = None
        d["error_cause"] = None
        d["num_cached_tokens"] = num_cached_tokens
        d["timing"] = timing
        return out


@dataclasses.dataclass(frozen=True)
class RequestTiming:
    """Where a request's time to first token went on this engine (seconds, perf_counter):
    waiting for admission, loading its prompt KV from a remote engine (0 when nothing was
    loaded), then computing until its first token. Token counts say what was computed and
    what was loaded, and how many tokens of other requests shared its steps (the batch), so a
    router can fit per-token costs from them: `compute_s` is the time of steps that computed
    `num_computed_tokens + num_batched_tokens` tokens."""

    queue_s: float
    load_s: float
    compute_s: float
    num_computed_tokens: int  # prompt tokens this engine computed (not cached, not loaded)
    num_loaded_tokens: int  # prompt tokens whose KV arrived through the connector
    num_loaded_blocks: int
    num_batched_tokens: int = 0  # other requests' tokens in the steps that computed this one's prompt

    def as_dict(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class PoolAudit:
    """The KV pool between steps: `all_free` when no block is held by anyone, `consistent`
    when the pool's bookkeeping checks out; `detail` holds the failed checks' messages."""

    all_free: bool
    consistent: bool
    detail: str = ""
