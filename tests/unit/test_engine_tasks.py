"""EngineTasks: at most one task per (kind, engine), refused cleanly when not leading, and a
task that raises frees its slot without taking anything else down."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

import pytest

from narwhal.control.engine_tasks import EngineTasks


class Loop:
    """A spawn that runs work as real tasks, or refuses it while `leading` is False."""

    def __init__(self) -> None:
        self.leading = True
        self.tasks: list[asyncio.Task[None]] = []

    def __call__(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
        if not self.leading:
            work.close()
            return None
        task = asyncio.get_running_loop().create_task(work)
        self.tasks.append(task)
        return task


async def test_one_task_per_kind_and_engine() -> None:
    loop, gate = Loop(), asyncio.Event()
    tasks = EngineTasks(loop)

    async def wait() -> None:
        await gate.wait()

    assert tasks.start("probe", "p0", wait())
    second = wait()
    assert not tasks.start("probe", "p0", second)  # p0's probe still runs
    assert second.cr_frame is None, "a refused coroutine is closed, never left dangling"
    assert tasks.start("probe", "p1", wait())  # another engine
    assert tasks.start("readmission", "p0", wait())  # another kind
    assert tasks.busy("probe", "p0") and len(loop.tasks) == 3
    gate.set()
    await asyncio.gather(*loop.tasks)
    assert not tasks.busy("probe", "p0")
    assert tasks.start("probe", "p0", wait())  # free again once it ended
    await asyncio.gather(*loop.tasks)


async def test_not_leading_starts_nothing_and_keeps_nothing_busy() -> None:
    loop = Loop()
    loop.leading = False
    tasks = EngineTasks(loop)
    work = asyncio.sleep(0)
    assert not tasks.start("probe", "p0", work)
    assert work.cr_frame is None
    assert not tasks.busy("probe", "p0")
    loop.leading = True
    assert tasks.start("probe", "p0", asyncio.sleep(0))
    await asyncio.gather(*loop.tasks)


async def test_a_task_that_raises_is_logged_and_frees_its_slot(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop = Loop()
    tasks = EngineTasks(loop)

    async def broken() -> None:
        raise RuntimeError("a bug in a probe")

    with caplog.at_level(logging.ERROR, "narwhal.engine_tasks"):
        assert tasks.start("probe", "p0", broken())
        await asyncio.gather(*loop.tasks)  # the wrapper does not re-raise
    assert not tasks.busy("probe", "p0")
    assert "engine p0: probe task failed" in caplog.messages


@pytest.mark.parametrize("started", [False, True])
async def test_cancellation_frees_the_slot(started: bool) -> None:
    """Fencing cancels the leadership scope's tasks, some before their first step."""
    loop = Loop()
    tasks = EngineTasks(loop)
    work = asyncio.sleep(3600)
    assert tasks.start("probe", "p0", work)
    if started:
        await asyncio.sleep(0)
    loop.tasks[0].cancel()
    await asyncio.gather(*loop.tasks, return_exceptions=True)
    assert not tasks.busy("probe", "p0")
    assert work.cr_frame is None  # closed either way: no never-awaited coroutine left
