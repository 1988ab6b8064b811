"""How many pytest processes the suite should run: one per CPU that is idle right now.

The end-to-end tests start routers and engines with windows of a second or two; two pytest
processes beside a neighbour that keeps a core busy (three loads on two cores) stretch those
windows past what the tests allow. Like `make -l`, the suite sizes itself to the machine as it
finds it: CPUs this process may use (affinity and the cgroup's quota), less those busy over the
last second, at most two. `NARWHAL_TEST_PROCESSES` overrides. Prints the number; says why on stderr.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def cgroup_quota_cpus() -> int | None:
    """The cgroup v2 CPU quota in whole CPUs, or None when there is none."""
    try:
        quota, period = (CGROUP / "cpu.max").read_text().split()
        return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        return None


def _cgroup_usage_s() -> float:
    """CPU seconds this cgroup has used, from cpu.stat."""
    for line in (CGROUP / "cpu.stat").read_text().splitlines():
        key, value = line.split()
        if key == "usage_usec":
            return int(value) / 1e6
    raise OSError("no usage_usec in cpu.stat")


def _busy_and_total(cpus: set[int]) -> tuple[int, int]:
    """Jiffies busy and in all, summed over `cpus`, from /proc/stat's per-CPU lines."""
    busy = total = 0
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
        total += sum(ticks)
        busy += sum(ticks) - ticks[3] - ticks[4]
    return busy, total


def busy_cpus(quota: int | None, window_s: float = 1.0) -> float:
    """How many CPUs other work kept busy over `window_s`: the cgroup's own use under a
    quota (the host's other tenants do not count against it), else this process's CPUs'."""
    if quota is not None:
        used0, start = _cgroup_usage_s(), time.monotonic()
        time.sleep(window_s)
        return (_cgroup_usage_s() - used0) / (time.monotonic() - start)
    cpus = os.sched_getaffinity(0)
    busy0, total0 = _busy_and_total(cpus)
    time.sleep(window_s)
    busy1, total1 = _busy_and_total(cpus)
    if total1 <= total0:
        return 0.0
    return len(cpus) * (busy1 - busy0) / (total1 - total0)


# The suite is measured at two processes (docs/testing.md): its end-to-end modules each start
# routers with a worker per CPU and several engines, and more processes at once have not been
# tried against their windows.
MAX_PROCESSES = 2


def processes(cpus: int, busy: float) -> int:
    """One process per idle CPU, at least one and at most `MAX_PROCESSES`."""
    return max(1, min(cpus, MAX_PROCESSES, round(cpus - busy)))


def main() -> int:
    override = os.environ.get("NARWHAL_TEST_PROCESSES")
    if override:
        print(int(override))
        return 0
    quota = cgroup_quota_cpus()
    cpus = len(os.sched_getaffinity(0))
    if quota is not None:
        cpus = min(cpus, quota)
    try:
        busy = busy_cpus(quota)
    except OSError:
        busy = 0.0
    count = processes(cpus, busy)
    print(
        f"tests: {count} pytest process(es): {busy:.1f} of {cpus} CPUs busy before the run",
        file=sys.stderr,
    )
    print(count)
    return 0


if __name__ == "__main__":
    sys.exit(main())
