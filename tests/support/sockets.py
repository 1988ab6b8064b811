"""This process's client sockets to given ports, read from /proc: what a test counts to check
a connection bound (idle keep-alive sockets included)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator


def client_ends(ports: set[int]) -> Iterator[socket.socket]:
    """This process's connected TCP sockets whose peer is one of `ports`: the client ends of
    connections to those servers, idle keep-alive ones included (the servers' own ends have
    ephemeral peers). Each is a duplicate, closed once the next one is asked for."""
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            dup = os.dup(int(name))
        except OSError:
            continue
        with socket.socket(fileno=dup) as sock:
            if sock.family is not socket.AF_INET or sock.type is not socket.SOCK_STREAM:
                continue
            try:
                peer = sock.getpeername()
            except OSError:
                continue
            if peer[1] in ports:
                yield sock


def client_sockets(ports: set[int]) -> int:
    return sum(1 for _ in client_ends(ports))


def accepted_connections(ports: set[int]) -> int:
    """Established connections whose server end listens on one of `ports`, in any process of
    this network namespace (read from /proc/net/tcp): what a router's worker processes hold
    open to those servers, idle keep-alive sockets included."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            fd = os.open(table, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:  # one read: the kernel walks its table once, so the count is near a snapshot
            lines = os.read(fd, 1 << 22).decode().splitlines()[1:]
        finally:
            os.close(fd)
        for line in lines:
            fields = line.split()
            local, state = fields[1], fields[3]
            if state == "01" and int(local.rsplit(":", 1)[1], 16) in ports:
                count += 1
    return count
