"""The scheduler half of the ZMQ connector (pull mode).

Decode side (request with `do_remote_prefill`):
- `get_num_new_matched_tokens` -> (remote tokens beyond the local prefix hit, async=True);
- `update_state_after_alloc` plans the pull: for every KV cache group, the
  destination blocks at positions past the local hit that are not null
  (sliding-window groups hold null blocks outside the window), paired by
  position with the producer's end-aligned block list. Only that suffix moves;
- `request_finished` of a request that never loaded tells the producer to
  release at once; heartbeats keep the producer's lease alive while the
  request waits in this engine's queue.

Prefill side (request with `do_remote_decode`): `request_finished` of a
normally finished request clips sliding-window groups to the window, leases
those blocks on the producer right away (so no pull can arrive before the
lease), and returns (True, kv_transfer_params); an aborted request returns
(False, None) so its blocks are freed at once.

Streamed requests (`streaming: true` in the params, `transfer.streaming: chunk`):
- prefill side: the prefill runs in chunks of at most `stream_chunk_tokens`
  (`prefill_stream_chunk`); after each step (`on_prefill_progress`) the blocks
  it completed, per group by position (sliding-window groups: only those the
  final window keeps; state groups: only at the end), are published to the
  producer (`connectors.zmq.streaming.publisher`), the rest in `request_finished`. A
  streamed request that ends badly fails its stream (the consumer is told);
- decode side: the external tokens are the prompt past the local prefix hit;
  the load names its destination blocks by (group, position) and pulls each
  part as it is published (`connectors.zmq.streaming.stream_load`); an abort cancels it.

Layer streaming (`transfer.streaming: layer`, `connectors.zmq.streaming.layer_slices`):
every block id this half hands the worker half or the producer is a transfer
unit (a page's layer slice), and a streamed prefill step's blocks are
published slice by slice while the forward runs (`layer_hook`): slice k as
soon as its last layer ran. A step that runs every layer in one call (the
fused kernel) publishes its slices after the step, as chunk mode does.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any
from collections.abc import Callable

from connectors.base import ConnectorMetadata, ConnectorOutput, KVConnectorScheduler
from connectors.zmq.streaming.layer_slices import LayerClock, units
from connectors.zmq.consumer.loads import RemoteAddr
from connectors.params import (InvalidKVParams, RemotePrefill, TransferParams, make_remote_prefill_params,
                               make_stream_params, parse_remote_prefill, trace_context_of, wants_remote_decode,
                               wants_remote_prefill, wants_stream)

logger = logging.getLogger(__name__)

_FINISHED_OK = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """What the scheduler half needs to know about one KV cache group."""

    block_size: int
    keep_blocks: int | None  # None: every block matters; else only the last `keep_blocks`
    final_only: bool = False  # the group's block changes until the prefill ends (a state, not KV)

    @classmethod
    def from_spec(cls, spec: Any) -> GroupLayout:
        window = getattr(spec, "sliding_window", None)
        if window:
            return cls(spec.block_size, -(-window // spec.block_size) + 1)
        if type(spec).__name__ == "MambaSpec":
            return cls(spec.block_size, 1, final_only=True)  # the state lives in the last block
        return cls(spec.block_size, None)


@dataclasses.dataclass
class ZmqConnectorMetadata(ConnectorMetadata):
    """Per-step orders. `loads[rid]` = {remote fields, "src", "dst", "invalid"}."""

    releases: list[tuple[RemoteAddr, str]] = dataclasses.field(default_factory=list)
    cancels: list[str] = dataclasses.field(default_factory=list)  # streamed loads whose request ended here
    heartbeats: dict[RemoteAddr, list[str]] | None = None  # None: unchanged since the last step


class ZmqConnectorScheduler(KVConnectorScheduler):
    def __init__(self, engine_id: str, groups: tuple[GroupLayout, ...], lease_s: float,
                 endpoint: Callable[[], tuple[str, int, Any]], stream_chunk_tokens: int | None = None,
                 clock: LayerClock | None = None):
        """`endpoint()` -> (advertised host, side-channel port, producer or None);
        `stream_chunk_tokens`: None, streaming off; else a streamed prefill's largest chunk;
        `clock`: layer streaming (both sides), else None."""
        self.engine_id = engine_id
        self.groups = groups
        self.lease_s = lease_s
        self._endpoint = endpoint
        self._remote: dict[str, RemotePrefill] = {}  # decode requests seen, by request id
        self._local_hits: dict[str, int] = {}
        self._claimed: set[str] = set()  # load planned (or released): never again for this request
        self._waiting: dict[str, RemoteAddr] = {}  # heartbeat set
        self._heartbeats_changed = False
        self._meta = ZmqConnectorMetadata()
        self.stream_chunk_tokens = stream_chunk_tokens
        self._stream_next: dict[str, set[tuple[int, int]]] = {}  # streamed prefills: (group, position) published
        self._stream_gone: set[str] = set()  # streamed prefills whose lease ended while they ran
        self._clock = clock
        self.num_slices = clock.num_slices if clock is not None else 1
        # layer streaming: a streamed prefill's completed blocks not yet published, by (group, slice)
        self._slices_due: dict[str, dict[tuple[int, int], list[tuple[int, int]]]] = {}

    # ------------------------------------------------------------------ decode side
    def on_new_request(self, request) -> None:
        """Optional hook at add_request: start heartbeats before the request reaches the queue head."""
        self._remote_of(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        rp = self._remote_of(request)
        if rp is None or request.request_id in self._claimed:
            return 0, False
        self._local_hits[request.request_id] = num_computed_tokens
        num_tokens = request.num_prompt_tokens if rp.streamed else min(rp.num_tokens, request.num_prompt_tokens)
        count = num_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        rid = request.request_id
        rp = self._remote_of(request)
        if rp is None or rid in self._claimed:
            return
        self._claimed.add(rid)
        remote = RemoteAddr(rp.engine_id, rp.host, rp.port)
        if num_external_tokens <= 0:  # everything was a local hit: the producer may let go
            self._stop_heartbeat(rid)
            self._meta.releases.append((remote, rp.request_id))
            return
        local = self._local_hits.pop(rid, 0)
        trace_context = trace_context_of(request.kv_transfer_params)
        if rp.streamed:  # destinations by (group, position); the producer's blocks come as published
            n = self.num_slices
            wanted = [[g, pos * n + k, d * n + k] for g, layout in enumerate(self.groups) for pos, d in enumerate(
                blocks.get_block_ids()[g][: -(-(local + num_external_tokens) // layout.block_size)])
                if pos >= local // layout.block_size and d != 0 for k in range(n)]
            self._meta.loads[rid] = {
                "remote_engine_id": rp.engine_id, "remote_host": rp.host, "remote_port": rp.port,
                "remote_request_id": rp.request_id, "streamed": True, "wanted": wanted, "src": [],
                "dst": [d for _, _, d in wanted], "invalid": [], "trace_context": trace_context}
            return
        src, dst, invalid = self.plan(rp, blocks.get_block_ids(), local, local + num_external_tokens)
        if self.num_slices > 1:
            src, dst, invalid = (units(x, self.num_slices) for x in (src, dst, invalid))
        self._meta.loads[rid] = {
            "remote_engine_id": rp.engine_id, "remote_host": rp.host, "remote_port": rp.port,
            "remote_request_id": rp.request_id, "src": src, "dst": dst, "invalid": invalid,
            "trace_context": trace_context,
        }

    def plan(self, rp: RemotePrefill, dst_groups, num_local: int,
             num_total: int) -> tuple[list[int], list[int], list[int]]:
        """(src, dst, uncovered) block ids for tokens [num_local, num_total).

        Positions are aligned per group: the producer's list ends at its last
        computed block; the consumer's blocks past the local hit that are null
        (out of a sliding window) are skipped; a needed destination block the
        producer did not send is returned in `uncovered` (the load then fails
        rather than leave it unfilled).
        """
        src, dst, uncovered = [], [], []
        for g, layout in enumerate(self.groups):
            bs = layout.block_size
            mine = dst_groups[g]
            theirs = rp.block_ids[g]
            their_end = -(-rp.num_tokens // bs)
            their_start = their_end - len(theirs)
            for pos in range(num_local // bs, min(-(-num_total // bs), len(mine))):
                d = mine[pos]
                if d == 0:
                    continue
                if their_start <= pos < their_end:
                    src.append(theirs[pos - their_start])
                    dst.append(d)
                else:
                    uncovered.append(d)
        return src, dst, uncovered

    def _remote_of(self, request) -> RemotePrefill | None:
        rid = request.request_id
        rp = self._remote.get(rid)
        if rp is not None or rid in self._claimed:
            return rp
        params = request.kv_transfer_params
        if not wants_remote_prefill(params):
            return None
        try:
            rp = parse_remote_prefill(params, len(self.groups))
        except InvalidKVParams as e:
            logger.warning("request %s: ignoring kv_transfer_params (%s); computing it locally", rid, e)
            self._claimed.add(rid)
            return None
        self._remote[rid] = rp
        self._waiting[rid] = RemoteAddr(rp.engine_id, rp.host, rp.port)
        self._heartbeats_changed = True
        return rp

    def _stop_heartbeat(self, rid: str) -> None:
        if self._waiting.pop(rid, None) is not None:
            self._heartbeats_changed = True

    # ------------------------------------------------------------------ both sides
    def build_connector_meta(self) -> ZmqConnectorMetadata:
        meta, self._meta = self._meta, ZmqConnectorMetadata()
        if self._heartbeats_changed:
            beats: dict[RemoteAddr, list[str]] = {}
            for rid, remote in self._waiting.items():
                beats.setdefault(remote, []).append(self._remote[rid].request_id)
            meta.heartbeats = beats
            self._heartbeats_changed = False
        return meta

    def update_connector_output(self, output: ConnectorOutput) -> None:
        for rid in output.finished_recving:
            self._stop_heartbeat(rid)

    def request_finished(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, TransferParams | None]:
        rid = request.request_id
        params = request.kv_transfer_params
        if wants_remote_prefill(params):
            rp = self._remote.pop(rid, None)
            if rp is not None and rid not in self._claimed:  # never loaded: release the producer now
                self._meta.releases.append((RemoteAddr(rp.engine_id, rp.host, rp.port), rp.request_id))
            elif rp is not None and rp.streamed:  # a streamed load may still wait for parts: end it
                self._meta.cancels.append(rid)
            self._stop_heartbeat(rid)
            self._claimed.discard(rid)
            self._local_hits.pop(rid, None)
            return False, None
        if not wants_remote_decode(params):
            return False, None
        if rid in self._stream_next:
            return self._stream_finished(request, block_ids)
        if getattr(request.status, "name", "") not in _FINISHED_OK:
            return False, None  # aborted or failed: nobody will read these blocks
        clipped = self.clip(block_ids, request.num_computed_tokens)
        flat = sorted({b for g in clipped for b in g})
        if not flat:
            return False, None
        host, port, producer = self._endpoint()
        if producer is None:
            logger.warning("request %s asks for remote decode but this engine is not a KV producer", rid)
            return False, None
        producer.add_lease(rid, units(flat, self.num_slices) if self.num_slices > 1 else flat, self.lease_s)
        self._meta.saves[rid] = {"block_ids": flat}
        return True, make_remote_prefill_params(self.engine_id, host, port, rid, clipped, request.num_computed_tokens)

    def clip(self, block_ids: tuple[list[int], ...], num_tokens: int) -> list[list[int]]:
        """Per group: the blocks of the first `num_tokens` tokens, without null blocks,
        and for sliding-window groups only those still in the window."""
        out = []
        for layout, ids in zip(self.groups, block_ids, strict=True):
            ids = list(ids[: -(-num_tokens // layout.block_size)])
            while ids and ids[0] == 0:  # out-of-window blocks the KV cache already let go
                ids.pop(0)
            if layout.keep_blocks is not None:
                ids = ids[-layout.keep_blocks :]
            out.append(ids)
        return out

    # ------------------------------------------------------------------ streamed prefills (producer side)
    def prefill_stream_chunk(self, request) -> int | None:
        if self.stream_chunk_tokens is None or not (wants_remote_decode(request.kv_transfer_params)
                                                    and wants_stream(request.kv_transfer_params)):
            return None
        self._stream_next[request.request_id] = set()
        return self.stream_chunk_tokens

    def on_prefill_progress(self, request, block_ids) -> None:
        rid = request.request_id
        if rid in self._stream_gone or request.num_computed_tokens >= request.num_prompt_tokens:
            return  # the lease ended (nobody to publish to), or the last part goes with request_finished
        entries = self._completed(request, block_ids, final=False)
        if self._clock is not None:
            self._add_due(rid, entries)
            entries = self._take_due(rid)
        if entries:
            self._publish(rid, entries, False)

    def layer_hook(self, steps: list[tuple[Any, Any, int, bool]]) -> Callable[[int], None] | None:
        """Layer streaming, before a forward: `steps` holds (request, block ids, tokens computed after
        this step, whether it is the prompt's last step) of the step's streamed prefills. Their blocks
        this step completes are due; the callable returned, called after each model layer, publishes
        every (group, slice) whose last layer that was. None: nothing to publish in this step."""
        clock = self._clock
        if clock is None:
            return None
        rids = []
        for request, block_ids, num_tokens, final in steps:
            rid = request.request_id
            if rid in self._stream_next and rid not in self._stream_gone:
                self._add_due(rid, self._completed(request, block_ids, final, num_tokens))
                rids.append(rid)
        if not any(self._slices_due.get(rid) for rid in rids):
            return None

        def after_layer(layer: int) -> None:
            which = clock.due_after(layer)
            for rid in rids:
                if which and rid not in self._stream_gone:
                    entries = self._take_due(rid, which)
                    if entries:
                        self._publish(rid, entries, False)

        after_layer(-1)  # slices that hold no layer of their group
        return after_layer

    def _add_due(self, rid: str, entries: list[tuple[int, int, int]]) -> None:
        due = self._slices_due.setdefault(rid, {})
        for g, pos, block in entries:
            for k in range(self.num_slices):
                due.setdefault((g, k), []).append((pos, block))

    def _take_due(self, rid: str, which: list[tuple[int, int]] | None = None) -> list[tuple[int, int, int]]:
        """The due (group, position, block) entries of `which` (group, slice) pairs (None: all), as
        transfer units: (group, position * slices + slice, unit)."""
        due, n = self._slices_due.get(rid), self.num_slices
        out: list[tuple[int, int, int]] = []
        if not due:
            return out
        for g, k in list(due) if which is None else which:
            for pos, block in due.pop((g, k), ()):
                out.append((g, pos * n + k, block * n + k))
        return out

    def _publish(self, rid: str, entries: list[tuple[int, int, int]], final: bool) -> bool:
        producer = self._endpoint()[2]
        if producer is None or not producer.stream.publish(rid, entries, final):
            self._stream_gone.add(rid)
            return False
        return True

    def _completed(self, request, block_ids, final: bool, num_tokens: int | None = None) -> list[tuple[int, int, int]]:
        """(group, position, block id) completed since the last publication once `num_tokens` (default:
        those computed) are: full blocks (all, at the end), in the final window of sliding-window
        groups, state groups only at the end. Mid-prefill, a sliding-window group's block is published
        only once no later step can let it go (two blocks inside the final window's edge); the edge
        goes at the end."""
        done = self._stream_next[request.request_id]
        num_tokens = request.num_computed_tokens if num_tokens is None else num_tokens
        out: list[tuple[int, int, int]] = []
        for g, layout in enumerate(self.groups):
            if layout.final_only and not final:
                continue
            bs, ids, keep = layout.block_size, block_ids[g], layout.keep_blocks
            end = -(-request.num_prompt_tokens // bs)
            first = 0 if keep is None else max(0, end - keep + (0 if final else 2))
            upto = min(len(ids), -(-num_tokens // bs) if final else num_tokens // bs)
            for pos in range(first, upto):
                if ids[pos] != 0 and (g, pos) not in done:
                    done.add((g, pos))
                    out.append((g, pos, ids[pos]))
        return out

    def _stream_finished(self, request, block_ids) -> tuple[bool, TransferParams | None]:
        """A streamed prefill's end: the last part (or the stream's failure). The blocks stay while
        the lease holds them (a pull may be reading), and go when it ends (`finished_sending`)."""
        rid = request.request_id
        gone = rid in self._stream_gone
        host, port, producer = self._endpoint()
        if producer is None:
            self._stream_next.pop(rid)
            self._slices_due.pop(rid, None)
            return False, None
        ok = getattr(request.status, "name", "") in _FINISHED_OK
        entries = self._completed(request, block_ids, final=True) if ok else []
        if self._clock is not None:
            self._add_due(rid, entries)
            entries = self._take_due(rid) if ok else []
        self._stream_next.pop(rid)
        self._slices_due.pop(rid, None)
        if not ok or gone or not producer.stream.publish(rid, entries, True):
            if not gone:
                producer.stream.fail(rid)
            # (even when gone: a lease that ended mid-prefill may still drain a pull of these blocks)
            held = producer.leases.holds(rid)
            self._stream_gone.discard(rid)
            return held, None
        self._meta.saves[rid] = {"streamed": True}
        return True, make_stream_params(self.engine_id, host, port, rid)

    def filter_sending(self, sending: set[str]) -> set[str]:
        """Streamed prefills whose lease ended while they still run are not the engine's to free
        yet: they are noted (their blocks go when the request ends) and left out."""
        early = sending & self._stream_next.keys()
        self._stream_gone |= early
        return sending - early
