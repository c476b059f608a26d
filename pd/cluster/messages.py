"""The router <-> worker messages: one generate request in, NDJSON token events out.

    POST /internal/generate   GenerateRequest (JSON)
    <- one TokenEvent per line (NDJSON); the last has `finished: true`

Both sides build and parse these models, so the wire format is declared once.
Guarantees (from `StrictModel`): unknown keys are refused, booleans are real
booleans, ints are ints and within the ranges below; a message that does not
validate raises `pydantic.ValidationError`, which `describe()` words with the
field's path (`sampling.ignore_eos: expected bool, got int 1`).
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from connectors.params import TransferParams
from pd.cluster.schema import StrictModel
from pd.engine.sample.params import SamplingParams  # imports no torch: the router uses these models too

_DEFAULT = SamplingParams()  # the wire form declares no default of its own

TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]
BlockId = Annotated[int, Field(ge=0, lt=1 << 31)]
FinishReason = Literal["stop", "length", "abort", "error"]
MAX_CACHE_SALT_CHARS = 1024

CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]  # pydantic refuses lone surrogates


class Sampling(StrictModel):
    """A request's decoding parameters (the engine's `SamplingParams`, on the wire, with its defaults)."""

    max_tokens: int = Field(_DEFAULT.max_tokens, ge=1, le=1 << 24)
    temperature: float = Field(_DEFAULT.temperature, ge=0.0, le=1e4)
    top_p: float = Field(_DEFAULT.top_p, gt=0.0, le=1.0)
    top_k: int = Field(_DEFAULT.top_k, ge=0, le=1 << 31, description="0 = disabled")
    seed: int | None = Field(_DEFAULT.seed, ge=-(1 << 63), lt=1 << 64)
    stop_token_ids: list[TokenId] = Field(default_factory=lambda: list(_DEFAULT.stop_token_ids))
    ignore_eos: bool = _DEFAULT.ignore_eos

    def to_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop_token_ids=tuple(self.stop_token_ids),
                              ignore_eos=self.ignore_eos)


class KVTransferParams(StrictModel):
    """The per-request transfer fields on the wire (vLLM's names, `connectors.params.KV_PARAM_KEYS`).

    Only their types are checked here; a worker turns them into the connector's typed form once
    (`to_params`), and whether they describe a usable remote prefill is the connector's judgement
    (`connectors.params.parse_remote_prefill`): a request whose params do not is computed locally,
    never half-trusted.
    """

    do_remote_prefill: bool | None = None
    do_remote_decode: bool | None = None
    remote_engine_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = Field(None, ge=0, le=65535)
    remote_request_id: str | None = None
    remote_block_ids: list[list[BlockId]] | None = None
    remote_num_tokens: int | None = Field(None, ge=0)
    streaming: bool | None = None  # KV streaming (`transfer.streaming` chunk or layer): the router sets it on both legs

    def to_params(self) -> TransferParams:
        """The connector's typed form (what the engine and its connector carry)."""
        groups = self.remote_block_ids
        return TransferParams(
            do_remote_prefill=bool(self.do_remote_prefill), do_remote_decode=bool(self.do_remote_decode),
            remote_engine_id=self.remote_engine_id, remote_host=self.remote_host, remote_port=self.remote_port,
            remote_request_id=self.remote_request_id,
            remote_block_ids=None if groups is None else tuple(tuple(g) for g in groups),
            remote_num_tokens=self.remote_num_tokens, streaming=bool(self.streaming))

    @classmethod
    def from_params(cls, params: TransferParams) -> KVTransferParams:
        """The wire form of a connector's answer (a worker's trace context stays in the process)."""
        return cls.model_validate(params.to_dict())


class GenerateRequest(StrictModel):
    """One prompt to run on a worker (prefill, decode, or both)."""

    request_id: str = Field(min_length=1, max_length=256)
    prompt_token_ids: list[TokenId] = Field(min_length=1)
    sampling: Sampling = Field(default_factory=Sampling)
    kv_transfer_params: KVTransferParams | None = None
    # enters the first block's hash (kvcache.hashing): prompts share cached blocks only under equal salts;
    # the router sets it (the client's `cache_salt`, or a tenant's derived one), the same on P and D
    cache_salt: CacheSalt | None = None


class StepTiming(StrictModel):
    """Where a request's time to first token went on the worker (the engine's `RequestTiming`):
    seconds queued for admission, loading prompt KV from a prefill worker, then computing until
    the first token; tokens computed and loaded, and the KV blocks and bytes loaded. The router's planner
    (pd.router.planner) fits its per-worker and per-link costs from these."""

    queue_s: float = Field(ge=0.0)
    load_s: float = Field(ge=0.0)
    compute_s: float = Field(ge=0.0)
    num_computed_tokens: int = Field(ge=0)
    num_loaded_tokens: int = Field(ge=0)
    num_loaded_blocks: int = Field(ge=0)
    num_loaded_bytes: int = Field(ge=0)
    num_batched_tokens: int = Field(0, ge=0)  # other requests' tokens in the steps that computed this prompt


# `TokenEvent.error_cause` of a request failed by a device fault in its step (CUDA out of memory, an
# illegal access): the worker restarts; the router answers 503 with Retry-After, not 500.
DEVICE_FAULT_CAUSE = "device_fault"


class TokenEvent(StrictModel):
    """What one engine step produced for one request, as the worker streams it.

    `num_cached_tokens`: prompt tokens this worker found in its own prefix cache
    at the request's first admission (tokens pulled from a prefill worker do not
    count: that is what the KV-aware router predicts and checks); the same on
    every event of a request once it is scheduled, 0 before.
    """

    token_ids: list[TokenId] = Field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    kv_transfer_params: KVTransferParams | None = None
    error: str | None = None
    # why the request failed: a KV load (connectors.metrics.FailureCause value), or DEVICE_FAULT_CAUSE
    error_cause: str | None = None
    num_cached_tokens: int = Field(0, ge=0)
    timing: StepTiming | None = None  # on the first event with a token only
