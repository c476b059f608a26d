"""A tiny in-process connector for engine tests (the real one lives in connectors/).

Engines that share one `FakeLink` can pull pages from each other: the producer
keeps a finished request's blocks (delay free) and reports them sent once the
consumer copied them; the consumer loads asynchronously (optionally held until
the test releases it) and can be told to report a load as corrupt.
"""
from __future__ import annotations

from kvcache import RequestStatus

from connectors.base import ConnectorMetadata, KVConnector, KVConnectorScheduler, KVConnectorWorker
from connectors.metrics import FailureCause
from connectors.params import TransferParams, wants_remote_decode, wants_remote_prefill


class FakeLink:
    def __init__(self):
        self.pools = {}  # engine_id -> PagePool
        self.read_done: set[tuple[str, str]] = set()  # (producer engine id, request id) copied by a consumer
        self.hold_loads = False  # True: loads complete only through release()
        self.released: set[str] = set()
        self.remote_released: list[TransferParams] = []  # kv_transfer_params given to release_remote
        self.aborted_leases: list[str] = []
        self.corrupt: set[str] = set()  # request ids whose load is reported invalid
        self.num_loads = 0

    def release(self, request_id: str) -> None:
        self.released.add(request_id)


class FakeSchedulerHalf(KVConnectorScheduler):
    def __init__(self, link: FakeLink, engine_id: str):
        self.link = link
        self.engine_id = engine_id
        self.num_local: dict[str, int] = {}
        self.loads: dict[str, dict] = {}
        self.finished_calls: list[str] = []
        self.loaded: set[str] = set()  # requests whose load was ordered

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        params = request.kv_transfer_params
        if not wants_remote_prefill(params) or request.request_id in self.loaded:
            return 0, False
        count = params.remote_num_tokens - num_computed_tokens
        self.num_local[request.request_id] = num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        params = request.kv_transfer_params
        if wants_remote_prefill(params) and request.request_id not in self.loaded and num_external_tokens > 0:
            self.loads[request.request_id] = {
                "remote_engine_id": params.remote_engine_id,
                "remote_request_id": params.remote_request_id,
                "remote_block_ids": params.remote_block_ids,
                "local_block_ids": blocks.get_block_ids(),
                "num_local_tokens": self.num_local.pop(request.request_id, 0),
            }
            self.loaded.add(request.request_id)  # one load per request, as real connectors do

    def build_connector_meta(self):
        meta = ConnectorMetadata(loads=self.loads)
        self.loads = {}
        return meta

    def request_finished(self, request, block_ids):
        self.finished_calls.append(request.request_id)
        self.loaded.discard(request.request_id)
        if not wants_remote_decode(request.kv_transfer_params) or request.status == RequestStatus.FINISHED_ABORTED:
            return False, None
        return True, TransferParams(do_remote_prefill=True, remote_engine_id=self.engine_id,
                                    remote_request_id=request.request_id,
                                    remote_block_ids=tuple(tuple(ids) for ids in block_ids),
                                    remote_num_tokens=request.num_computed_tokens)


class FakeWorkerHalf(KVConnectorWorker):
    def __init__(self, link: FakeLink, engine_id: str, block_size: int):
        self.link = link
        self.engine_id = engine_id
        self.block_size = block_size
        self.inflight: dict[str, dict] = {}
        self.errors: set[int] = set()
        self.failures: dict[str, FailureCause] = {}
        self.pool = None

    def register_kv_caches(self, page_pool):
        self.pool = page_pool
        self.link.pools[self.engine_id] = page_pool

    def bind_connector_metadata(self, metadata):
        self.metadata = metadata

    def start_load_kv(self):
        self.inflight.update(self.metadata.loads)

    def get_finished(self):
        recving = set()
        for rid, load in list(self.inflight.items()):
            if self.link.hold_loads and rid not in self.link.released:
                continue
            del self.inflight[rid]
            src = self.link.pools[load["remote_engine_id"]]
            skip = load["num_local_tokens"] // self.block_size  # local prefix hits are already there
            for remote, local in zip(load["remote_block_ids"], load["local_block_ids"]):
                for j, (r, loc) in enumerate(zip(remote, local)):
                    if j >= skip and r and loc:
                        self.pool.buffer[loc].copy_(src.buffer[r])
            if rid in self.link.corrupt:
                self.errors.update(b for ids in load["local_block_ids"][:1] for b in ids[skip:] if b)
                self.failures[rid] = FailureCause.CHECKSUM
            self.link.read_done.add((load["remote_engine_id"], load["remote_request_id"]))
            self.link.num_loads += 1
            recving.add(rid)
        sending = {rid for eid, rid in self.link.read_done if eid == self.engine_id}
        self.link.read_done -= {(self.engine_id, rid) for rid in sending}
        return sending, recving

    def get_block_ids_with_load_errors(self):
        out, self.errors = self.errors, set()
        return out

    def get_load_failures(self):
        out, self.failures = self.failures, {}
        return out


class FakeConnector(KVConnector):
    def __init__(self, link: FakeLink, engine_id: str, block_size: int):
        super().__init__(FakeSchedulerHalf(link, engine_id), FakeWorkerHalf(link, engine_id, block_size))
        self.link = link

    def release_remote(self, kv_transfer_params):
        self.link.remote_released.append(kv_transfer_params)
        return True

    def abort_lease(self, request_id):
        self.link.aborted_leases.append(request_id)
        return True
