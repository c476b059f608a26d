"""A connector that moves nothing: every request is computed locally.

It stands in wherever there is no connector: an engine built without one holds a `NoopConnector`
(`or_noop`), so the engine and its scheduler always talk to a connector object and never branch on
its absence. It implements every method of the contract in `connectors.base`, both halves, each
doing nothing: no external tokens, no loads, nothing kept after a request finishes, nothing
streamed, an empty report every step. A request carrying `kv_transfer_params` is computed in full,
with a warning (there is no peer to load from or send to).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from connectors.base import (ConnectorMetadata, ConnectorOutput, KVConnector, KVConnectorScheduler,
                             KVConnectorWorker, LeaseReport)
from connectors.metrics import FailureCause
from connectors.params import TransferParams

if TYPE_CHECKING:
    from kvcache import KVCacheBlocks, Request

    from connectors.pages import KVPages

logger = logging.getLogger(__name__)


class NoopConnectorScheduler(KVConnectorScheduler):
    """Scheduler half: nothing arrives from outside, nothing is kept, nothing is streamed."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self) -> ConnectorMetadata:
        return ConnectorMetadata()

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]
                         ) -> tuple[bool, TransferParams | None]:
        return False, None

    def update_connector_output(self, output: ConnectorOutput) -> None:
        pass

    def on_new_request(self, request: Request) -> None:
        if request.kv_transfer_params:  # what the engine's caller asked for cannot happen here: say so
            logger.warning("request %s carries kv_transfer_params but no connector is configured (no-op "
                           "connector): computing it locally", request.request_id)

    def prefill_stream_chunk(self, request: Request) -> int | None:
        return None

    def on_prefill_progress(self, request: Request, block_ids: tuple[list[int], ...]) -> None:
        pass

    def layer_hook(self, steps: list[tuple[Request, tuple[list[int], ...], int, bool]]) -> Callable[[int], None] | None:
        return None


class NoopConnectorWorker(KVConnectorWorker):
    """Worker half: no pages move; every report is empty."""

    shares_page_pool = False  # nobody maps the pool: it may live in private memory

    def register_kv_caches(self, page_pool: KVPages) -> None:
        pass

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        pass

    def start_load_kv(self) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_finished(self) -> tuple[set[str], set[str]]:
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def get_load_failures(self) -> dict[str, FailureCause]:
        return {}

    def shutdown(self) -> None:
        pass


class NoopConnector(KVConnector):
    """A `KVConnector` with nothing remote: nothing to release, no leases to abort or report."""

    def __init__(self) -> None:
        super().__init__(NoopConnectorScheduler(), NoopConnectorWorker())

    def release_remote(self, kv_transfer_params: TransferParams) -> bool:
        return False

    def abort_lease(self, request_id: str) -> bool:
        return False

    def report_leases(self, sink: Callable[[LeaseReport], None]) -> bool:
        return False

    def stats(self) -> dict[str, Any]:
        return {}

    def stream_source(self) -> dict[str, Any] | None:
        return None

    def listen_ports(self) -> dict[str, int] | None:
        return None


def or_noop(connector: KVConnector | None) -> KVConnector:
    """`connector`, or a new `NoopConnector` where there is none: the one place an absent connector
    becomes an object, so that code holding one never asks whether it has one."""
    return NoopConnector() if connector is None else connector
