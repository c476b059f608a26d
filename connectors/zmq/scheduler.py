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
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any
from collections.abc import Callable

from connectors.base import KV_TRACE_CONTEXT_KEY, ConnectorMetadata, ConnectorOutput, KVConnectorScheduler
from connectors.zmq.loads import RemoteAddr
from connectors.params import (InvalidKVParams, RemotePrefill, make_remote_prefill_params,
                               parse_remote_prefill, valid_trace_context, wants_remote_decode,
                               wants_remote_prefill)

logger = logging.getLogger(__name__)

_FINISHED_OK = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """What the scheduler half needs to know about one KV cache group."""

    block_size: int
    keep_blocks: int | None  # None: every block matters; else only the last `keep_blocks`

    @classmethod
    def from_spec(cls, spec: Any) -> GroupLayout:
        window = getattr(spec, "sliding_window", None)
        if window:
            return cls(spec.block_size, -(-window // spec.block_size) + 1)
        if type(spec).__name__ == "MambaSpec":
            return cls(spec.block_size, 1)  # the state lives in the last block
        return cls(spec.block_size, None)


@dataclasses.dataclass
class ZmqConnectorMetadata(ConnectorMetadata):
    """Per-step orders. `loads[rid]` = {remote fields, "src", "dst", "invalid"}."""

    releases: list[tuple[RemoteAddr, str]] = dataclasses.field(default_factory=list)
    heartbeats: dict[RemoteAddr, list[str]] | None = None  # None: unchanged since the last step


class ZmqConnectorScheduler(KVConnectorScheduler):
    def __init__(self, engine_id: str, groups: tuple[GroupLayout, ...], lease_s: float,
                 endpoint: Callable[[], tuple[str, int, Any]]):
        """`endpoint()` -> (advertised host, side-channel port, producer or None)."""
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

    # ------------------------------------------------------------------ decode side
    def on_new_request(self, request) -> None:
        """Optional hook at add_request: start heartbeats before the request reaches the queue head."""
        self._remote_of(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        rp = self._remote_of(request)
        if rp is None or request.request_id in self._claimed:
            return 0, False
        self._local_hits[request.request_id] = num_computed_tokens
        count = min(rp.num_tokens, request.num_prompt_tokens) - num_computed_tokens
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
        src, dst, invalid = self.plan(rp, blocks.get_block_ids(), local, local + num_external_tokens)
        self._meta.loads[rid] = {
            "remote_engine_id": rp.engine_id, "remote_host": rp.host, "remote_port": rp.port,
            "remote_request_id": rp.request_id, "src": src, "dst": dst, "invalid": invalid,
            "trace_context": valid_trace_context((request.kv_transfer_params or {}).get(KV_TRACE_CONTEXT_KEY)),
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

    def request_finished(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        rid = request.request_id
        params = request.kv_transfer_params
        if wants_remote_prefill(params):
            rp = self._remote.pop(rid, None)
            if rp is not None and rid not in self._claimed:  # never loaded: release the producer now
                self._meta.releases.append((RemoteAddr(rp.engine_id, rp.host, rp.port), rp.request_id))
            self._stop_heartbeat(rid)
            self._claimed.discard(rid)
            self._local_hits.pop(rid, None)
            return False, None
        if not wants_remote_decode(params):
            return False, None
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
        producer.add_lease(rid, flat, self.lease_s)
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
