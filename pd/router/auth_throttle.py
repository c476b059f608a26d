"""Failed authentications back off per client address (`router.auth_throttle`).

Each address has a leaky bucket of failures: a failed authentication adds one, and
`per_s` drain from it every second. While the bucket has room (fewer than `burst`), the
address's key is checked; once it is full, every request from the address that needs a key
waits: 429 with `Retry-After` (whole seconds until the bucket has room again), and its key is
not looked at. So a guesser gets `burst` tries in a row and then `per_s` a second, however
fast it sends.

Guarantees:
- a right key from a throttled address waits like a wrong one, unless it is strong (128+
  estimated bits): pd.router.tenancy compares a strong key first and lets it through, since
  200 against 429 for a weak key would tell the guesser which guess was right, while a
  strong key cannot be guessed at any rate;
- a success never empties the bucket: a client holding one valid API key cannot reset the
  count of its guesses at the admin key;
- refusals while throttled add nothing (only checked keys count), so a client that honours
  `Retry-After` is let in at once;
- IPv6 addresses count per /64 (one host usually holds a whole /64), IPv4 per address;
- memory is bounded: at most `max_addresses` buckets, the least recently failed dropped first,
  drained ones dropped when seen. An attacker with more addresses than that can make the
  router forget some; each forgotten address still starts over at `burst` tries, no more.

The address is the client's as pd.router.client_address resolves it: behind a proxy named in
`router.trusted_proxies`, the forwarded one. Behind a proxy not named there every client shares
the proxy's address: one guesser then delays everyone behind it whose key is weak (never more
than `burst / per_s` seconds after it stops).
"""
from __future__ import annotations

import dataclasses
import ipaddress
import math
import time
from collections import OrderedDict
from collections.abc import Callable

from pd.cluster.router_config import AuthThrottleSection


@dataclasses.dataclass
class _Bucket:
    level: float
    at: float


class AuthThrottle:
    """Per-address failure buckets (module docstring). Not thread-safe: the router's event loop owns it."""

    def __init__(self, settings: AuthThrottleSection, clock: Callable[[], float] = time.monotonic) -> None:
        self._burst = settings.burst
        self._per_s = settings.per_s
        self._max_addresses = settings.max_addresses
        self._clock = clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()  # least recently failed first

    def __len__(self) -> int:
        return len(self._buckets)

    def retry_after_s(self, address: str | None) -> int | None:
        """None when `address` may have its key checked now; else the whole seconds it must wait."""
        key = _group(address)
        bucket = self._drained(key)
        if bucket is None or bucket.level <= self._burst - 1:
            return None
        return max(1, math.ceil((bucket.level - (self._burst - 1)) / self._per_s))

    def record_failure(self, address: str | None) -> None:
        """A key from `address` was checked and was wrong."""
        key = _group(address)
        bucket = self._drained(key) or _Bucket(0.0, self._clock())
        bucket.level += 1.0
        self._buckets[key] = bucket
        self._buckets.move_to_end(key)
        while len(self._buckets) > self._max_addresses:
            self._buckets.popitem(last=False)

    def _drained(self, key: str) -> _Bucket | None:
        bucket = self._buckets.get(key)
        if bucket is None:
            return None
        now = self._clock()
        bucket.level = max(0.0, bucket.level - (now - bucket.at) * self._per_s)
        bucket.at = now
        if bucket.level == 0.0:
            del self._buckets[key]
            return None
        return bucket


def _group(address: str | None) -> str:
    """The bucket an address counts in: itself (IPv4, or not an IP at all: a Unix socket's peer is
    ""), or its /64 (IPv6)."""
    if not address:
        return ""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # a link-local address may carry its zone
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is None:
        return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))
    return str(ip.ipv4_mapped or ip) if isinstance(ip, ipaddress.IPv6Address) else str(ip)
