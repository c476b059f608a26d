"""Who may subscribe to a worker's KV event stream, and how many at once.

`SubscriberGate` is the ZAP handler (RFC 27) of the publisher's own ZMQ context,
served on a ROUTER socket so that an answer can wait. It admits a CURVE client
only when its public key is the deployment's client key (derived from the
secret, `pd.cluster.kv_wire.curve_keys`) and fewer than `max_subscribers` peers
are subscribed or being admitted. A refusal is answered after
`REFUSAL_DELAY_S`, so a peer that reconnects at once costs one handshake per
delay rather than one per reconnect.

Subscribers are counted from the XPUB socket's verbose subscribe / unsubscribe
messages (`on_subscription`): only a peer past the handshake can send one, and
libzmq sends the unsubscribe when that peer's connection ends.

Guarantees: the gate's socket and counters are used from one thread only (the
publisher's gate thread); a refused peer costs one deferred reply (at most
`MAX_DEFERRED` in all), released within the delay; a peer admitted but never
subscribed frees its slot after `ADMIT_WINDOW_S`.
"""
from __future__ import annotations

import collections
import hmac
import logging
import time

import zmq
from zmq.utils import z85

logger = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by RFC 27: one handler per context
ZAP_DOMAIN = b"pdkv-kv-events"
REFUSAL_DELAY_S = 1.0
ADMIT_WINDOW_S = 5.0
MAX_REQUESTS_PER_SERVE = 256
MAX_DEFERRED = 1024  # refusals waiting for their delay; past it a refusal is answered at once
LOG_EVERY_S = 60.0  # refusals are logged once a minute at most, with their count


class SubscriberGate:
    def __init__(self, ctx: zmq.Context, client_public_z85: bytes, max_subscribers: int) -> None:
        if max_subscribers < 1:
            raise ValueError(f"max_subscribers must be at least 1, got {max_subscribers}")
        self.max_subscribers = max_subscribers
        self.num_subscribers = 0
        self.num_refused = 0
        self._client_key = z85.decode(client_public_z85)
        self._admitted: collections.deque[float] = collections.deque()  # admissions not yet subscribed
        self._deferred: collections.deque[tuple[float, list[bytes]]] = collections.deque()
        self._logged_at = -LOG_EVERY_S
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)  # before any CURVE socket binds: no handshake skips the gate

    def serve(self, timeout_s: float) -> None:
        """Answers ZAP requests for up to `timeout_s` (gate thread only)."""
        now = time.monotonic()
        while self._deferred and self._deferred[0][0] <= now:
            self._send(self._deferred.popleft()[1])
        if self._deferred:
            timeout_s = min(timeout_s, max(0.0, self._deferred[0][0] - now))
        if not self._sock.poll(int(timeout_s * 1000)):
            return
        for _ in range(MAX_REQUESTS_PER_SERVE):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._answer(frames)

    def on_subscription(self, message: bytes) -> None:
        """One message read from the XPUB socket: `\\x01topic` subscribes, `\\x00topic` leaves."""
        if not message:
            return
        if message[0] == 1:
            self.num_subscribers += 1
            if self._admitted:
                self._admitted.popleft()
        elif message[0] == 0:
            self.num_subscribers = max(0, self.num_subscribers - 1)

    def close(self) -> None:
        self._sock.close(linger=0)

    # -- internals ---------------------------------------------------------
    def _num_taken(self, now: float) -> int:
        while self._admitted and now - self._admitted[0] > ADMIT_WINDOW_S:
            self._admitted.popleft()
        return self.num_subscribers + len(self._admitted)

    def _answer(self, frames: list[bytes]) -> None:
        if len(frames) < 8 or frames[1] != b"":
            return  # not a ZAP request (only libzmq reaches this inproc endpoint)
        routing_id, _, version, request_id, _domain, address, _identity, mechanism = frames[:8]
        credentials = frames[8:]
        now = time.monotonic()
        if mechanism != b"CURVE" or not credentials or not hmac.compare_digest(credentials[0], self._client_key):
            status, text = b"400", b"unknown client key"
        elif self._num_taken(now) >= self.max_subscribers:
            status, text = b"400", b"too many subscribers"
        else:
            status, text = b"200", b"OK"
        reply = [routing_id, b"", version, request_id, status, text, b"", b""]
        if status == b"200":
            self._admitted.append(now)
            self._send(reply)
            return
        self.num_refused += 1
        if now - self._logged_at >= LOG_EVERY_S:  # a peer retrying in a loop must not flood the log
            self._logged_at = now
            logger.warning("kv events: refused a subscriber from %s (%s); %d refused so far",
                           address.decode(errors="replace"), text.decode(), self.num_refused)
        if len(self._deferred) >= MAX_DEFERRED:
            self._send(reply)
            return
        self._deferred.append((now + REFUSAL_DELAY_S, reply))

    def _send(self, reply: list[bytes]) -> None:
        try:
            self._sock.send_multipart(reply, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the peer's handshake is gone: nothing to answer
            logger.debug("kv events: ZAP reply not sent: %s", exc)
