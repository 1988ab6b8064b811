"""Random bytes on the raw socket, property-based (hypothesis), against both process modes.

Each example is a fresh connection: random bytes, or a plausible request line or head with
random bytes after it, sent and then half-closed. The router must answer with well-formed
HTTP that is never a 5xx, or just close, within a few seconds; it never crashes (the guard
checks it lives, and that the legitimate flow kept succeeding). Derandomized, so CI runs the
same examples each time; `max_examples` bounds the time.
"""

from __future__ import annotations

import socket
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.hostile.conftest import Hostile
from tests.hostile.wire import answers

PREFIXES = [
    b"",
    b"GET / HTTP/1.1\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-hostile\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"POST /admin/x HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
]
TOKENS = [b"\r\n", b"\n", b"\r", b":", b" ", b"\t", b"\x00", b"chunked", b"Content-Length",
          b"Transfer-Encoding", b"0", b"ffffffff", b";", b"HTTP/1.1", b"\xff"]  # fmt: skip

payloads = st.one_of(
    st.binary(max_size=1024),
    st.tuples(st.sampled_from(PREFIXES), st.binary(max_size=256)).map(b"".join),
    st.tuples(
        st.sampled_from(PREFIXES), st.lists(st.sampled_from(TOKENS), max_size=40).map(b"".join)
    ).map(b"".join),
)
ANSWER_S = 5.0  # a closed head: at once; an open one: client_header_timeout_s (1 s)


def _send(port: int, payload: bytes) -> tuple[bytes, float]:
    started = time.monotonic()
    data = b""
    with socket.create_connection(("127.0.0.1", port), timeout=ANSWER_S) as sock:
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the router closed first: fine
        try:
            while piece := sock.recv(65536):
                data += piece
        except ConnectionResetError:
            pass
    return data, time.monotonic() - started


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(payload=payloads)
def test_random_bytes_get_a_clean_answer_or_a_close(hostile: Hostile, payload: bytes) -> None:
    """Never a hang (the socket's timeout would raise), never a 5xx, never bytes that are
    not HTTP responses."""
    data, took_s = _send(hostile.port, payload)
    assert took_s < ANSWER_S
    if data:
        for answer in answers(data):
            assert answer.status < 500, (payload, data[:300])
