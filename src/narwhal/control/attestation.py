"""Attestation verifiers for readmission: `none`, `tls` and `command`.

`none` is reported as not configured, never as passed. `tls` requires an HTTPS engine whose
certificate chains to the configured CA and names the engine id; its handshake is a control
connection, so it runs in a slot of the control pool (`engine.control_connections`), and a pool
with no slot free in time fails the step without touching the engine. `command` runs an operator
program with the engine's id and URL; exit status 0 passes, and a JSON `{"reason": ...}` on
stdout says why.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from dataclasses import dataclass
from enum import StrEnum
from urllib.parse import urlsplit

from narwhal.config import AttestationConfig, EngineConfig
from narwhal.engine.transport import ControlPoolBusy, EngineClient, PoolKind


class Outcome(StrEnum):
    PASSED = "passed"
    FAILED = "failed"
    NOT_CONFIGURED = "not_configured"


@dataclass(frozen=True, slots=True)
class Attestation:
    outcome: Outcome
    reason: str


async def attest(
    config: AttestationConfig, engine: EngineConfig, client: EngineClient
) -> Attestation:
    """Attest `engine`; `client` lends the control-pool slot a TLS handshake runs in."""
    if config.kind == "tls":
        return await _tls(config, engine, client)
    if config.kind == "command":
        return await _command(config, engine)
    return Attestation(Outcome.NOT_CONFIGURED, "attestation not configured")


async def _tls(
    config: AttestationConfig, engine: EngineConfig, client: EngineClient
) -> Attestation:
    parts = urlsplit(engine.url)
    if parts.scheme != "https":
        return Attestation(Outcome.FAILED, "tls attestation needs an https engine url")
    assert config.ca_file is not None and parts.hostname is not None
    try:
        context = ssl.create_default_context(cafile=config.ca_file)
    except (OSError, ssl.SSLError) as exc:
        return Attestation(Outcome.FAILED, f"cannot load CA {config.ca_file}: {exc}")
    try:
        # One deadline for waiting for the slot and the handshake, as for any control request.
        async with client.deadline(PoolKind.CONTROL, config.timeout_s):
            _, writer = await asyncio.open_connection(
                parts.hostname, parts.port or 443, ssl=context, server_hostname=engine.id
            )
            writer.close()
    except ControlPoolBusy as exc:
        return Attestation(Outcome.FAILED, f"tls attestation not attempted: {exc.detail}")
    except ssl.SSLCertVerificationError as exc:
        return Attestation(Outcome.FAILED, f"certificate rejected: {exc.verify_message}")
    except (OSError, ssl.SSLError, TimeoutError) as exc:
        return Attestation(Outcome.FAILED, f"tls handshake failed: {type(exc).__name__}: {exc}")
    return Attestation(Outcome.PASSED, f"certificate chains to the CA and names {engine.id}")


async def _command(config: AttestationConfig, engine: EngineConfig) -> Attestation:
    assert config.command
    try:
        proc = await asyncio.create_subprocess_exec(
            *config.command,
            engine.id,
            engine.url,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
    except OSError as exc:
        return Attestation(Outcome.FAILED, f"cannot run {config.command[0]}: {exc}")
    try:
        async with asyncio.timeout(config.timeout_s):
            out, _ = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return Attestation(
            Outcome.FAILED, f"attestation command timed out after {config.timeout_s}s"
        )
    try:
        reason = str(json.loads(out).get("reason", ""))
    except (ValueError, AttributeError):
        reason = out.decode(errors="replace").strip()[:200]
    if proc.returncode == 0:
        return Attestation(Outcome.PASSED, reason or "command approved")
    return Attestation(Outcome.FAILED, reason or f"command exited {proc.returncode}")
