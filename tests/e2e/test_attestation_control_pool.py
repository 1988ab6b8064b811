"""TLS attestation runs in the control pool (spec: readmission uses the reserved control pool,
bounded by `engine.control_connections`).

A real TLS listener counts the connections it accepts; with `control_connections: 1` and that
one slot held, the attestation step must not open a socket, and it fails saying why.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from narwhal.config import AttestationConfig, EngineConfig, Role
from narwhal.control.attestation import Outcome, attest
from narwhal.engine.transport import EngineClient
from tests.e2e.test_readmission_support import Pki
from tests.support.poll import eventually


@dataclass
class TlsListener:
    url: str
    ca_file: str
    accepted: int = 0


@pytest.fixture
async def listener(tmp_path: Path) -> AsyncIterator[TlsListener]:
    pki = Pki(tmp_path / "pki")
    ca = pki.ca("ca")
    cert, key = pki.issue("ca", "p0", ["p0"], ["127.0.0.1"])
    state = TlsListener("", str(ca))

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state.accepted += 1
        writer.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0, ssl=Pki.server_context(cert, key))
    state.url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server:
        yield state


async def test_tls_attestation_waits_for_a_control_slot_and_fails_without_one(
    listener: TlsListener,
) -> None:
    engine = EngineConfig(id="p0", url=listener.url, role=Role.PREFILL)
    config = AttestationConfig(kind="tls", ca_file=listener.ca_file, timeout_s=0.5)
    client = EngineClient(data_limit=4, control_limit=1)
    await client.start()
    try:
        async with client.control_slot(1.0):  # the only control connection is taken
            result = await attest(config, engine, client)
            assert result.outcome is Outcome.FAILED, result
            assert "not attempted" in result.reason and "no control connection" in result.reason
            assert listener.accepted == 0  # the engine was never touched

        result = await attest(config, engine, client)  # the slot is free again
        assert result.outcome is Outcome.PASSED, result
        await eventually(lambda: listener.accepted == 1, what="one TLS connection")
        assert client.control_in_use == 0  # the handshake's slot was given back
    finally:
        await client.close()
