"""P's lease spans (tracing on only): how long a finished prefill's blocks were kept for D, and how
P served D's pull of them.

    pdkv.prefill.lease   child of P's `pdkv.prefill`, from the lease's grant to its end:
                         `pdkv.lease.outcome` (done | expired | aborted | shutdown), `pdkv.kv.num_blocks`
                         kept, `pdkv.kv.num_blocks_sent` / `num_bytes_sent` / `num_pulls` served;
                         status error unless done (expired: D never came, e.g. it died)
    pdkv.kv_serve        P sending the pages, as one interval over the lease's pulls: a child of D's
                         `pdkv.kv_pull` when D's PULL carried its trace context (W3C traceparent,
                         validated by the connector), linked to the lease span; else a child of it.
                         `pdkv.kv.num_bytes`, `num_blocks`, `num_pulls`,
                         `data_path` (tcp | shm_mapped | shm_staged | cuda_ipc)

The connector reports each ended lease (`connectors.base.LeaseReport`, on the engine's thread); the
spans are written then, from the connector's own times, so none is ever left open. P's trace
registers its span's context when the request starts (`expect`); a report with no registered context
(tracing started later, or evicted) makes no span. `close` writes a `shutdown` lease span for every
lease granted but not reported by then. At most `MAX_PENDING` contexts are kept (oldest dropped).
"""
from __future__ import annotations

import collections
import threading
import time

from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanKind, get_current_span, set_span_in_context

from connectors.base import LeaseReport
from pd.cluster.tracing import Tracing, extract

MAX_PENDING = 4096


class _Pending:
    __slots__ = ("parent", "granted_s", "num_blocks")

    def __init__(self, parent: Context) -> None:
        self.parent = parent
        self.granted_s: float | None = None  # time.monotonic() once the prefill handed out its lease
        self.num_blocks = 0


class LeaseSpans:
    def __init__(self, tracing: Tracing) -> None:
        self._tracing = tracing
        self._lock = threading.Lock()
        self._pending: collections.OrderedDict[str, _Pending] = collections.OrderedDict()

    def expect(self, request_id: str, parent: Context) -> None:
        """A prefill request started: its lease, if it gets one, is a child of `parent`."""
        with self._lock:
            self._pending[request_id] = _Pending(parent)
            self._pending.move_to_end(request_id)
            while len(self._pending) > MAX_PENDING:
                self._pending.popitem(last=False)

    def granted(self, request_id: str, num_blocks: int) -> None:
        with self._lock:
            pending = self._pending.get(request_id)
            if pending is not None:
                pending.granted_s, pending.num_blocks = time.monotonic(), num_blocks

    def forget(self, request_id: str) -> None:
        """The prefill ended without a lease."""
        with self._lock:
            self._pending.pop(request_id, None)

    def forget_ungranted(self, request_id: str) -> None:
        """The request ended (finished, aborted or broken): without a grant, no lease will be reported."""
        with self._lock:
            pending = self._pending.get(request_id)
            if pending is not None and pending.granted_s is None:
                del self._pending[request_id]

    def on_report(self, report: LeaseReport) -> None:
        with self._lock:
            pending = self._pending.pop(report.request_id, None)
        if pending is None:
            return
        t = self._tracing
        served = report.served
        lease = t.interval("pdkv.prefill.lease", pending.parent, report.granted_s, report.ended_s, {
            "pdkv.request_id": report.request_id, "pdkv.lease.outcome": report.outcome,
            "pdkv.kv.num_blocks": report.num_blocks,
            "pdkv.kv.num_blocks_sent": served.num_blocks if served else 0,
            "pdkv.kv.num_bytes_sent": served.num_bytes if served else 0,
            "pdkv.kv.num_pulls": served.num_pulls if served else 0},
            error=None if report.outcome == "done" else report.outcome, clock=time.monotonic)
        if served is None:
            return
        lease_ctx = lease.get_span_context()
        remote = extract({"traceparent": served.trace_context}) if served.trace_context else None
        pull_parent = remote if remote is not None and get_current_span(remote).get_span_context().is_valid else None
        parent = pull_parent or set_span_in_context(lease)
        t.interval("pdkv.kv_serve", parent, served.started_s, served.ended_s, {
            "pdkv.request_id": report.request_id, "pdkv.kv.num_bytes": served.num_bytes,
            "pdkv.kv.num_blocks": served.num_blocks, "pdkv.kv.num_pulls": served.num_pulls,
            "pdkv.kv.data_path": served.data_path}, clock=time.monotonic, kind=SpanKind.SERVER,
            links=[Link(lease_ctx)] if pull_parent is not None else None)

    def close(self) -> None:
        """Writes the leases granted and never reported as ended by `shutdown` (before tracing closes)."""
        with self._lock:
            pending, self._pending = self._pending, collections.OrderedDict()
        now = time.monotonic()
        for request_id, p in pending.items():
            if p.granted_s is not None:
                self._tracing.interval("pdkv.prefill.lease", p.parent, p.granted_s, now, {
                    "pdkv.request_id": request_id, "pdkv.lease.outcome": "shutdown",
                    "pdkv.kv.num_blocks": p.num_blocks}, error="shutdown", clock=time.monotonic)

