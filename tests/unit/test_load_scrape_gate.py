"""The load scrape runs only while something wants the engines' loads (placement by prefix,
flow control), read every round: a reload that turns flow control on starts it, one that
turns it off stops it. In virtual time."""

from __future__ import annotations

import asyncio

from narwhal.clock import FakeClock
from narwhal.control.load_scrape import LoadScraper


class CountingScraper(LoadScraper):
    rounds = 0

    async def scrape_once(self) -> None:
        self.rounds += 1


async def test_the_scrape_follows_whether_anything_wants_it() -> None:
    clock = FakeClock()
    wanted = [False]
    scraper = CountingScraper(
        list,
        None,  # type: ignore[arg-type]  # no engine is asked: scrape_once is replaced
        clock,
        1.0,
        1.0,
        lambda loads: None,
        wanted=lambda: wanted[0],
    )
    task = asyncio.create_task(scraper.run())
    try:
        await clock.run_for(5.0)
        assert scraper.rounds == 0  # flow off, placement least_loaded: no engine is asked
        wanted[0] = True  # a reload turned flow control on
        await clock.run_for(5.0)
        assert scraper.rounds == 5
        wanted[0] = False
        await clock.run_for(5.0)
        assert scraper.rounds == 5
    finally:
        task.cancel()
