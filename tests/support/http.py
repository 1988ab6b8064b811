"""An HTTP client session for tests, and readers for what routers and engines answer."""

from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """One client session per test; the timeout only bounds a test that would hang."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels`, in Prometheus text."""
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def metric(http: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    """`metric_sum` over what `url`/metrics answers now."""
    async with http.get(url + "/metrics") as resp:
        return metric_sum(await resp.text(), name, **labels)
