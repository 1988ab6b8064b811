"""Which SRV records are engines: one per target (a pod), on the port that serves HTTP.

A Kubernetes Service that exposes several ports (vLLM's HTTP and its NIXL side channel)
answers SRV for every one of them under its plain name, so one pod is several records. Kept:
the records on the source's `port` when it names one; otherwise each target's only port. A
target with several ports and no `port` to choose between them is ambiguous, and the answer
is refused rather than guessed: an engine would get the side channel as its URL, or flip
between the two from round to round. The `_<port-name>._tcp.<service>` name of a named
Service port (`_http._tcp.vllm-decode...`) has one record per pod and needs no `port`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Record:
    """One SRV record: its target host name, port, priority and weight."""

    target: str
    port: int
    priority: int = 0
    weight: int = 0


class Ambiguous(ValueError):
    """The records do not say which port serves HTTP: nothing is taken from them."""


def engines(records: Sequence[Record], port: int | None) -> list[tuple[str, int]]:
    """(target, port) of each engine the records name, one per target, in priority order
    (lowest priority, then highest weight, then name). Raises Ambiguous when a target has
    several ports and `port` is None, or when no record is on `port`."""
    ordered = sorted(records, key=lambda r: (r.priority, -r.weight, r.target))
    if port is not None:
        kept = [r for r in ordered if r.port == port]
        if ordered and not kept:
            seen = ", ".join(str(p) for p in sorted({r.port for r in ordered}))
            raise Ambiguous(f"no SRV record is on port {port} (ports: {seen})")
        ordered = kept
    ports: dict[str, set[int]] = {}
    for record in ordered:
        ports.setdefault(record.target, set()).add(record.port)
    several = {target: found for target, found in ports.items() if len(found) > 1}
    if several:
        target, found = min(several.items())
        listed = ", ".join(str(p) for p in sorted(found))
        raise Ambiguous(
            f"SRV target {target} has ports {listed}: name the HTTP port with the source's "
            "`port`, or resolve the named port `_http._tcp.<service>`"
        )
    chosen: dict[str, int] = {}
    for record in ordered:
        chosen.setdefault(record.target, record.port)
    return list(chosen.items())
