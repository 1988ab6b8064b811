"""Cheap SSE checks on forwarded bytes: find event boundaries, never parse a chunk's JSON.

An event is well-formed when it is `data: [DONE]`, a comment, or `data: {...}`; anything
else is a malformed event (an invalid stream termination).
"""

from __future__ import annotations


class SseScanner:
    __slots__ = ("_tail", "done", "events", "last", "malformed")

    def __init__(self) -> None:
        self._tail = b""
        self.done = False
        self.events = 0
        self.last: bytes | None = None  # the latest data event (usage and timings live there)
        self.malformed = False

    def feed(self, chunk: bytes) -> None:
        data = self._tail + chunk if self._tail else chunk
        if b"\n\n" not in data:
            self._tail = data
            return
        *complete, self._tail = data.split(b"\n\n")
        for raw in complete:
            event = raw.lstrip(b"\r\n")  # extra blank lines between events are legal
            if self.done:
                continue
            if event.startswith(b"data: {") and event.endswith(b"}"):
                self.events += 1
                self.last = event
            elif event == b"data: [DONE]":
                self.done = True
            elif event.startswith(b":") or not event.strip():
                continue
            else:
                self.malformed = True
