"""The control process sums its workers' multiprocess metric files (`WorkerFiles`); a file a
worker has only just created (still empty) must not break the scrape."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector

from narwhal.telemetry.metrics import SummedData, WorkerFiles


def _worker_file(directory: Path, pid: int, value: float) -> None:
    """A worker's counter file as prometheus_client writes it."""
    db = MmapedDict(str(directory / f"counter_{pid}.db"))
    key = json.dumps(["demo_requests", "demo_requests_total", {}, "Requests"], sort_keys=True)
    db.write_value(key, value, 0.0)
    db.close()


def test_a_worker_file_not_yet_sized_is_skipped_not_a_crash(tmp_path: Path) -> None:
    _worker_file(tmp_path, 101, 3.0)
    _worker_file(tmp_path, 102, 4.0)
    (tmp_path / "counter_103.db").touch()  # a worker between creating its file and sizing it
    with pytest.raises(struct.error):  # what the library's own collector does with it
        list(MultiProcessCollector(None, path=str(tmp_path)).collect())  # type: ignore[no-untyped-call]
    local = CollectorRegistry()
    Counter("demo_requests", "Requests", registry=local)
    shared = CollectorRegistry(auto_describe=True)
    shared.register(SummedData(local, WorkerFiles(tmp_path)))
    assert b"demo_requests_total 7.0" in generate_latest(shared)
