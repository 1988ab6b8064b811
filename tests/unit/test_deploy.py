"""deploy/: the Grafana dashboard and the alert rules use only documented metrics and labels.

Pure Python (no promtool): every `narwhal_*` name in a PromQL expression must be a row of
docs/metrics.md (histograms may add `_bucket`, `_sum`, `_count`), and every label an
expression matches on or groups by must be one of that metric's documented labels (or a
label Prometheus adds: `instance`, `job`, `le`). The issue's four alerts must exist, with the
ecosystem's severities, one firing when no router reports at all, and docs/metrics.md's alert
table lists exactly these rules.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.test_metrics_contract import documented

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana-dashboard.json"
ALERTS = ROOT / "deploy" / "prometheus-alerts.yaml"
SCRAPE_LABELS = frozenset({"instance", "job"})

METRIC = re.compile(r"\b(narwhal_[a-z0-9_]+)(\{[^}]*\})?")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


def _exprs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            else:
                yield from _exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _exprs(item)


def dashboard_exprs() -> list[str]:
    return list(_exprs(json.loads(DASHBOARD.read_text())))


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def resolve(name: str, rows: dict[str, dict[str, Any]]) -> str | None:
    """The documented metric `name` refers to (a histogram's series map to the histogram)."""
    if name in rows:
        return name
    for suffix in ("_bucket", "_sum", "_count"):
        base = name.removesuffix(suffix)
        if base != name and rows.get(base, {}).get("type") == "histogram":
            return base
    return None


def problems(expr: str) -> list[str]:
    rows = documented()
    found: list[str] = []
    used: set[str] = set()
    for match in METRIC.finditer(expr):
        name, selector = match[1], match[2] or ""
        metric = resolve(name, rows)
        if metric is None:
            found.append(f"{name}: not in docs/metrics.md")
            continue
        used.add(metric)
        allowed = rows[metric]["labels"] | SCRAPE_LABELS | {"le"}
        for label in MATCHER.findall(selector):
            if label not in allowed:
                found.append(f"{name}: label {label!r} is not documented")
    if used:
        allowed = frozenset().union(*(rows[m]["labels"] for m in used)) | SCRAPE_LABELS | {"le"}
        for group in GROUPING.findall(expr):
            for label in (x.strip() for x in group.split(",")):
                if label and label not in allowed:
                    found.append(f"{expr!r}: groups by undocumented label {label!r}")
    return found


ALL_EXPRS = [("dashboard", e) for e in dashboard_exprs()] + [
    (f"alert {r['alert']}", r["expr"]) for r in alert_rules()
]


@pytest.mark.parametrize(("where", "expr"), ALL_EXPRS, ids=[w for w, _ in ALL_EXPRS])
def test_expressions_use_documented_metrics_and_labels(where: str, expr: str) -> None:
    assert METRIC.search(expr), f"{where}: no narwhal metric in {expr!r}"
    assert problems(expr) == [], where


def test_the_checker_catches_undocumented_names_and_labels() -> None:
    assert problems("rate(narwhal_requests_total[1m])") == []
    assert (
        problems("histogram_quantile(0.9, rate(narwhal_request_duration_seconds_bucket[1m]))") == []
    )
    assert problems("narwhal_no_such_metric") == ["narwhal_no_such_metric: not in docs/metrics.md"]
    assert problems('narwhal_requests_total{flavour="x"}') == [
        "narwhal_requests_total: label 'flavour' is not documented"
    ]
    assert problems("narwhal_queue_depth_bucket") == [
        "narwhal_queue_depth_bucket: not in docs/metrics.md"  # a gauge has no buckets
    ]
    assert len(problems("sum by (engine) (narwhal_queue_depth)")) == 1


def test_the_dashboard_has_panels_with_queries() -> None:
    doc = json.loads(DASHBOARD.read_text())
    assert doc["panels"], "no panels"
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    assert len(dashboard_exprs()) >= len(doc["panels"])


def test_the_alert_rules_cover_the_issue_and_are_complete() -> None:
    rules = alert_rules()
    names = {r["alert"] for r in rules}
    assert {
        "NarwhalMonitorDegraded",
        "NarwhalNoCapacity",
        "NarwhalLeaseFlapping",
        "NarwhalEjectionStorm",
    } <= names
    for rule in rules:
        assert rule["labels"]["severity"] in {"critical", "warning"}, rule
        assert rule["annotations"]["summary"], rule


def test_an_alert_fires_when_no_router_reports_at_all() -> None:
    """The other rules need routers' series to fire: with every router gone (or unscraped)
    only an `absent` rule on a metric every router exports from the start can."""
    (rule,) = [r for r in alert_rules() if r["alert"] == "NarwhalNoRouterReporting"]
    assert re.fullmatch(r"absent(_over_time)?\(narwhal_ready(\[\w+\])?\)", rule["expr"].strip())
    assert rule["labels"]["severity"] == "critical"
    assert documented()["narwhal_ready"]["labels"] == frozenset(), "one series per router"


def documented_alerts() -> dict[str, str]:
    """docs/metrics.md's alert table: alert -> severity."""
    text = (ROOT / "docs" / "metrics.md").read_text()
    return dict(re.findall(r"^\| `(Narwhal\w+)` \| (\w+) \|", text, re.M))


def test_the_docs_alert_table_is_the_rules() -> None:
    rules = {r["alert"]: r["labels"]["severity"] for r in alert_rules()}
    assert documented_alerts() == rules
