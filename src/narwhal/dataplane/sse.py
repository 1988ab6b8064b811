"""Cheap SSE checks on forwarded bytes: find event boundaries, never parse a chunk's JSON.

An event's data must be `[DONE]` or a JSON object (`{...}`); anything else is a malformed event
(an invalid stream termination). The SSE format is accepted as written, not only as vLLM writes
it: CRLF or CR line endings, `data:` with or without its space, trailing whitespace, comment
lines (`:`), and the standard `id:`, `event:` and `retry:` fields (ignored). A field the format
does not define is malformed. An event whose data starts `{"error"` is an engine reporting an
error in band (vLLM does so mid-generation, then sends `[DONE]`): `error` keeps the first one.

At the end of the body, `end()` accepts a leftover that is exactly a `data: [DONE]` line: some
engines end with `data: [DONE]\n` and EOF, without the blank line that dispatches the event.

The common event (`data: {...}` on one line) is recognised with two prefix/suffix checks; only
other shapes take the line-by-line path.
"""

from __future__ import annotations

_KNOWN_FIELDS = frozenset({b"id", b"event", b"retry"})


class SseScanner:
    __slots__ = ("_cr", "_tail", "done", "error", "events", "last", "malformed")

    def __init__(self) -> None:
        self._tail = b""
        self._cr = False  # the last chunk ended in CR: a LF starting the next one pairs with it
        self.done = False
        self.error: bytes | None = None  # the first in-band error event
        self.events = 0
        self.last: bytes | None = None  # the latest data event (usage and timings live there)
        self.malformed = False

    def feed(self, chunk: bytes) -> None:
        if self._cr:
            self._cr = False
            if chunk.startswith(b"\n"):
                chunk = chunk[1:]
        data = self._tail + chunk if self._tail else chunk
        if b"\r" in data:  # line endings become LF; the tail is kept in that form
            self._cr = data.endswith(b"\r")
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if b"\n\n" not in data:
            self._tail = data
            return
        *complete, self._tail = data.split(b"\n\n")
        for raw in complete:
            if self.done:
                return
            event = raw.lstrip(b"\n")  # extra blank lines between events are legal
            if event.startswith(b"data: {") and event.endswith(b"}"):
                if event.startswith(b'data: {"error"'):
                    self.error = self.error or event
                else:
                    self.events += 1
                    self.last = event
            elif event == b"data: [DONE]":
                self.done = True
            elif event:
                self._slow(event)

    def end(self) -> bytes:
        """At the body's end: when the leftover is exactly a `data: [DONE]` line (the blank line
        that dispatches it missing), mark the stream done and return the bytes that complete the
        event for the client; otherwise b"" (the stream ended without `[DONE]`)."""
        if self.done or self.malformed:
            return b""
        if self._tail.strip() not in (b"data: [DONE]", b"data:[DONE]"):
            return b""
        self.done = True
        ending = b"\n" if self._tail.endswith(b"\n") else b"\n\n"
        self._tail = b""
        return ending

    def _slow(self, event: bytes) -> None:
        """Any other event shape, field by field as the SSE format defines them."""
        data: list[bytes] = []
        for line in event.split(b"\n"):
            line = line.rstrip()
            if not line or line.startswith(b":"):
                continue
            name, _, value = line.partition(b":")
            if name == b"data":
                data.append(value[1:] if value.startswith(b" ") else value)
            elif name not in _KNOWN_FIELDS:
                self.malformed = True
                return
        payload = data[0] if len(data) == 1 else b"\n".join(data)
        if not payload:
            return  # no data: the format dispatches nothing
        if payload == b"[DONE]":
            self.done = True
        elif payload.startswith(b"{") and payload.endswith(b"}"):
            if payload.startswith(b'{"error"'):
                self.error = self.error or b"data: " + payload
            else:
                self.events += 1
                self.last = b"data: " + payload
        else:
            self.malformed = True
