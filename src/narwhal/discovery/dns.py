"""Engines from DNS: SRV records (a Kubernetes headless Service's per-pod host names and
ports), falling back to A/AAAA records of the name itself.

Each SRV target is one engine whose id is its host name, so a rescheduled pod keeps its
identity and shows up at its new address (a relocation); its port is the one that serves HTTP
(`srv.engines`: the source's `port`, or the target's only port). Without SRV records, each
address of the name is one engine on the source's `port` (8000 when not set), named after the
address. A name that does not exist, or has no records, is an empty answer (the engines
vanished); a timeout, a server failure or an ambiguous answer is a `DiscoveryFailed`, which
changes nothing.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Sequence

import dns.asyncresolver
import dns.exception
import dns.resolver
from pydantic import ValidationError

from narwhal.config import DnsSource, EngineConfig
from narwhal.discovery import srv

log = logging.getLogger("narwhal.discovery")

ADDRESS_PORT = 8000
"""The engines' port for A/AAAA answers when the source names none (vLLM's default)."""


class DiscoveryFailed(Exception):
    """A source could not be read this round: nothing it manages changes."""


def resolver(nameservers: Sequence[str], timeout_s: float) -> dns.asyncresolver.Resolver:
    """A resolver of `nameservers` ("ip" or "ip:port"), or of the system's when empty; no
    cache, so a changed record is seen at the next round."""
    r = dns.asyncresolver.Resolver(configure=not nameservers)
    if nameservers:
        r.nameservers = [_split(s)[0] for s in nameservers]
        r.nameserver_ports = {host: port for host, port in map(_split, nameservers)}
    r.timeout = r.lifetime = timeout_s
    r.cache = None
    return r


def _split(server: str) -> tuple[str, int]:
    if server.count(":") == 1:
        host, port = server.split(":")
        return host, int(port)
    if server.startswith("[") and "]:" in server:
        host, port = server[1:].split("]:")
        return host, int(port)
    return server.strip("[]"), 53


async def find(source: DnsSource, r: dns.asyncresolver.Resolver) -> list[EngineConfig]:
    """The engines `source` names now."""
    records = await _srv(r, source.name)
    if records is not None:
        try:
            targets = srv.engines(records, source.port)
        except srv.Ambiguous as exc:
            raise DiscoveryFailed(f"{source.name}: {exc}") from None
        found = []
        for host, port in targets:
            addresses = await _addresses(r, host)
            if not addresses:
                log.info("discovery: %s: SRV target %s has no address yet", source.name, host)
                continue
            engine = _engine(source, host, addresses[0], port)
            if engine is not None:
                found.append(engine)
        return found
    port = ADDRESS_PORT if source.port is None else source.port
    engines = (_engine(source, _address_id(a), a, port) for a in await _addresses(r, source.name))
    return [e for e in engines if e is not None]


async def _srv(r: dns.asyncresolver.Resolver, name: str) -> list[srv.Record] | None:
    """The name's SRV records; None when it has none."""
    try:
        answer = await r.resolve(name, "SRV")
    except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
        return None
    except dns.exception.DNSException as exc:
        raise DiscoveryFailed(f"{name} SRV: {exc}") from None
    return [
        srv.Record(rr.target.to_text(omit_final_dot=True), rr.port, rr.priority, rr.weight)
        for rr in answer
    ]


async def _addresses(r: dns.asyncresolver.Resolver, name: str) -> list[str]:
    """The name's IPv4 then IPv6 addresses (none: the name does not exist or has none)."""
    found: list[str] = []
    for kind in ("A", "AAAA"):
        try:
            answer = await r.resolve(name, kind)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            continue
        except dns.exception.DNSException as exc:
            raise DiscoveryFailed(f"{name} {kind}: {exc}") from None
        found.extend(sorted(rr.address for rr in answer))
    return found


def _address_id(address: str) -> str:
    """An engine id for an address found without a host name (`10.0.0.7`, `fd00-1`)."""
    return address.replace(":", "-")


def _engine(source: DnsSource, engine_id: str, address: str, port: int) -> EngineConfig | None:
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    try:
        return EngineConfig(
            id=engine_id,
            url=f"{source.scheme}://{host}:{port}",
            role=source.role,
            kv_role=source.kv_role,
            api=source.api,
            api_key_env=source.api_key_env,
            slot_save_path=source.slot_save_path,
        )
    except ValidationError as exc:
        log.warning("discovery: %s: %s is not a usable engine: %s", source.name, engine_id, exc)
        return None
