"""Event-loop lag: how late the router's loop runs a callback that was due.

Every request, health check and lease renewal shares one event loop, so a blocking call or a
long pause anywhere delays them all; `/ready` answering late looks like a dead router to a
load balancer and to a standby. This task wakes every `interval_s` and records how much
later than asked it woke: the longest stall that happened since the last wake-up, bounded
below by the sampling interval. It measures the loop itself, so it reads the loop's clock
(not the injected one, which a test may freeze).
"""

from __future__ import annotations

import asyncio

from prometheus_client import Histogram

LAG_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


async def watch_loop_lag(histogram: Histogram, interval_s: float = 0.05) -> None:
    """Observe each wake-up's lateness into `histogram` until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        histogram.observe(max(0.0, loop.time() - due))
