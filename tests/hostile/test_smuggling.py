"""Request smuggling, case by case, against both process modes (tests/hostile/conftest.py).

Every payload carries a marker in its prompt (`tap-model`, so only the tap engines see it)
and, where a lax parser would find one, a second request (`SMUGGLED`) hidden in what a strict
parser reads as the first one's body or as garbage. Each case is either refused (one
OpenAI-shaped 4xx with `Connection: close`, then the close; the tap saw nothing) or handled
exactly once (the tap's prefill and decode each saw the one request a strict parser reads,
with the prompt it reads); no case ever gets SMUGGLED to an engine.

Findings are kept as strict xfails naming what is wrong (docs/edge.md, "Hostile clients").
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

import orjson
import pytest

from tests.hostile.conftest import Hostile
from tests.hostile.wire import answers, exchange

HEAD = b"Host: x\r\nAuthorization: Bearer sk-hostile\r\nContent-Type: application/json\r\n"
# A parser error after the head is told to the handler waiting for the body, which answers
# 400 at once: this wait is generous.
REFUSAL_WAIT_S = 3.0


def body(prompt: str) -> bytes:
    return orjson.dumps({"model": "tap-model", "prompt": prompt, "max_tokens": 2})


def request(
    extra: bytes, payload: bytes, *, target: bytes = b"/v1/completions",
    version: bytes = b"HTTP/1.1", head: bytes = HEAD,
) -> bytes:  # fmt: skip
    return b"POST %s %s\r\n%s%s\r\n%s" % (target, version, head, extra, payload)


def with_length(payload: bytes, extra: bytes = b"", **kw: bytes) -> bytes:
    return request(b"Content-Length: %d\r\n%s" % (len(payload), extra), payload, **kw)


def chunked(payload: bytes, ext: bytes = b"", trailer: bytes = b"") -> bytes:
    return b"%x%s\r\n%s\r\n0\r\n%s\r\n" % (len(payload), ext, payload, trailer)


@dataclass(frozen=True)
class Case:
    """`build(first, smuggled)` -> the bytes; `status`: the refusal expected (None: served,
    `served` the prompts the engines must see, in order)."""

    build: Callable[[bytes, bytes], bytes]
    status: int | None = None
    served: tuple[str, ...] = ()
    xfail: str | None = None


def smug(b: bytes) -> bytes:
    return with_length(b)


TE = b"Transfer-Encoding: chunked\r\n"
CASES: dict[str, Case] = {
    "content-length-with-transfer-encoding": Case(
        lambda f, s: request(b"Content-Length: %d\r\n" % len(f) + TE, chunked(f) + smug(s)), 400
    ),
    "transfer-encoding-with-content-length": Case(
        lambda f, s: request(TE + b"Content-Length: 4\r\n", chunked(f) + smug(s)), 400
    ),
    "two-different-content-lengths": Case(
        lambda f, s: request(
            b"Content-Length: %d\r\nContent-Length: %d\r\n" % (len(f), len(f) + len(smug(s))),
            f + smug(s),
        ),
        400,
    ),
    "the-same-content-length-twice": Case(
        lambda f, s: request(b"Content-Length: %d\r\n" % len(f) * 2, f + smug(s)), 400
    ),
    "content-length-list": Case(
        lambda f, s: request(b"Content-Length: %d, %d\r\n" % (len(f), len(f)), f + smug(s)), 400
    ),
    "transfer-encoding-chunked-identity": Case(
        lambda f, s: request(b"Transfer-Encoding: chunked, identity\r\n", chunked(f) + smug(s)),
        400,
    ),
    "transfer-encoding-chunked-twice": Case(
        lambda f, s: request(TE + TE, chunked(f) + smug(s)), 400
    ),
    "transfer-encoding-identity-with-length": Case(
        lambda f, s: with_length(f + smug(s), b"Transfer-Encoding: identity\r\n"), 400
    ),
    "transfer-encoding-gzip-alone": Case(
        lambda f, s: request(b"Transfer-Encoding: gzip\r\n", f + smug(s)), 400
    ),
    "transfer-encoding-unknown": Case(
        lambda f, s: request(b"Transfer-Encoding: xchunked\r\n", chunked(f) + smug(s)),
        400,
    ),
    "transfer-encoding-gzip-then-chunked": Case(
        # No coding but chunked is decoded: the handler would get gzip bytes (RFC 9112 §6.1).
        lambda f, s: request(b"Transfer-Encoding: gzip, chunked\r\n", chunked(f) + smug(s)),
        400,
    ),
    "transfer-encoding-upper-case": Case(
        lambda f, s: request(b"Transfer-Encoding: CHUNKED\r\n", chunked(f)), served=("first",)
    ),
    "whitespace-before-the-colon": Case(
        lambda f, s: request(
            b"Transfer-Encoding : chunked\r\nContent-Length: %d\r\n" % len(f), f + smug(s)
        ),
        400,
    ),
    "obs-fold": Case(lambda f, s: with_length(f, b"X-Folded: a\r\n b\r\n"), 400),
    "obs-fold-on-transfer-encoding": Case(
        lambda f, s: request(b"Transfer-Encoding: identity\r\n chunked\r\n", chunked(f)), 400
    ),
    "bare-lf-everywhere": Case(lambda f, s: with_length(f).replace(b"\r\n", b"\n"), 400),
    "one-bare-lf": Case(lambda f, s: with_length(f, b"X-A: b\nX-B: c\r\n"), 400),
    "nul-in-a-header-value": Case(lambda f, s: with_length(f, b"X-A: a\x00b\r\n"), 400),
    "cr-in-a-header-value": Case(lambda f, s: with_length(f, b"X-A: a\rb\r\n"), 400),
    "chunk-size-overflow": Case(lambda f, s: request(TE, b"f" * 20 + b"\r\n" + f + smug(s)), 400),
    "negative-chunk-size": Case(
        lambda f, s: request(TE, b"-%x\r\n%s\r\n0\r\n\r\n" % (len(f), f) + smug(s)),
        400,
    ),
    "chunk-size-past-max-body-bytes": Case(
        lambda f, s: request(TE, b"20000\r\n" + b"x" * 0x11000), 413
    ),
    "chunk-extensions": Case(
        lambda f, s: request(TE, chunked(f, b';name=value;q="a b"')), served=("first",)
    ),
    "a-bad-chunk-extension": Case(lambda f, s: request(TE, chunked(f, b";a\rb") + smug(s)), 400),
    "trailers": Case(
        lambda f, s: request(
            TE,
            chunked(
                f,
                trailer=b"X-Request-Id: from-trailer\r\ntraceparent: "
                b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n",
            ),
        ),
        served=("first",),
    ),
    "content-length-as-a-trailer": Case(
        lambda f, s: request(TE, chunked(f, trailer=b"Content-Length: 80\r\n") + smug(s)),
        400,
    ),
    "absolute-form-target": Case(
        lambda f, s: with_length(f, target=b"http://evil.example/v1/completions"),
        served=("first",),
    ),
    # RFC 9112 §3.2: an HTTP/1.1 request without a Host, or with two, is a 400.
    "no-host": Case(lambda f, s: with_length(f, head=b"Authorization: Bearer sk-hostile\r\n"), 400),
    "two-hosts": Case(lambda f, s: with_length(f, b"Host: y\r\n"), 400),
    "no-host-in-http-1.0": Case(
        lambda f, s: with_length(
            f, head=b"Authorization: Bearer sk-hostile\r\n", version=b"HTTP/1.0"
        ),
        served=("first",),
    ),
    "http-1.0-keep-alive": Case(
        lambda f, s: (
            with_length(f, b"Connection: keep-alive\r\n", version=b"HTTP/1.0")
            + with_length(s, version=b"HTTP/1.0")
        ),
        served=("first", "smuggled-as-next-request"),
    ),
    "http-1.0-chunked": Case(
        lambda f, s: request(TE, chunked(f) + smug(s), version=b"HTTP/1.0"), served=("first",)
    ),
    "upgrade-h2c": Case(
        lambda f, s: with_length(
            f,
            b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
            b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n",
        ),
        400,
    ),
    "http2-prior-knowledge": Case(lambda f, s: b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + f, 400),
}


def _params() -> list[object]:
    return [
        pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=c.xfail))
        if c.xfail
        else name
        for name, c in CASES.items()
    ]


@pytest.mark.parametrize("name", _params())
async def test_smuggling(hostile: Hostile, name: str) -> None:
    """Refused (a 400 or 413, OpenAI-shaped, and a close) or served exactly once, as the
    case says; the tap engines see only what a strict parser reads."""
    case = CASES[name]
    nonce = f"{name}-{hostile.mode}-{uuid.uuid4().hex[:8]}"
    prompts = {"first": f"first {nonce}", "smuggled-as-next-request": f"SMUGGLED {nonce}"}
    payload = case.build(body(prompts["first"]), body(prompts["smuggled-as-next-request"]))
    if case.status is not None:
        data, closed = await exchange(hostile.port, payload, wait_s=REFUSAL_WAIT_S)
        got = answers(data)
        assert [a.status for a in got] == [case.status], data[:400]
        assert got[0].headers["connection"] == "close"
        assert got[0].error()["code"] == case.status
        assert closed, "no close after the refusal"
    else:
        data, _ = await exchange(hostile.port, payload, enough=len(case.served))
        got = answers(data)
        assert [a.status for a in got] == [200] * len(case.served), data[:400]
    prefill, decode = hostile.tap.entries(nonce)
    expected = [prompts[p] for p in case.served]
    assert [e["body"]["prompt"] for e in prefill] == expected
    assert [e["body"]["prompt"] for e in decode] == expected
    for entry in (*prefill, *decode):
        assert "from-trailer" not in entry["headers"].get("x-request-id", "")
        assert "traceparent" not in entry["headers"]
