"""The per-peer connection cap counts IPv6 clients by /64, IPv4 clients by address."""
from __future__ import annotations

import asyncio
import socket

import pytest

from pd.cluster.http_guard import peer_key


@pytest.mark.parametrize("peername, key", [
    (("127.0.0.1", 5000), "127.0.0.1"),
    (("2001:db8:1:2:aaaa::1", 5000, 0, 0), "2001:db8:1:2::/64"),
    (("2001:db8:1:2:ffff:ffff:ffff:ffff", 1, 0, 0), "2001:db8:1:2::/64"),
    (("2001:db8:1:3::1", 1, 0, 0), "2001:db8:1:3::/64"),
    (("::ffff:10.0.0.7", 1, 0, 0), "10.0.0.7"),
    (("fe80::1%lo", 1, 0, 1), "fe80::/64"),
    ("/run/pdkv.sock", "/run/pdkv.sock"),
])
def test_peer_key(peername, key):
    assert peer_key(peername) == key


def test_two_addresses_of_one_64_share_a_key_and_another_64_does_not():
    assert peer_key(("2001:db8::1", 1)) == peer_key(("2001:db8::ffff:1", 2)) != peer_key(("2001:db8:0:1::1", 3))


def test_a_real_ipv6_loopback_connection_is_keyed_by_its_64():
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")

    async def run() -> str:
        seen: list[object] = []

        async def on_client(reader, writer):
            seen.append(writer.get_extra_info("peername"))
            writer.close()

        try:
            server = await asyncio.start_server(on_client, "::1", 0)
        except OSError as exc:
            pytest.skip(f"IPv6 loopback unavailable: {exc}")
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.wait_for(asyncio.open_connection("::1", port), timeout=5)
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.01)
        writer.close()
        server.close()
        await server.wait_closed()
        return peer_key(seen[0])

    assert asyncio.run(run()) == "::/64"
