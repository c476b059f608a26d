"""The client address behind trusted proxies (pd.router.client_address): the rightmost untrusted
hop of X-Forwarded-For or RFC 7239 Forwarded, the peer's own address otherwise."""
from __future__ import annotations

import pytest

from pd.cluster.config import ConfigError, DeployConfig
from pd.router.client_address import MAX_HOPS, ClientAddress

PROXIES = ["10.0.0.0/8", "fd00::/8"]


def test_no_trusted_proxies_ignores_every_header():
    plain = ClientAddress([])
    assert not plain.enabled
    assert plain.resolve("192.0.2.9", ["198.51.100.1"]) == "192.0.2.9"


def test_x_forwarded_for_rightmost_untrusted_hop():
    xff = ClientAddress(PROXIES)
    # one proxy: the address it appended
    assert xff.resolve("10.1.1.1", ["203.0.113.5"]) == "203.0.113.5"
    # the client wrote a hop of its own: it lies left of the client's real address and is never reached
    assert xff.resolve("10.1.1.1", ["1.2.3.4, 203.0.113.5"]) == "203.0.113.5"
    # two trusted proxies, the second field of the same header continues the list
    assert xff.resolve("10.1.1.1", ["1.2.3.4, 203.0.113.5", "10.2.2.2"]) == "203.0.113.5"
    # IPv6 hops, bracketed with a port, IPv4 with a port, an IPv4-mapped trusted peer
    assert xff.resolve("fd00::1", ["2001:db8::7"]) == "2001:db8::7"
    assert xff.resolve("::ffff:10.0.0.3", ["[2001:db8::8]:4711, 10.3.3.3"]) == "2001:db8::8"
    assert xff.resolve("10.1.1.1", ["198.51.100.4:5555"]) == "198.51.100.4"
    # junk at the left end (client-written) does not count: the walk stops at the client
    assert xff.resolve("10.1.1.1", ["not an address, ;;, 203.0.113.5"]) == "203.0.113.5"


@pytest.mark.parametrize("values", [[], [""], ["   "], ["garbage"], ["203.0.113.5, garbage"], ["[2001:db8::1"],
                                    ["203.0.113.5:port"], ["unknown"]])
def test_malformed_or_missing_header_from_a_trusted_proxy_falls_back_to_the_peer(values):
    assert ClientAddress(PROXIES).resolve("10.1.1.1", values) == "10.1.1.1"


def test_untrusted_peer_headers_ignored_and_all_trusted_chain_takes_the_first():
    xff = ClientAddress(PROXIES)
    assert xff.resolve("192.0.2.9", ["203.0.113.5"]) == "192.0.2.9"
    assert xff.resolve("10.1.1.1", ["10.9.9.9, 10.8.8.8"]) == "10.9.9.9"
    assert xff.resolve("10.1.1.1", [", ".join(["10.0.0.2"] * (MAX_HOPS + 1))]) == "10.1.1.1"  # too long a walk
    assert xff.resolve(None, ["203.0.113.5"]) is None  # a Unix socket's peer: nothing to trust


def test_rfc7239_forwarded_for():
    fwd = ClientAddress(PROXIES, "forwarded")
    assert fwd.resolve("10.1.1.1", ['for=192.0.2.60;proto=http;by=10.1.1.1']) == "192.0.2.60"
    assert fwd.resolve("10.1.1.1", ['For="[2001:db8:cafe::17]:4711"']) == "2001:db8:cafe::17"
    assert fwd.resolve("10.1.1.1", ['for="x,y;z", for=203.0.113.5;by="a;b", for=10.4.4.4']) == "203.0.113.5"
    assert fwd.resolve("10.1.1.1", ["for=unknown"]) == "10.1.1.1"  # the proxy did not know: the peer
    assert fwd.resolve("10.1.1.1", ["for=_hidden"]) == "10.1.1.1"  # obfuscated
    assert fwd.resolve("10.1.1.1", ["proto=https"]) == "10.1.1.1"  # no for=
    # the header the config names, only: an X-Forwarded-For a client wrote is not read
    assert fwd.resolve("10.1.1.1", []) == "10.1.1.1"


def test_config_validates_networks():
    config = DeployConfig.from_dict({"router": {"trusted_proxies": ["10.0.0.0/8", "fd00::/8", "192.0.2.7"],
                                                "forwarded_header": "forwarded"}})
    assert config.router.trusted_proxies == ["10.0.0.0/8", "fd00::/8", "192.0.2.7"]
    assert DeployConfig.from_dict({}).router.trusted_proxies == []  # off by default
    for bad in (["10.0.0.1/8"], ["proxy.local"], ["10.0.0.0/33"], ["fd00::/129"], "10.0.0.0/8"):
        with pytest.raises(ConfigError, match="trusted_proxies"):
            DeployConfig.from_dict({"router": {"trusted_proxies": bad}})
    with pytest.raises(ConfigError, match="forwarded_header"):
        DeployConfig.from_dict({"router": {"forwarded_header": "x-real-ip"}})
