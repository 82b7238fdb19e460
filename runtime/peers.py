"""Who a gRPC client is, for per-peer limits: the key its connections and KV subscribers are counted under.

A peer is a source address: one IPv4 address, or one IPv6 /64 (a host is
handed a whole /64 and picks its addresses from it freely, so one address per
key would make an IPv6 client as many peers as it likes). An IPv4-mapped
IPv6 address is its IPv4 address. Anything else (a unix socket, a transport
that names no peer) is one peer, ``local``.

What this means for a deployment: clients behind one NAT, proxy or sidecar
share one key, and on loopback every local client is ``127.0.0.1`` unless it
binds another address of 127.0.0.0/8 (the tests do, to play several peers).
The per-peer bounds are set with that in mind (``docs/limits.md``).
"""

from __future__ import annotations

import ipaddress

LOCAL = "local"


def peer_key(peername: object) -> str:
    """The key of a transport's ``get_extra_info("peername")`` (a tuple for TCP, a path or None otherwise)."""
    if not isinstance(peername, tuple) or not peername or not isinstance(peername[0], str):
        return LOCAL
    host = peername[0].partition("%")[0]  # a scope id (fe80::1%eth0) is not part of the address
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return LOCAL
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)
