"""Which SRV records are engines (`discovery/srv.py`): one per pod, on the HTTP port, never
two entries for one pod, and never a guess between two ports."""

from __future__ import annotations

import re

import pytest

from narwhal.discovery.srv import Ambiguous, Record, engines

P0, P1 = "vllm-0.vllm.ns.svc", "vllm-1.vllm.ns.svc"
HTTP, NIXL = 8000, 5600


@pytest.mark.parametrize(
    ("records", "port", "want"),
    [
        # A named port's SRV name (`_http._tcp.`): one record per pod, its port as published.
        ([Record(P0, HTTP), Record(P1, HTTP)], None, [(P0, HTTP), (P1, HTTP)]),
        # The plain name of a two-port Service: every pod twice; `port` keeps the HTTP one,
        # whatever order the server answers in.
        (
            [Record(P1, NIXL), Record(P0, HTTP), Record(P0, NIXL), Record(P1, HTTP)],
            HTTP,
            [(P0, HTTP), (P1, HTTP)],
        ),
        ([Record(P0, NIXL), Record(P0, HTTP)], HTTP, [(P0, HTTP)]),
        # A pod without the port (not serving HTTP there) is not an engine.
        ([Record(P0, HTTP), Record(P1, NIXL)], HTTP, [(P0, HTTP)]),
        # The same record twice is one engine.
        ([Record(P0, HTTP), Record(P0, HTTP)], None, [(P0, HTTP)]),
        # Pods on different ports are fine without `port`: each has one.
        ([Record(P0, 8000), Record(P1, 8001)], None, [(P0, 8000), (P1, 8001)]),
        # Priority order: lowest priority, then highest weight, then name.
        (
            [Record(P0, HTTP, priority=1), Record(P1, HTTP, priority=0)],
            None,
            [(P1, HTTP), (P0, HTTP)],
        ),
        ([Record(P0, HTTP, weight=1), Record(P1, HTTP, weight=9)], None, [(P1, HTTP), (P0, HTTP)]),
        ([], None, []),
        ([], HTTP, []),
    ],
)
def test_one_engine_per_target_on_the_http_port(
    records: list[Record], port: int | None, want: list[tuple[str, int]]
) -> None:
    assert engines(records, port) == want
    assert engines(list(reversed(records)), port) == want  # stable whatever the answer order


@pytest.mark.parametrize(
    ("records", "port", "says"),
    [
        # Two ports for one pod and nothing to choose by: refused, never guessed.
        ([Record(P0, HTTP), Record(P0, NIXL)], None, f"SRV target {P0} has ports 5600, 8000"),
        (
            [Record(P0, HTTP), Record(P1, HTTP), Record(P1, NIXL)],
            None,
            f"SRV target {P1} has ports 5600, 8000",
        ),
        # Records, but none on the port named: a misconfiguration, not an empty fleet.
        (
            [Record(P0, NIXL), Record(P0, 9000)],
            HTTP,
            "no SRV record is on port 8000 (ports: 5600, 9000)",
        ),
    ],
)
def test_an_answer_that_does_not_say_the_http_port_is_refused(
    records: list[Record], port: int | None, says: str
) -> None:
    with pytest.raises(Ambiguous, match="^" + re.escape(says)):
        engines(records, port)


def test_the_refusal_says_how_to_fix_it() -> None:
    with pytest.raises(Ambiguous) as caught:
        engines([Record(P0, HTTP), Record(P0, NIXL)], None)
    assert "`port`" in str(caught.value) and "_http._tcp." in str(caught.value)
