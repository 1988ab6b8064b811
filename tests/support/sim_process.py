"""narwhal-sim engines as real child processes, for end-to-end tests.

`SimProcess` starts `python -m narwhal.sim.cli serve --port 0 ...`, learns its URL from the
`narwhal-sim listening on` line, and can kill, stop (SIGSTOP), resume and restart it on the
same port. Its fault and request helpers use urllib, so they work from sync and async tests
alike. `sim_factory` is a pytest fixture that starts sims and always stops them.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Self

import pytest

from tests.support.sim_zygote import ForkedSim, SimSpawner

READY_PREFIX = "narwhal-sim listening on "
_HTTP_TIMEOUT_S = 10.0


class SimProcess:
    """One simulated engine process. Extra CLI arguments go to `narwhal-sim serve`."""

    def __init__(
        self,
        *args: str,
        host: str = "127.0.0.1",
        port: int = 0,
        start_timeout_s: float = 20.0,
        spawner: SimSpawner | None = None,
    ) -> None:
        self.args = tuple(args)
        self.host = host
        self._port = port
        self.start_timeout_s = start_timeout_s
        self._spawner = spawner
        self._proc: subprocess.Popen[bytes] | ForkedSim | None = None
        self.url = ""

    # --- lifecycle --------------------------------------------------------------------------

    def launch(self) -> None:
        """Start the process without waiting for it to listen (see `wait_ready`): forked
        by the session's `SimSpawner` when there is one, else `python -m narwhal.sim.cli`."""
        argv = ["serve", "--host", self.host, "--port", str(self._port), *self.args]
        if self._spawner is not None:
            self._proc = self._spawner.spawn(argv)
            return
        cmd = [sys.executable, "-m", "narwhal.sim.cli", *argv]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)

    def wait_ready(self) -> None:
        """Read the `listening on` line within `start_timeout_s`; learn the URL and port."""
        proc = self._require()
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + self.start_timeout_s
        buf = b""
        while b"\n" not in buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.kill()
                raise TimeoutError(f"narwhal-sim {self.args} did not start in time")
            readable, _, _ = select.select([fd], [], [], remaining)
            if readable:
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise RuntimeError(f"narwhal-sim {self.args} exited with {proc.wait()}")
                buf += chunk
        line = buf.split(b"\n", 1)[0].decode()
        if not line.startswith(READY_PREFIX):
            self.kill()
            raise RuntimeError(f"unexpected first line from narwhal-sim: {line!r}")
        self.url = line[len(READY_PREFIX) :].strip()
        self._port = int(self.url.rsplit(":", 1)[1])

    def start(self) -> Self:
        self.launch()
        self.wait_ready()
        return self

    @property
    def port(self) -> int:
        return self._port

    @property
    def pid(self) -> int:
        return self._require().pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        """SIGKILL and reap (a stopped process dies too)."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        self._close_pipe()

    def terminate(self, timeout_s: float = 5.0) -> int:
        """SIGTERM (resuming a frozen process first) and wait; returns the exit status."""
        proc = self._require()
        if proc.poll() is None:
            proc.terminate()
            proc.send_signal(signal.SIGCONT)
        status = proc.wait(timeout_s)
        self._close_pipe()
        return status

    def wait(self, timeout_s: float = 5.0) -> int:
        """Wait for the process to exit by itself; returns the exit status."""
        status = self._require().wait(timeout_s)
        self._close_pipe()
        return status

    def freeze(self) -> None:
        """SIGSTOP: the process keeps its sockets but answers nothing."""
        self._require().send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT: resume a frozen process."""
        self._require().send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """Kill the process and start a new one on the same port (a new process generation)."""
        self.kill()
        self.launch()
        self.wait_ready()

    def close(self) -> None:
        """Stop the process if it runs; safe to call twice."""
        self.kill()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return await asyncio.to_thread(self.start)

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.to_thread(self.close)

    def _require(self) -> subprocess.Popen[bytes] | ForkedSim:
        if self._proc is None:
            raise RuntimeError("the sim process was never started")
        return self._proc

    def _close_pipe(self) -> None:
        if self._proc is not None and self._proc.stdout is not None:
            self._proc.stdout.close()

    # --- HTTP helpers (urllib: no event loop needed) ----------------------------------------

    def http(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float = _HTTP_TIMEOUT_S,
    ) -> tuple[int, bytes]:
        """One request to the sim; returns (status, body) for any HTTP status."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        for name, value in (headers or {}).items():
            req.add_header(name, value)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def _json(self, method: str, path: str, body: Any = None, ok: int = 200) -> Any:
        status, raw = self.http(method, path, body)
        if status != ok:
            raise AssertionError(
                f"{method} {path} answered {status}: {raw.decode(errors='replace')}"
            )
        return json.loads(raw) if raw else None

    def get_json(self, path: str) -> Any:
        return self._json("GET", path)

    def post_json(self, path: str, body: Any) -> Any:
        return self._json("POST", path, body)

    def add_fault(self, fault: Mapping[str, Any]) -> dict[str, Any]:
        """Inject a fault (see docs/simulator.md); returns it with its `id`."""
        result: dict[str, Any] = self._json("POST", "/sim/faults", dict(fault), ok=201)
        return result

    def faults(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.get_json("/sim/faults")
        return result

    def remove_fault(self, fault_id: int) -> None:
        self._json("DELETE", f"/sim/faults/{fault_id}", ok=204)

    def clear_faults(self) -> None:
        self._json("DELETE", "/sim/faults", ok=204)

    def requests(self) -> list[dict[str, Any]]:
        """The completion requests received (oldest first, last 200)."""
        result: list[dict[str, Any]] = self.get_json("/sim/requests")
        return result

    def clear_requests(self) -> None:
        self._json("DELETE", "/sim/requests", ok=204)

    def metrics(self) -> str:
        status, raw = self.http("GET", "/metrics")
        assert status == 200, status
        return raw.decode()

    def metric(self, name: str) -> float:
        """The value of an unlabelled (or first labelled) sample in /metrics."""
        for line in self.metrics().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def process_start_time(self) -> float:
        return self.metric("process_start_time_seconds")


class SimFactory:
    """Starts sims (forked by `spawner` when given) and stops every one it started on
    `close()`."""

    def __init__(self, spawner: SimSpawner | None = None) -> None:
        self._sims: list[SimProcess] = []
        self._spawner = spawner

    def __call__(self, *args: str, **kwargs: Any) -> SimProcess:
        return self.start_many([args], **kwargs)[0]

    def start_many(self, specs: Sequence[Sequence[str]], **kwargs: Any) -> list[SimProcess]:
        """Start several sims in parallel, one per argument list."""
        sims = [SimProcess(*spec, spawner=self._spawner, **kwargs) for spec in specs]
        self._sims.extend(sims)
        for sim in sims:
            sim.launch()
        for sim in sims:
            sim.wait_ready()
        return sims

    def close(self) -> None:
        for sim in self._sims:
            sim.close()
        self._sims.clear()


def start_sims(specs: Sequence[Sequence[str]]) -> list[SimProcess]:
    """Start sims in parallel; the caller closes them (prefer the `sim_factory` fixture)."""
    factory = SimFactory()
    try:
        return factory.start_many(specs)
    except BaseException:
        factory.close()
        raise


@pytest.fixture(scope="session")
def sim_spawner() -> Iterator[SimSpawner]:
    """The session's simulator zygote (`tests/support/sim_zygote.py`)."""
    spawner = SimSpawner()
    yield spawner
    spawner.close()


@pytest.fixture
def sim_factory(sim_spawner: SimSpawner) -> Iterator[SimFactory]:
    """`sim_factory("--role", "prefill", ...)` starts a sim; all are stopped after the test."""
    factory = SimFactory(sim_spawner)
    try:
        yield factory
    finally:
        factory.close()
