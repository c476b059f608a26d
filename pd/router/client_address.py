"""Which address a request comes from, behind trusted proxies (`router.trusted_proxies`).

The auth throttle (pd.router.auth_throttle) counts failures per client address, and the router's
log lines name it. Without trusted proxies that address is the TCP peer's, and forwarding headers
are ignored: anyone can write them. With `router.trusted_proxies` (CIDRs) set, a request whose
peer lies in one of those networks is read through the proxy's header (`router.forwarded_header`:
`X-Forwarded-For`, or RFC 7239 `Forwarded`'s `for=`):

- the chain is the header's hops, left to right, then the peer; it is walked from the right,
  skipping trusted hops, and the first untrusted hop is the client. Each proxy appends the
  address it saw, so the hops right of the client were written by proxies we trust, and
  whatever a client wrote itself lies left of its own address and is never reached;
- only the hops walked are parsed: junk a client put at the left end neither counts nor makes
  the header "malformed" (else one client could push everyone behind the proxy onto the
  proxy's one bucket);
- a hop walked that is not an address (malformed, `unknown`, an obfuscated RFC 7239 name), a
  missing or empty header, or more than `MAX_HOPS` trusted hops: the peer's address is used;
- every hop trusted (a request sent by a trusted proxy itself, through others): the leftmost;
- a peer outside the trusted networks: its own address, whatever headers it sent;
- one header kind only, named in the config: with both read, a client could write the kind the
  proxy does not, and choose its own address.
"""
from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Sequence

logger = logging.getLogger(__name__)

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
HEADERS = {"x-forwarded-for": "X-Forwarded-For", "forwarded": "Forwarded"}
MAX_HOPS = 64  # trusted hops walked before giving up: no real chain of proxies is this long


class ClientAddress:
    """Resolves a request's client address (module docstring). Pure: no state between requests."""

    def __init__(self, trusted: Iterable[str], header: str = "x-forwarded-for") -> None:
        """`trusted`: CIDRs (validated by the config); `header`: a key of `HEADERS`."""
        self._trusted: tuple[IPNetwork, ...] = tuple(ipaddress.ip_network(n, strict=False) for n in trusted)
        self._header = HEADERS[header]
        self._rfc7239 = header == "forwarded"

    @property
    def enabled(self) -> bool:
        return bool(self._trusted)

    def resolve(self, peer: str | None, values: Sequence[str]) -> str | None:
        """The client's address given the TCP `peer` and every value of the configured header, in order."""
        peer_ip = _address(peer)
        if not self._trusted or peer_ip is None or not self._is_trusted(peer_ip):
            return peer
        hops = _forwarded_for(values) if self._rfc7239 else _x_forwarded_for(values)
        if not hops:
            return peer
        walked = 0
        for hop in reversed(hops):
            ip = _address(hop)
            if ip is None:
                logger.debug("forwarded hop %.64r from trusted proxy %s is not an address: using the peer", hop, peer)
                return peer
            if not self._is_trusted(ip):
                return str(ip)
            walked += 1
            if walked >= MAX_HOPS:
                return peer
        return str(_address(hops[0]))  # every hop trusted: the first proxy of the chain sent it

    def of(self, request) -> str | None:
        """`resolve` for an aiohttp request."""
        if not self._trusted:
            return request.remote
        return self.resolve(request.remote, request.headers.getall(self._header, []))

    def _is_trusted(self, ip: IPAddress) -> bool:
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip in network for network in self._trusted)


def _address(text: str | None) -> IPAddress | None:
    """`text` as an IP address: bare, `[v6]`, `[v6]:port`, `v4:port`, with an IPv6 zone dropped; else None."""
    if not text:
        return None
    text = text.strip()
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or (end + 1 < len(text) and not (text[end + 1] == ":" and text[end + 2:].isdigit())):
            return None
        text = text[1:end]
    elif text.count(":") == 1:  # IPv4 with a port (an IPv6 address has two colons or more)
        host, _, port = text.partition(":")
        if not port.isdigit():
            return None
        text = host
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None


def _x_forwarded_for(values: Sequence[str]) -> list[str]:
    """The hops of every `X-Forwarded-For` field, in order (several fields read as one list)."""
    return [hop.strip() for value in values for hop in value.split(",")]


def _forwarded_for(values: Sequence[str]) -> list[str]:
    """The `for=` of every element of every `Forwarded` field, in order; an element without one
    gives '' (not an address). Quoted strings may hold commas, semicolons and escapes."""
    hops = []
    for value in values:
        for element in _split(value, ","):
            found = ""
            for pair in _split(element, ";"):
                name, eq, raw = pair.partition("=")
                if eq and name.strip().lower() == "for":
                    found = _unquote(raw.strip())
            hops.append(found)
    return hops


def _split(text: str, sep: str) -> list[str]:
    """`text` split at `sep` outside double quotes."""
    parts: list[str] = []
    current: list[str] = []
    quoted = escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif quoted and ch == "\\":
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif ch == sep and not quoted:
            parts.append("".join(current))
            current = []
            continue
        current.append(ch)
    parts.append("".join(current))
    return parts


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] == '"':
        out: list[str] = []
        inner, escaped = value[1:-1], False
        for ch in inner:
            if escaped or ch != "\\":
                out.append(ch)
                escaped = False
            else:
                escaped = True
        return "".join(out)
    return value
