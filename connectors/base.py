"""The KV connector contract: a scheduler half and a worker half.

The scheduler half runs beside the engine's scheduler and decides *what* moves;
the worker half runs beside the page pool and moves the bytes. They talk through
one `ConnectorMetadata` object per engine step (built by the scheduler half,
bound to the worker half) and one `ConnectorOutput` per step (reported by the
worker half, consumed by the scheduler half). Both objects are plain data.

Invariants every implementation keeps:
- nothing here blocks the engine loop on the network: transfers run on
  background threads and are polled through `get_finished`;
- a request reported in `finished_recving` has its bytes landed *and verified*;
  a request whose load failed is reported finished as well, and its block ids
  appear in `get_block_ids_with_load_errors` so the scheduler never treats
  unverified pages as computed;
- blocks a producer keeps after `request_finished(...) -> (True, params)` are
  released exactly once, through `finished_sending`.

`KVConnector` is the one seam code above `connectors/` depends on: both halves
on one object, plus the remote-block lifecycle (`release_remote`,
`abort_lease`) and `stats`. The engine and the P/D worker call only its
methods, never the objects behind it (halves, producer, consumer). An engine
built without a connector holds `connectors.noop.NoopConnector`, so code above
never branches on whether there is one; in a step, the engine reaches the worker
half only through its connector seam (`pd.engine.runner.kv_connector`).
"""
from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from connectors.metrics import FailureCause

if TYPE_CHECKING:  # kvcache is below us; imported for types only
    from kvcache import KVCacheBlocks, Request

    from connectors.pages import KVPages
    from connectors.params import TransferParams


@dataclasses.dataclass
class ConnectorMetadata:
    """What the worker half must do this step (built once per step)."""

    # request_id -> load order (connector-specific plain data)
    loads: dict[str, Any] = dataclasses.field(default_factory=dict)
    # request ids whose blocks the producer side should keep / release
    saves: dict[str, Any] = dataclasses.field(default_factory=dict)
    aborted_request_ids: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class ConnectorOutput:
    """What the worker half reports after a step."""

    finished_sending: set[str] = dataclasses.field(default_factory=set)
    finished_recving: set[str] = dataclasses.field(default_factory=set)
    invalid_block_ids: set[int] = dataclasses.field(default_factory=set)
    # request_id -> why its load failed (requests in `finished_recving` whose load did not verify)
    load_failures: dict[str, FailureCause] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class PullsServed:
    """What a producer sent for one lease: its pulls, as one interval (`time.monotonic()` readings)."""

    trace_context: str | None  # the first valid one a PULL carried (the consumer's), or None
    num_pulls: int
    num_blocks: int
    num_bytes: int
    data_path: str  # how the pages went: tcp, shm (staged) or map (the consumer read this pool)
    started_s: float
    ended_s: float


@dataclasses.dataclass(frozen=True)
class LeaseReport:
    """How one lease ended (producer side, `KVConnector.report_leases`); times are `time.monotonic()`."""

    request_id: str
    outcome: str  # `connectors.metrics.LeaseEnd` value: done, expired, aborted, shutdown
    num_blocks: int  # blocks kept for the consumer
    granted_s: float
    ended_s: float  # when its blocks were handed back (no pull reading them any more)
    served: PullsServed | None  # None: nothing was pulled


class KVConnectorScheduler(abc.ABC):
    """Scheduler half: decides which tokens arrive from outside and what to keep."""

    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond `num_computed_tokens` that can be loaded from a remote
        worker, and whether the load is asynchronous (request waits in
        WAITING_FOR_REMOTE_KVS)."""

    @abc.abstractmethod
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Called after `allocate_slots` succeeded for a request with external tokens."""

    @abc.abstractmethod
    def build_connector_meta(self) -> ConnectorMetadata:
        """One metadata object per step; resets the per-step state."""

    @abc.abstractmethod
    def request_finished(self, request: Request,
                         block_ids: tuple[list[int], ...]) -> tuple[bool, TransferParams | None]:
        """Returns (delay_free, kv_transfer_params for the response)."""

    def update_connector_output(self, output: ConnectorOutput) -> None:  # noqa: B027 - optional hook
        """Sees what the worker half reported this step."""

    def on_new_request(self, request: Request) -> None:  # noqa: B027 - optional hook
        """Called when the engine accepts a request (before it reaches the queue head), so a
        connector can start keeping remote state alive (e.g. lease heartbeats) while it waits."""

    def prefill_stream_chunk(self, request: Request) -> int | None:
        """Called once when the engine accepts a request: None, its KV is not streamed; else the
        most prompt tokens one step may prefill for it, and the engine then calls
        `on_prefill_progress` after each step that advanced its prefill."""
        return None

    def on_prefill_progress(self, request: Request, block_ids: tuple[list[int], ...]) -> None:  # noqa: B027
        """A streamed request's prefill advanced (`request.num_computed_tokens` is computed, in
        these blocks per KV cache group); its last step is `request_finished`'s."""

    def layer_hook(self, steps: list[tuple[Request, tuple[list[int], ...], int, bool]]) -> Callable[[int], None] | None:
        """Before a forward that advances streamed prefills: `steps` holds (request, its block ids per
        group, tokens computed once the step ran, whether the step ends its prompt). None, or a
        callable the forward calls with each model layer's index once that layer ran (layer
        streaming: what it completed may be published then)."""
        return None


class KVConnectorWorker(abc.ABC):
    """Worker half: moves pages between page pools."""

    # Whether same-host peers may map this worker's page pool (the engine then allocates it
    # shareable); a worker whose pool nobody maps gets private memory on huge pages.
    shares_page_pool: bool = False

    @abc.abstractmethod
    def register_kv_caches(self, page_pool: KVPages) -> None: ...

    @abc.abstractmethod
    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None: ...

    @abc.abstractmethod
    def start_load_kv(self) -> None: ...

    def wait_for_save(self) -> None:  # noqa: B027 - pull mode saves nothing
        """Push-mode connectors block here until saved; pull mode returns at once."""

    @abc.abstractmethod
    def get_finished(self) -> tuple[set[str], set[str]]:
        """(finished_sending, finished_recving) request ids since the last call."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def get_load_failures(self) -> dict[str, FailureCause]:
        """request_id -> cause, for loads reported failed since the last call (after `get_finished`)."""
        return {}

    def shutdown(self) -> None:  # noqa: B027
        """Close sockets and join threads; idempotent."""


class KVConnector(KVConnectorScheduler, KVConnectorWorker):
    """Both halves of the contract on one object: the seam the engine and the P/D worker use.

    An implementation composes a scheduler half and a worker half (kept as `scheduler` and
    `worker` for the connector's own tests) and says how remote blocks are released early.
    Guarantees, besides the halves': `release_remote` and `abort_lease` are safe from any
    thread, never block on the network, and are harmless when repeated or when there is
    nothing to release (they return False then).
    """

    def __init__(self, scheduler: KVConnectorScheduler, worker: KVConnectorWorker) -> None:
        self.scheduler = scheduler
        self.worker = worker

    # -- remote-block lifecycle ------------------------------------------------
    @abc.abstractmethod
    def release_remote(self, kv_transfer_params: TransferParams) -> bool:
        """Consumer side: tell the producer named in `kv_transfer_params` (a request this
        engine will not load) that nobody will read its blocks, so it frees them now rather
        than at lease expiry. True when a release was sent."""

    @abc.abstractmethod
    def abort_lease(self, request_id: str) -> bool:
        """Producer side: free the blocks kept for `request_id` (a finished prefill nobody
        will pull) now. True when this connector keeps leases (the call was made)."""

    def report_leases(self, sink: Callable[[LeaseReport], None]) -> bool:
        """Producer side: from now on, every lease that ends is reported to `sink`, on the engine's
        thread, in the step whose `finished_sending` frees its blocks (and at `shutdown`). Until
        this is called nothing is recorded for a report. False where this connector keeps no leases."""
        return False

    def stats(self) -> dict[str, Any]:
        """Transfer figures for JSON (plain data)."""
        return {}

    def stream_source(self) -> dict[str, Any] | None:
        """Producer with KV streaming on: `engine_id`, `host` and `port` a router names in a
        streamed request's decode-side params; None where this connector streams nothing."""
        return None

    def listen_ports(self) -> dict[str, int] | None:
        """Producer side: the ports this connector listens on itself (`side_channel`, `data`;
        not an emulated link's), or None where it listens on none."""
        return None

    # -- scheduler half ----------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self) -> ConnectorMetadata:
        return self.scheduler.build_connector_meta()

    def request_finished(self, request: Request,
                         block_ids: tuple[list[int], ...]) -> tuple[bool, TransferParams | None]:
        return self.scheduler.request_finished(request, block_ids)

    def update_connector_output(self, output: ConnectorOutput) -> None:
        self.scheduler.update_connector_output(output)

    def on_new_request(self, request: Request) -> None:
        self.scheduler.on_new_request(request)

    def prefill_stream_chunk(self, request: Request) -> int | None:
        return self.scheduler.prefill_stream_chunk(request)

    def on_prefill_progress(self, request: Request, block_ids: tuple[list[int], ...]) -> None:
        self.scheduler.on_prefill_progress(request, block_ids)

    def layer_hook(self, steps: list[tuple[Request, tuple[list[int], ...], int, bool]]) -> Callable[[int], None] | None:
        return self.scheduler.layer_hook(steps)

    # -- worker half ---------------------------------------------------------------
    @property  # the worker half decides
    def shares_page_pool(self) -> bool:  # type: ignore[override]
        return bool(self.worker.shares_page_pool)

    def register_kv_caches(self, page_pool: KVPages) -> None:
        self.worker.register_kv_caches(page_pool)

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        self.worker.bind_connector_metadata(metadata)

    def start_load_kv(self) -> None:
        self.worker.start_load_kv()

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def get_finished(self) -> tuple[set[str], set[str]]:
        return self.worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def get_load_failures(self) -> dict[str, FailureCause]:
        return self.worker.get_load_failures()

    def shutdown(self) -> None:
        self.worker.shutdown()
