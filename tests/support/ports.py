"""TCP ports for the tests: one a test's server will bind, and ones nobody listens on.

Both come from outside the kernel's ephemeral range, which is where every outgoing
connection's local port comes from: a port the kernel picked (bind to 0) and the test released
could meanwhile become the local end of any connection on the host, the other pytest
process's included. CI lost a vLLM start ("Address already in use") and a simulated fleet's
start to that; a "closed" port taken that way would answer, or refuse, at random.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_port(span: int = 0) -> int:
    """A TCP port free now and outside the ephemeral range, for a server that binds it after
    it is picked (vLLM binds its NIXL side channel a minute into its start); only a process
    that binds it by number can take it meanwhile. With `span`, the port `span` above it is
    free and outside the range too."""
    low, high = _ephemeral_range()
    spans = [(p, q - span) for p, q in ((10_000, low), (high + 1, 65_536)) if q - span - p > 1000]
    rng = random.Random()
    for _ in range(200):
        start, end = rng.choice(spans)
        port = rng.randrange(start, end)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, socket.socket() as t:
            try:
                s.bind(("0.0.0.0", port))
                if span:
                    t.bind(("0.0.0.0", port + span))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port outside the ephemeral range")


def closed_ports(n: int) -> list[int]:
    """`n` distinct ports nobody listens on (and no outgoing connection lands on)."""
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    return sorted(ports)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
