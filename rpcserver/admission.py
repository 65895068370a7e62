"""Who may connect, how many at once, and how long a half-sent request may hang.

All three are decided by the server before or around the protocol: a refused connection is closed
before any of its bytes is read, so a llama.cpp client (which knows nothing of our extensions) is
subject to them exactly as our own orchestrator is. docs/security.md says what they protect against.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_allow(text: str) -> tuple[Network, ...]:
    """`10.0.0.0/8,127.0.0.1,::1` as networks (an address is a network of one); ValueError on a bad item."""
    networks = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ValueError(f"not an IP address or CIDR network: {item!r}") from None
    if not networks:
        raise ValueError("an empty allow-list would refuse every client")
    return tuple(networks)


@dataclass(frozen=True)
class Admission:
    allow: tuple[Network, ...] | None = None  # None: every address
    max_connections: int | None = None  # None: no limit
    idle_timeout: float | None = None  # seconds a started request (or a missing HELLO) may stall

    def allowed(self, host: str) -> bool:
        if self.allow is None:
            return True
        try:
            address = ipaddress.ip_address(host.split("%", 1)[0])  # an IPv6 scope id is not ours to match
        except ValueError:
            return False  # not an IP peer (a Unix socket has none): nothing on the list names it
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # an IPv4 client of a dual-stack socket is that IPv4 address
        return any(address.version == net.version and address in net for net in self.allow)

    def full(self, n_connections: int) -> bool:
        return self.max_connections is not None and n_connections >= self.max_connections
