"""The gang data path: a pull between a prefill gang and a decode gang, every rank moving its own
KV heads (the path a stream takes when either side has TP > 1).

Rank 0s keep everything they do today: the handshake, the session, leases, heartbeats, DONE and
the stream's PULL (canonical block ids). What changes is the answer to a PULL: the producer's
rank 0 pins the lease as for any pull, grants a fresh ticket for the pull's blocks to its P
ranks (`GangSide.grant`) and answers `TICKET`; the consumer's rank 0 has every D rank pull its
heads straight from the P ranks holding them (`GangSide.load`: tcp, or the P ranks' pools mapped
when both gangs share the host), and CREDITs only when every D rank answered; the producer then
revokes the ticket and unpins. The ATTACHED answer names the P ranks (their heads, data endpoint
and pool), so a D rank knows whom to read. Checksums are per rank and per block of the packed
heads; a block is good only when every D rank's heads of it landed and matched.
"""
from __future__ import annotations

import logging
import secrets

from connectors.zmq.control import framing, wire
from connectors.zmq.control import handshake as hs
from connectors.zmq.control.wire import MalformedMessage, MsgType
from connectors.zmq.gang import agent_wire
from connectors.zmq.gang.gang_side import GangSide
from connectors.zmq.paths.base import PathName, PathReceiver, PathServer, PathUnavailable, PullPart, Refused
from connectors.zmq.paths.choice import DataPath, PathChoice
from connectors.zmq.paths.page_access import PageAccess
from connectors.zmq.paths.shm_mapped import FINAL_CREDIT, await_credit
from connectors.zmq.paths.tcp import NO_SHM

logger = logging.getLogger(__name__)


def gang_choice(gang: GangSide | None, welcome: dict, data_path: DataPath) -> PathChoice | None:
    """The consumer's path to a producer: `gang` when either side is a TP gang (its WELCOME says `tp`,
    or ours is > 1), else None (the plain paths). The pages on the wire are canonical, so only every
    rank moving its own heads fills them."""
    p_tp = welcome.get("tp", 1)
    d_tp = gang.tp if gang is not None else 1
    if (type(p_tp) is not int or p_tp <= 1) and d_tp <= 1:
        return None
    if gang is not None:
        gang.shm_ok = data_path in (DataPath.AUTO, DataPath.SHM)
    # two streams: the next pull's ticket is on its way while the ranks land this one
    return PathChoice(PathName.GANG, 2, f"P TP {p_tp}, D TP {d_tp}: every rank moves its own KV heads")


class GangServer(PathServer):
    """Producer half: a ticket per pull; the P ranks serve the heads, this stream only the ticket."""

    name = PathName.GANG
    gang: GangSide | None = None  # set by the data stream before `attached`

    @property
    def needs_digests(self) -> bool:
        return False  # every P rank checksums the heads it serves

    def attached(self) -> dict:
        if self.gang is None:
            raise PathUnavailable("this producer has no gang")
        return {**NO_SHM, "gang": self.gang.sources(), "host_id": hs.local_host_id(),
                "gang_shm": self.settings.offer_shm}

    def serve(self, reader: framing.FrameReader, xfer: int, block_ids: list[int], digests: list[int]) -> None:
        assert self.gang is not None  # (attached)
        ticket = secrets.token_bytes(16)
        self.gang.grant(ticket, block_ids)
        try:
            framing.send_frame(self.conn, wire.encode(MsgType.TICKET, xfer=xfer, ticket=ticket))
            # the lease stays pinned until every D rank read its heads (the consumer's credit)
            await_credit(reader, [True, False], self.gang.load_timeout_s + self.settings.io_timeout_s)
        finally:
            self.gang.revoke(ticket)


class GangReceiver(PathReceiver):
    """Consumer half: every D rank pulls its heads; the part ends when all of them answered."""

    name = PathName.GANG
    gang: GangSide | None = None  # set by the pull stream before `open`
    spins_in_reads = True  # waits for the ticket itself
    _sources: list[dict] | None = None
    _inner = "tcp"

    def open(self, attached: dict) -> None:
        if self.gang is None:
            raise PathUnavailable("this consumer has no gang")
        sources = attached.get("gang")
        if not isinstance(sources, list) or not sources:
            raise PathUnavailable("the producer named no ranks (not a gang-capable producer?)")
        try:
            self._sources = agent_wire.sources_of({"sources": sources})
        except MalformedMessage as e:
            raise ValueError(f"bad rank list from the producer: {e}") from e
        same_host = attached.get("host_id") == hs.local_host_id()
        mappable = all(s["shm"] for s in self._sources) and attached.get("gang_shm") is True
        self._inner = "shm" if same_host and mappable and self.gang.shm_ok and self.pool.device.type == "cpu" \
            else "tcp"
        logger.info("KV gang path: %d P rank(s) -> %d D rank(s) over %s", len(self._sources), self.gang.tp,
                    self._inner)

    def receive(self, part: PullPart, access: PageAccess) -> None:
        assert self.gang is not None and self._sources is not None  # (opened)
        msg_type, msg = framing.recv_frame(self.conn, max_bytes=1024)
        if msg_type is MsgType.ERROR:
            raise Refused(msg["reason"])
        if msg_type is not MsgType.TICKET or msg["xfer"] != part.xfer:
            raise MalformedMessage(f"expected the ticket of pull {part.xfer}, got {msg_type.value}")
        self.owed_credit = FINAL_CREDIT  # unpins the producer's lease, whatever happens below
        result = self.gang.load(msg["ticket"], self._sources, part.src_block_ids, part.dst_block_ids, self._inner)
        if not result.ok:
            part.bad_block_ids.extend(result.bad or part.dst_block_ids)
            part.cause = result.cause
