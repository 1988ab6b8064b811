"""Fixtures for the simulator's own tests: sims shared by a module, cleaned between tests.

(`sim_factory`, one test's sims, comes from tests/conftest.py.)
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.sim_process import SimFactory, SimProcess


@pytest.fixture(scope="module")
def module_sims() -> Iterator[SimFactory]:
    factory = SimFactory()
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture(scope="module")
def _unified(module_sims: SimFactory) -> SimProcess:
    return module_sims("--itl-ms", "0", "--seed", "7", "--max-concurrency", "64")


@pytest.fixture
def unified(_unified: SimProcess) -> Iterator[SimProcess]:
    """A unified sim (no inter-token latency) shared by the module, clean for each test."""
    _unified.clear_faults()
    _unified.clear_requests()
    yield _unified
    _unified.clear_faults()
