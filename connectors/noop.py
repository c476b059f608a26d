"""A connector that moves nothing: every request is computed locally.

Useful as the default wiring (an engine with a connector slot but no peer)
and in tests of the engine's connector hooks. Requests carrying
`kv_transfer_params` are simply computed in full; nothing is ever delayed.
"""
from __future__ import annotations

from connectors.base import ConnectorMetadata, KVConnectorScheduler, KVConnectorWorker


class NoopConnectorScheduler(KVConnectorScheduler):
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self) -> ConnectorMetadata:
        return ConnectorMetadata()

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
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


class NoopConnector:
    """`.scheduler` and `.worker` halves, as the engine expects."""

    def __init__(self) -> None:
        self.scheduler = NoopConnectorScheduler()
        self.worker = NoopConnectorWorker()

    def shutdown(self) -> None:
        self.worker.shutdown()
