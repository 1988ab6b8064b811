"""Render deploy/helm/narwhal with Helm's own template engine, without a `helm` binary.

The helm binary's download site is not reachable from the machines this project runs on, so
the tests use Helm's Go SDK (v4) as a library: PyPI's `helm-python-sdk`, a ctypes binding to
a C ABI over the official SDK. `Chart.render` is what `helm template` does (Go templates,
Sprig, `.Files`, `include`, `required`/`fail`, `lookup` returning nothing), and `lint` is
`helm lint`.

The Go runtime is loaded in a child process (`python -m tests.deploy.helm_render`), never in
the pytest process: it stays out of the signal handling and forking of the other tests.

    python -m tests.deploy.helm_render < request.json > answer.json

request: {"chart": DIR, "release": NAME, "namespace": NS, "kube_version": "v1.xx.0",
          "cases": {CASE: VALUES}}
answer:  {"lint": {...}, "cases": {CASE: {"manifests": {TEMPLATE: TEXT}} | {"error": TEXT}}}
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "narwhal"


def render(
    cases: dict[str, dict[str, Any]],
    *,
    release: str = "edge",
    namespace: str = "inference",
    kube_version: str = "v1.37.0",
) -> dict[str, Any]:
    """Render every case (values) in one child process; see the module docstring."""
    request = {
        "chart": str(CHART),
        "release": release,
        "namespace": namespace,
        "kube_version": kube_version,
        "cases": cases,
    }
    proc = subprocess.run(
        [sys.executable, "-m", "tests.deploy.helm_render"],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"helm_render failed ({proc.returncode}): {proc.stderr}")
    answer: dict[str, Any] = json.loads(proc.stdout)
    return answer


def _main() -> int:
    import helm_python as helm

    request = json.load(sys.stdin)
    chart_dir = request["chart"]
    answer: dict[str, Any] = {"helm_sdk": helm.helm_sdk_version(), "cases": {}}
    for case, values in request["cases"].items():
        try:
            with helm.Chart.load(chart_dir) as chart:
                manifests = chart.render(
                    values,
                    name=request["release"],
                    namespace=request["namespace"],
                    is_install=True,
                )
            answer["cases"][case] = {"manifests": manifests}
        except helm.HelmError as exc:
            answer["cases"][case] = {"error": str(exc)}
    first = next(iter(request["cases"].values()), {})
    answer["lint"] = helm.lint(
        chart_dir,
        first,
        strict=True,
        namespace=request["namespace"],
        kube_version=request["kube_version"],
    )
    json.dump(answer, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
