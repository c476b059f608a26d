"""ZmqConnector: configuration, the worker half, and the two halves wired together.

    connector = ZmqConnector(ZmqConnectorConfig(engine_id=..., role=KVRole.CONSUMER,
                                                secret=..., model_id=...), kv_cache_groups)
    engine = Engine(engine_config, connector=connector)   # a KVConnector
    ...
    connector.release_remote(kv_transfer_params)   # decode side: will not load it, free it now
    connector.abort_lease(request_id)              # prefill side: nobody will pull it, free it now
    connector.shutdown()

The worker half starts the producer (side channel + data listener) and/or the
consumer when the engine registers its page pool; it turns each step's
metadata into leases, loads, releases and heartbeats, and reports finished
sends/loads (plus the blocks of failed loads) back through `get_finished` /
`get_block_ids_with_load_errors`.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import threading
from collections.abc import Callable
from typing import Any

from connectors.base import ConnectorMetadata, KVConnector, KVConnectorWorker, LeaseReport
from connectors.zmq.consumer.consumer import Consumer
from connectors.zmq.consumer.consumer_config import ConsumerConfig, DataPath
from connectors.zmq.consumer.loads import LoadResult, RemoteAddr
from connectors.zmq.paths.cuda_staging import StreamFences, fences_for
from connectors.links.emulated_link import EmulatedLink
from connectors.links.link_shape import LinkShape
from connectors.zmq.control.handshake import CompatInfo
from connectors.zmq.gang.gang_side import GangSide
from connectors.zmq.streaming.layer_slices import LayerClock, SlicedPages, blocks_of, choose_num_slices
from connectors.metrics import FailureCause, TransferMetrics
from connectors.pages import KVPages
from connectors.params import TransferParams
from connectors.zmq.producer.producer import Producer, ProducerConfig
from connectors.zmq.scheduler import GroupLayout, ZmqConnectorMetadata, ZmqConnectorScheduler

logger = logging.getLogger(__name__)

MAX_LAYER_PARTS = 64  # layer streaming: most slices per page (each slice is a PULL's unit and a digest)


class KVRole(str, enum.Enum):
    PRODUCER = "kv_producer"  # prefill worker: leases blocks, serves pulls
    CONSUMER = "kv_consumer"  # decode worker: pulls blocks
    BOTH = "kv_both"


@dataclasses.dataclass(frozen=True)
class ZmqConnectorConfig:
    engine_id: str
    role: KVRole
    secret: bytes  # shared by every worker of the deployment; >= 16 bytes
    model_id: str  # model identity for the compatibility hash (name + revision)
    host: str = "127.0.0.1"  # side channel and data listener bind here
    port: int = 0  # side channel port; 0 = pick a free one (see `ZmqConnector.port`)
    advertise_host: str | None = None  # host written into kv_transfer_params (default: host)
    lease_s: float = 30.0
    heartbeat_interval_s: float | None = None  # default lease_s / 6
    handshake_timeout_s: float = 5.0
    transfer_timeout_s: float = 30.0
    io_timeout_s: float = 5.0
    data_path: DataPath = DataPath.AUTO
    num_tcp_streams: int = 4
    shm_chunk_bytes: int = 8 * 1024 * 1024
    allow_shm: bool = True  # producer: let same-host consumers use shared memory (map the pool / staging)
    # Tests and benchmarks only: the producer's side channel and data port are reached through an
    # `EmulatedLink` of this shape (and shared memory is not offered, so the bytes cross it).
    emulated_link: LinkShape | None = None
    # KV streaming (`connectors.zmq.streaming.publisher`): "chunk", a producer publishes a streamed request's
    # blocks after each prefill step of at most `stream_chunk_tokens` tokens; "layer", each step's
    # blocks slice by slice of at most `stream_layer_parts` per page as the forward's layers run
    # (`connectors.zmq.streaming.layer_slices`); "off", at its end.
    streaming: str = "off"
    stream_chunk_tokens: int = 256
    stream_layer_parts: int = 6

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", KVRole(self.role))
        object.__setattr__(self, "data_path", DataPath(self.data_path))
        if isinstance(self.secret, str):
            object.__setattr__(self, "secret", self.secret.encode())
        if len(self.secret) < 16:
            raise ValueError("secret must be at least 16 bytes")
        if not self.engine_id or not self.model_id:
            raise ValueError("engine_id and model_id must be non-empty")
        if self.streaming not in ("off", "chunk", "layer") or self.stream_chunk_tokens < 1:
            raise ValueError("streaming must be 'off', 'chunk' or 'layer', stream_chunk_tokens >= 1")
        if not 1 <= self.stream_layer_parts <= MAX_LAYER_PARTS:
            raise ValueError(f"stream_layer_parts must be in [1, {MAX_LAYER_PARTS}]")
        if self.lease_s <= 0 or (self.heartbeat_interval_s is not None and self.heartbeat_interval_s <= 0):
            raise ValueError("lease_s and heartbeat_interval_s must be positive")

    @property
    def is_producer(self) -> bool:
        return self.role in (KVRole.PRODUCER, KVRole.BOTH)

    @property
    def is_consumer(self) -> bool:
        return self.role in (KVRole.CONSUMER, KVRole.BOTH)


class ZmqConnectorWorker(KVConnectorWorker):
    """Worker half: owns the producer and consumer of this engine."""

    def __init__(self, config: ZmqConnectorConfig, kv_cache_groups: tuple[Any, ...], metrics: TransferMetrics,
                 num_slices: int = 1, gang: GangSide | None = None):
        """`num_slices` > 1: layer streaming, every page moves as that many layer slices. `gang`: this
        worker's TP gang (TP > 1; `kv_cache_groups` then describe canonical pages, every KV head)."""
        if gang is not None and gang.tp > 1 and config.streaming == "layer":
            raise ValueError("transfer.streaming 'layer' with TP > 1: a layer slice is a byte range of a canonical "
                             "page, but each rank holds a strided run of heads in every layer's rows, so no rank "
                             "holds a slice; use 'chunk' (whole pages, every rank its heads) or 'off'")
        self.gang = gang
        self.config = config
        self.num_slices = num_slices
        self.metrics = metrics
        self._groups = kv_cache_groups
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        self._meta: ConnectorMetadata | None = None
        self._local_results: list[LoadResult] = []
        self._invalid: set[int] = set()
        self._failures: dict[str, FailureCause] = {}
        self._lock = threading.Lock()
        self._fences: StreamFences | None = None  # CUDA pools: compute-stream <-> transfer ordering
        self.link: EmulatedLink | None = None  # producer with an emulated link: consumers go through it
        self.advertised_port = 0  # the side-channel port consumers dial (the link's, when there is one)
        self._offer_shm = config.allow_shm and config.emulated_link is None
        self.shares_page_pool = config.is_producer and self._offer_shm  # same-host consumers map it
        self._lease_sink: Callable[[LeaseReport], None] | None = None  # `report_leases`
        self._gang_in_use: GangSide | None = None  # the given gang, or a gang of one (TP 1)

    def register_kv_caches(self, page_pool: KVPages) -> None:
        cfg = self.config
        self._fences = fences_for(page_pool)
        if cfg.streaming == "layer":  # (one slice too: publishing inside the forward needs a CPU pool)
            page_pool = self._sliced(page_pool)
        gang = self.gang
        # The hash describes canonical pages (a TP 1 worker's), so any P TP meets any D TP.
        page_bytes = page_pool.page_size_bytes if gang is None else max(g.page_size_bytes for g in self._groups)
        compat = CompatInfo.from_groups(cfg.model_id, self._groups, page_bytes).hash()
        if gang is None and cfg.streaming != "layer":  # TP 1: a gang of one, started only if a gang meets it
            try:
                gang = GangSide.for_single_rank(self._groups, cfg.advertise_host or cfg.host, cfg.transfer_timeout_s)
            except ValueError as e:
                logger.debug("no gang path for this worker: %s", e)
        if gang is not None:
            gang.attach_pool(page_pool, serve=cfg.is_producer, canonical_page_bytes=page_bytes)
        self._gang_in_use = gang
        if cfg.is_producer:
            self.producer = Producer(ProducerConfig(
                engine_id=cfg.engine_id, secret=cfg.secret, compat_hash=compat, host=cfg.host, port=cfg.port,
                lease_s=cfg.lease_s, io_timeout_s=cfg.io_timeout_s, handshake_timeout_s=cfg.handshake_timeout_s,
                shm_chunk_bytes=cfg.shm_chunk_bytes, offer_shm=self._offer_shm,
                offer_device=self._offer_shm), page_pool, self.metrics)
            self.producer.data_streams.gang = gang
            self.producer.start()
            self.advertised_port = self.producer.port
            if cfg.emulated_link is not None:
                self._start_link(cfg.emulated_link)
        if cfg.is_consumer:
            self.consumer = Consumer(ConsumerConfig(
                engine_id=cfg.engine_id, secret=cfg.secret, compat_hash=compat, data_path=cfg.data_path,
                num_tcp_streams=cfg.num_tcp_streams, handshake_timeout_s=cfg.handshake_timeout_s,
                transfer_timeout_s=cfg.transfer_timeout_s, io_timeout_s=cfg.io_timeout_s,
                heartbeat_interval_s=cfg.heartbeat_interval_s or cfg.lease_s / 6), page_pool, self.metrics)
            self.consumer.gang = gang
            self.consumer.start()

    def _sliced(self, page_pool: KVPages) -> KVPages:
        """Layer streaming: the pool as layer slices, after checking a page is its slots' layers and
        nothing else (else a slice would not be whole layers)."""
        biggest = max(self._groups, key=lambda g: len(g.layer_names))
        if int(biggest.spec.page_size_bytes) * len(biggest.layer_names) != page_pool.page_size_bytes:
            raise ValueError(f"layer streaming: a page of {page_pool.page_size_bytes} bytes is not "
                             f"{len(biggest.layer_names)} layers of {biggest.spec.page_size_bytes}")
        return SlicedPages(page_pool, self.num_slices)

    def _start_link(self, shape: LinkShape) -> None:
        """Puts the side channel and the data port behind one emulated link: the WELCOME and
        kv_transfer_params name the link's ports, so every consumer's bytes cross it."""
        assert self.producer is not None
        host = self.config.host
        target = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host  # (a wildcard bind is reached locally)
        self.link = EmulatedLink(shape)
        self.advertised_port = self.link.relay(target, self.producer.port, host=host).port
        self.producer.advertised_data_port = self.link.relay(target, self.producer.data_port, host=host).port
        logger.warning("KV producer %s behind an emulated link (%.1f Mbit/s, %.1f ms one way): side channel %d, "
                       "data %d", self.config.engine_id, shape.bandwidth_mbps, shape.latency_ms,
                       self.advertised_port, self.producer.advertised_data_port)

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        self._meta = metadata

    def start_load_kv(self) -> None:
        meta, self._meta = self._meta, None
        if meta is None:
            return
        if self.producer is not None:
            for rid in meta.aborted_request_ids:
                self.producer.abort_lease(rid)
        for rid, order in meta.loads.items():
            self._start_load(rid, order)
        if isinstance(meta, ZmqConnectorMetadata) and self.consumer is not None:
            for rid in meta.cancels:
                self.consumer.cancel(rid)
            for remote, remote_rid in meta.releases:
                self.consumer.notify_done(remote, [remote_rid])
            if meta.heartbeats is not None:
                self.consumer.set_heartbeats(meta.heartbeats)

    def _start_load(self, rid: str, order: dict) -> None:
        remote = RemoteAddr(order["remote_engine_id"], order["remote_host"], order["remote_port"])
        if order["invalid"] or self.consumer is None:
            why = ("this engine is not a KV consumer" if self.consumer is None
                   else "the producer did not send every needed block")
            logger.warning("KV load for %s cannot run: %s", rid, why)
            self._finish_locally(rid, order["dst"] + order["invalid"])
            if self.consumer is not None:
                self.consumer.notify_done(remote, [order["remote_request_id"]])
            return
        if not order["dst"]:
            self._finish_locally(rid, [])
            self.consumer.notify_done(remote, [order["remote_request_id"]])
            return
        try:
            if order.get("streamed"):
                self.consumer.load_streamed(rid, remote, order["remote_request_id"],
                                            {(g, pos): d for g, pos, d in order["wanted"]}, order.get("trace_context"))
                return
            self.consumer.load(rid, remote, order["remote_request_id"], order["src"], order["dst"],
                               order.get("trace_context"))
        except ValueError as e:
            logger.warning("KV load for %s refused: %s", rid, e)
            self._finish_locally(rid, order["dst"])

    def _finish_locally(self, rid: str, bad: list[int]) -> None:
        with self._lock:
            self._local_results.append(
                LoadResult(rid, not bad, bad, FailureCause.PULL_REFUSED if bad else None, 0, 0.0))

    def wait_for_save(self) -> None:
        # Nothing waits here: on a CUDA pool this only records an event after the forward that
        # transfer threads' side streams wait on before reading pages (no-op on CPU).
        if self._fences is not None:
            self._fences.mark_written()

    def report_leases(self, sink: Callable[[LeaseReport], None]) -> bool:
        if self.producer is None:
            return False
        self._lease_sink = sink
        self.producer.leases.enable_reports()
        return True

    def _report_leases(self) -> None:
        if self._lease_sink is None or self.producer is None:
            return
        for report in self.producer.leases.take_reports():
            try:
                self._lease_sink(report)
            except Exception:  # an observer's bug must not end the engine's step
                logger.exception("lease report of %s failed", report.request_id)

    def get_finished(self) -> tuple[set[str], set[str]]:
        sending = self.producer.take_released() if self.producer is not None else set()
        self._report_leases()
        with self._lock:
            results, self._local_results = self._local_results, []
        if self.consumer is not None:
            results += self.consumer.take_finished()
        recving = set()
        for r in results:
            recving.add(r.request_id)
            if not r.ok:  # (layer streaming: the blocks of the bad units)
                self._invalid.update(blocks_of(r.invalid_block_ids, self.num_slices) if self.num_slices > 1
                                     else r.invalid_block_ids)
                if r.cause is not None:
                    self._failures[r.request_id] = r.cause
        if self._fences is not None:  # CUDA: later forwards run after every H2D landed so far
            self._fences.order_reads_after_landing()
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def get_load_failures(self) -> dict[str, FailureCause]:
        out, self._failures = self._failures, {}
        return out

    def release_remote(self, kv_transfer_params: TransferParams) -> bool:
        """Sends DONE for a remote-prefilled request this engine will not load (see KVConnector)."""
        params = kv_transfer_params
        if self.consumer is None or not params.do_remote_prefill:
            return False
        engine_id, host, port, rid = (params.remote_engine_id, params.remote_host, params.remote_port,
                                      params.remote_request_id)
        if not (engine_id and host and rid and port is not None and 0 < port < 65536):
            return False
        self.consumer.notify_done(RemoteAddr(engine_id, host, port), [rid])
        return True

    def abort_lease(self, request_id: str) -> bool:
        if self.producer is None:
            return False
        self.producer.abort_lease(request_id)
        return True

    def shutdown(self) -> None:
        if self.consumer is not None:
            self.consumer.shutdown()
        if self.link is not None:
            self.link.close()
        if self.producer is not None:
            self.producer.shutdown()
            self._report_leases()  # the leases shutdown ended (outcome shutdown)
        if self._gang_in_use is not None:
            self._gang_in_use.close()  # stops every rank's agent


class ZmqConnector(KVConnector):
    """The engine-facing `KVConnector`: a `ZmqConnectorScheduler` and a `ZmqConnectorWorker`."""

    worker: ZmqConnectorWorker
    scheduler: ZmqConnectorScheduler

    def __init__(self, config: ZmqConnectorConfig, kv_cache_groups: tuple[Any, ...], gang: GangSide | None = None):
        """`kv_cache_groups`: the engine's `KVCacheGroupSpec`s (KVCacheConfig.groups), in group order;
        canonical (every KV head) for a TP gang, whose rank 0 passes `gang` (`connectors/zmq/gang/`)."""
        self.config = config
        self.metrics = TransferMetrics()
        layouts = tuple(GroupLayout.from_spec(g.spec) for g in kv_cache_groups)
        chunk = config.stream_chunk_tokens if config.streaming != "off" and config.is_producer else None
        clock = None
        if config.streaming == "layer":
            num_slots = max(len(g.layer_names) for g in kv_cache_groups)
            clock = LayerClock.from_groups(kv_cache_groups, choose_num_slices(num_slots, config.stream_layer_parts))
        super().__init__(
            ZmqConnectorScheduler(config.engine_id, layouts, config.lease_s, self._endpoint, chunk, clock),
            ZmqConnectorWorker(config, tuple(kv_cache_groups), self.metrics, clock.num_slices if clock else 1, gang))

    def _endpoint(self) -> tuple[str, int, Producer | None]:
        producer = self.worker.producer
        return (self.config.advertise_host or self.config.host, self.worker.advertised_port, producer)

    @property
    def port(self) -> int:
        """The side-channel port consumers dial, that of the emulated link when there is one
        (after the engine registered its page pool)."""
        return self.worker.advertised_port

    def release_remote(self, kv_transfer_params: TransferParams) -> bool:
        return self.worker.release_remote(kv_transfer_params)

    def get_finished(self) -> tuple[set[str], set[str]]:
        sending, recving = self.worker.get_finished()
        return self.scheduler.filter_sending(sending), recving

    def stream_source(self) -> dict[str, Any] | None:
        """Producer with streaming on: what a router names in a streamed request's decode-side params
        (this engine's id and the side channel consumers dial); None otherwise."""
        if self.config.streaming == "off" or self.worker.producer is None:
            return None
        return {"engine_id": self.config.engine_id, "host": self.config.advertise_host or self.config.host,
                "port": self.worker.advertised_port}

    def abort_lease(self, request_id: str) -> bool:
        return self.worker.abort_lease(request_id)

    def report_leases(self, sink: Callable[[LeaseReport], None]) -> bool:
        return self.worker.report_leases(sink)

    def listen_ports(self) -> dict[str, int] | None:
        producer = self.worker.producer
        if producer is None:
            return None
        return {"side_channel": producer.port, "data": producer.data_port}

    def stats(self) -> dict:
        stats = self.metrics.snapshot()
        if self.worker.link is not None:
            stats["emulated_link"] = self.worker.link.stats()
        return stats

