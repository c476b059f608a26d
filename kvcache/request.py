"""Request state as the KV cache layer sees it.

Guarantees: `all_token_ids == prompt_token_ids + output_token_ids`;
`block_hashes` always holds the hashes of every full `block_hasher.block_size`
chunk of `all_token_ids` (kept current by `append_output_token_ids`); a request
built without a hasher has no hashes and never hits the prefix cache.
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence


class RequestStatus(enum.IntEnum):
    """Lifecycle states; everything after PREEMPTED is finished."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One generation request: token ids, progress and prefix-cache identity."""

    __slots__ = (
        "request_id", "prompt_token_ids", "num_prompt_tokens", "_all_token_ids",
        "_output_token_ids", "max_tokens", "cache_salt", "lora_name",
        "skip_reading_prefix_cache", "kv_transfer_params", "num_computed_tokens",
        "status", "num_preemptions", "block_hashes", "_block_hasher", "spec_token_ids", "num_tokens",
        "_hash_block_size", "_next_hash_at",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        block_hasher: Callable[[Request], list[bytes]] | None = None,
        max_tokens: int = 16,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        skip_reading_prefix_cache: bool = False,
        kv_transfer_params: object | None = None,  # opaque here: the connector's (connectors.params)
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty str")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError(f"request {request_id}: prompt must not be empty")
        self.request_id = request_id
        self.prompt_token_ids = prompt
        self.num_prompt_tokens = len(prompt)
        self._all_token_ids = list(prompt)
        self.num_tokens = len(prompt)  # == len(all_token_ids); a slot, read on every allocation
        self._output_token_ids: list[int] = []
        self.max_tokens = max_tokens
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        self.kv_transfer_params = kv_transfer_params
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.spec_token_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self._block_hasher = block_hasher
        # a hasher with a known block size is only called when a block completes
        self._hash_block_size = getattr(block_hasher, "block_size", 0)
        self._next_hash_at = 0
        if block_hasher is not None:
            self.block_hashes.extend(block_hasher(self))
            self._next_hash_at = (len(self.block_hashes) + 1) * self._hash_block_size

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output token ids (do not mutate; use append_output_token_ids)."""
        return self._all_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def block_hasher(self):
        return self._block_hasher

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append sampled token(s) and hash any block they complete."""
        if isinstance(token_ids, int):
            self._output_token_ids.append(token_ids)
            self._all_token_ids.append(token_ids)
            self.num_tokens += 1
        else:
            token_ids = list(token_ids)
            self._output_token_ids.extend(token_ids)
            self._all_token_ids.extend(token_ids)
            self.num_tokens = len(self._all_token_ids)
        hasher = self._block_hasher
        if hasher is not None and self.num_tokens >= self._next_hash_at:
            new = hasher(self)
            if new:
                self.block_hashes.extend(new)
            self._next_hash_at = (len(self.block_hashes) + 1) * self._hash_block_size

    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def get_finished_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.name})")
