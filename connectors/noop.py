"""A connector that moves nothing: every request is computed locally.

Useful as the default wiring (an engine with a connector slot but no peer)
and in tests of the engine's connector hooks. Requests carrying
`kv_transfer_params` are simply computed in full; nothing is ever delayed.
"""
from __future__ import annotations

from connectors.base import ConnectorMetadata, KVConnector, KVConnectorScheduler, KVConnectorWorker
from connectors.params import TransferParams


class NoopConnectorScheduler(KVConnectorScheduler):
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self) -> ConnectorMetadata:
        return ConnectorMetadata()

    def request_finished(self, request, block_ids) -> tuple[bool, TransferParams | None]:
        return False, None


class NoopConnectorWorker(KVConnectorWorker):
    def register_kv_caches(self, page_pool) -> None:
        pass

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        pass

    def start_load_kv(self) -> None:
        pass

    def get_finished(self) -> tuple[set[str], set[str]]:
        return set(), set()


class NoopConnector(KVConnector):
    """A `KVConnector` with nothing remote: nothing to release, no leases to abort."""

    def __init__(self) -> None:
        super().__init__(NoopConnectorScheduler(), NoopConnectorWorker())

    def release_remote(self, kv_transfer_params: TransferParams) -> bool:
        return False

    def abort_lease(self, request_id: str) -> bool:
        return False
