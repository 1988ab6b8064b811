"""The stream read watchdog: which deadline applies when, and that one timer enforces it."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from narwhal.dataplane.watchdog import ReadWatchdog, read_deadline


def test_before_the_first_byte_the_first_token_deadline_applies() -> None:
    due = read_deadline(5.0, False, first_deadline=10.0, request_deadline=60.0, idle_s=1.0)
    assert due == 10.0


def test_after_the_first_byte_each_read_gets_the_idle_time() -> None:
    due = read_deadline(5.0, True, first_deadline=10.0, request_deadline=60.0, idle_s=1.0)
    assert due == 6.0


def test_the_request_deadline_caps_the_idle_time() -> None:
    due = read_deadline(59.5, True, first_deadline=10.0, request_deadline=60.0, idle_s=1.0)
    assert due == 60.0


@pytest.mark.parametrize("started", [False, True])
def test_while_writing_to_the_client_only_the_request_deadline_applies(started: bool) -> None:
    due = read_deadline(None, started, first_deadline=10.0, request_deadline=60.0, idle_s=1.0)
    assert due == 60.0


@dataclass
class _Handle:
    when: float
    callback: object
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class FakeLoop:
    now: float = 0.0
    handles: list[_Handle] = field(default_factory=list)

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: object) -> _Handle:
        handle = _Handle(when, callback)
        self.handles.append(handle)
        return handle

    def run_until(self, t: float) -> None:
        """Fire due handles in time order, as the event loop would, up to `t`."""
        while True:
            due = [h for h in self.handles if not h.cancelled and h.when <= t]
            if not due:
                break
            handle = min(due, key=lambda h: h.when)
            self.handles.remove(handle)
            self.now = handle.when
            handle.callback()  # type: ignore[operator]
        self.now = t


@dataclass
class FakeTimeout:
    expired_at: list[float] = field(default_factory=list)

    def reschedule(self, when: float | None) -> None:
        assert when is not None
        self.expired_at.append(when)


def _watch(loop: FakeLoop, timeout: FakeTimeout) -> ReadWatchdog:
    return ReadWatchdog(
        loop,  # type: ignore[arg-type]  # the two loop methods it uses, on a fake clock
        timeout,
        first_deadline=10.0,
        request_deadline=60.0,
        idle_s=2.0,
    )


def test_a_silent_engine_expires_at_the_first_token_deadline() -> None:
    loop, timeout = FakeLoop(), FakeTimeout()
    watch = _watch(loop, timeout)
    watch.reading()
    loop.run_until(9.9)
    assert timeout.expired_at == []
    loop.run_until(10.0)
    assert timeout.expired_at == [10.0]


def test_chunks_keep_a_stream_alive_and_silence_expires_it() -> None:
    loop, timeout = FakeLoop(), FakeTimeout()
    watch = _watch(loop, timeout)
    watch.reading()
    watch.started()
    for t in (1.0, 2.5, 4.0, 5.5):  # a chunk every 1.5 s, under the 2 s idle time
        loop.run_until(t)
        watch.writing()
        watch.reading()
    loop.run_until(7.4)
    assert timeout.expired_at == []
    loop.run_until(8.0)
    assert timeout.expired_at == [7.5]  # 2 s after the last read began


def test_a_slow_client_write_is_not_engine_silence() -> None:
    loop, timeout = FakeLoop(), FakeTimeout()
    watch = _watch(loop, timeout)
    watch.reading()
    watch.started()
    loop.run_until(1.0)
    watch.writing()
    loop.run_until(30.0)  # the client takes 29 s to accept one chunk
    assert timeout.expired_at == []
    watch.reading()
    loop.run_until(31.9)
    assert timeout.expired_at == []
    loop.run_until(33.0)
    assert timeout.expired_at == [32.0]


def test_a_client_that_stops_reading_expires_at_the_request_deadline() -> None:
    """The write to a client with a zero receive window never returns: the request's deadline
    ends it, and the watchdog says the client (not the engine) ran out the clock."""
    loop, timeout = FakeLoop(), FakeTimeout()
    watch = _watch(loop, timeout)
    watch.reading()
    watch.started()
    loop.run_until(1.0)
    watch.writing()  # this write never completes
    loop.run_until(59.9)
    assert timeout.expired_at == []
    loop.run_until(61.0)
    assert timeout.expired_at == [60.0]
    assert watch.writing_expired


def test_a_silent_engine_is_not_the_clients_doing() -> None:
    loop, timeout = FakeLoop(), FakeTimeout()
    watch = _watch(loop, timeout)
    watch.reading()
    watch.started()
    loop.run_until(3.0)
    assert timeout.expired_at == [2.0]
    assert not watch.writing_expired


def test_close_cancels_the_timer() -> None:
    loop, timeout = FakeLoop(), FakeTimeout()
    watch = _watch(loop, timeout)
    watch.reading()
    watch.close()
    loop.run_until(100.0)
    assert timeout.expired_at == []
