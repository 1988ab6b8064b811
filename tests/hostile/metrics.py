"""The router's own counters, read over a fresh connection."""

from __future__ import annotations

import urllib.request

from tests.support.http import metric_sum


def scrape(url: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return metric_sum(text, name, **labels)


def rejected(url: str, reason: str) -> float:
    """`narwhal_client_rejected_total{reason}`, all processes together."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return metric_sum(text, "narwhal_client_rejected_total", reason=reason)
