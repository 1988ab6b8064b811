"""A real DNS server for discovery tests: `dnsmasq` (Debian's dnsmasq-base, installed by
`make test`) on a loopback UDP port, authoritative for `.test`, serving the records a test
writes. `serve(records)` (re)starts it on the same port with new records: dnsmasq reads SRV
records only at start.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.ports import free_port

DNSMASQ = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"


class Dnsmasq:
    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.nameserver = f"127.0.0.1:{self.port}"
        self._conf = workdir / "dnsmasq.conf"
        self._proc: subprocess.Popen[bytes] | None = None

    def serve(self, srv: dict[str, list[tuple[str, int]]], hosts: dict[str, list[str]]) -> None:
        """`srv`: name -> [(target, port)]; `hosts`: name -> [addresses]. Restarts."""
        lines = ["no-resolv", "no-hosts", "local=/test/", "bind-interfaces"]
        lines += ["listen-address=127.0.0.1", f"port={self.port}", "user=root"]
        for name, targets in srv.items():
            lines += [f"srv-host={name},{target},{port},0,10" for target, port in targets]
        for name, addresses in hosts.items():
            lines += [f"host-record={name},{address}" for address in addresses]
        self._conf.write_text("\n".join(lines) + "\n")
        self.stop()
        self._proc = subprocess.Popen(
            [DNSMASQ, "--keep-in-foreground", f"--conf-file={self._conf}", "--pid-file="],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self._wait_answering()

    def _wait_answering(self, timeout_s: float = 10.0) -> None:
        """Until a query for a `.test` name gets an answer (NXDOMAIN is one)."""
        query = bytes.fromhex("abcd01000001000000000000") + b"\x05ready\x04test\x00\x00\x01\x00\x01"
        deadline = time.monotonic() + timeout_s
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(0.1)
            while True:
                assert self._proc is not None
                if self._proc.poll() is not None:
                    err = self._proc.stderr.read().decode() if self._proc.stderr else ""
                    raise AssertionError(f"dnsmasq exited: {err}")
                s.sendto(query, ("127.0.0.1", self.port))
                try:
                    if s.recv(512)[:2] == b"\xab\xcd":
                        return
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError("dnsmasq did not answer in time")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(5)
        self._proc = None


@contextmanager
def dnsmasq(workdir: Path) -> Iterator[Dnsmasq]:
    server = Dnsmasq(workdir)
    try:
        yield server
    finally:
        server.stop()
