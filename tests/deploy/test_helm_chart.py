"""deploy/helm/narwhal: rendered by Helm's own template engine, checked three ways.

1. Every rendered object validates against the Kubernetes OpenAPI schemas that PyPI's
   `kubernetes-validate` ships, in strict mode (an unknown field is an error), for the oldest
   Kubernetes the chart admits (Chart.yaml `kubeVersion`, 1.27) and the newest shipped (1.37).
   The Prometheus Operator's ServiceMonitor and PrometheusRule are CRDs, outside those
   schemas: they are parsed and their apiVersion, kind and content checked here.
2. Every router's narwhal YAML in the ConfigMap is accepted by Narwhal's own loader
   (`narwhal.config.load_config`) and by `narwhal-serve`'s start-up checks, and agrees with
   the StatefulSet around it (pod names, port, token variable, writable state paths, the
   pair's peer URLs).
3. The chart's wiring: probes, selectors, the dashboard and the alert rules unchanged.

Rendering: `tests/deploy/helm_render.py` (Helm's Go SDK through `helm-python-sdk`, in a child
process), plus `helm lint --strict`. The helm binary's download site is not reachable here.

The discovery variant (`discovery.dns` set) renders a `discovery:` section and no `engines`;
the loader must accept it as rendered, with every `dns` entry as the values gave it.

Config changes (`configChange.mode`): with `reload` (the default) each router watches its
file and the pod template carries the checksum of only what a reload cannot apply; a table of
one-value changes holds the chart to Narwhal's own `reload_changes`: the pods roll exactly when
the rendered configs differ in a key that needs a restart. With `restart` every change rolls.
"""

from __future__ import annotations

import base64
import json
import platform
import re
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml

from narwhal.cli.serve import check_startable
from narwhal.config import load_config
from narwhal.control.reload import reload_changes
from tests.deploy.helm_render import CHART, REPO, render

if platform.machine() != "x86_64":  # helm-python-sdk publishes x86_64 wheels only
    pytest.importorskip("helm_python")

RELEASE = "edge"
NAMESPACE = "narwhal"
FULLNAME = f"{RELEASE}-narwhal"
KUBE_VERSIONS = ("1.27.0", "1.37.0")
CRDS = {
    "ServiceMonitor": "monitoring.coreos.com/v1",
    "PrometheusRule": "monitoring.coreos.com/v1",
}
EXAMPLES = REPO / "deploy" / "examples"
DOCKERFILE = REPO / "deploy" / "Dockerfile"

ENGINES = [
    {"id": "p0", "url": "http://vllm-prefill-0.vllm-prefill.inference:8000", "role": "prefill"},
    {"id": "d0", "url": "http://vllm-decode-0.vllm-decode.inference:8000", "role": "decode"},
]
# The two documented forms for a Service with an HTTP and a NIXL port: the named port's SRV
# name, and the plain name with the HTTP port (docs/membership.md#discovery).
DNS = [
    {
        "name": "_http._tcp.vllm-prefill.inference.svc.cluster.local",
        "role": "prefill",
        "kv_role": "kv_producer",
    },
    {
        "name": "vllm-decode.inference.svc.cluster.local",
        "port": 8000,
        "role": "decode",
        "kv_role": "kv_consumer",
    },
]
BASE = {"model": "qwen3-0.6b", "adminToken": {"value": "s3cret-token"}}
ETCD = {
    "backend": "etcd",
    "endpoints": ["http://etcd-0.etcd.narwhal.svc.cluster.local:2379"],
}

GOOD: dict[str, dict[str, Any]] = {
    # The defaults: one router, file lease, static engines.
    "single": {**BASE, "engines": ENGINES},
    # Everything optional on: the etcd pair, discovery, persistence, Prometheus Operator.
    "pair-discovery": {
        **BASE,
        "discovery": {"interval_s": 10, "grace_s": 60, "dns": DNS},
        "config": {"lease": ETCD, "serving": {"workers": 4, "shutdown_grace_s": 12.5}},
        "persistence": {"enabled": True, "storageClassName": "fast"},
        "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
        "prometheusRule": {"enabled": True},
        "grafanaDashboard": {"folder": "LLM serving"},
        "imagePullSecrets": [{"name": "regcred"}],
        "extraArgs": ["--log-level", "DEBUG"],
        "extraEnv": [{"name": "TZ", "value": "UTC"}],
    },
    # The pair with static engines; no lease-less extras.
    "pair-static": {**BASE, "engines": ENGINES, "config": {"lease": ETCD}},
    # One router without a lease, an existing Secret, the optional objects off.
    "single-minimal": {
        "model": "qwen3-0.6b",
        "engines": ENGINES,
        "adminToken": {"existingSecret": "narwhal-admin", "existingSecretKey": "admin"},
        "config": {"lease": {"backend": "none"}},
        "podDisruptionBudget": {"enabled": False},
        "grafanaDashboard": {"enabled": False},
        "serviceAccount": {"create": False},
        "preStopSleepSeconds": 0,
        "resume": False,
    },
    # Every config change rolls the pods; no file watch.
    "single-restart": {**BASE, "engines": ENGINES, "configChange": {"mode": "restart"}},
    # The documented examples, as they are.
    "example-single": yaml.safe_load((EXAMPLES / "values-single.yaml").read_text()),
    "example-pair": yaml.safe_load((EXAMPLES / "values-pair.yaml").read_text()),
}

BAD: dict[str, tuple[dict[str, Any], str]] = {
    "no-model": ({"adminToken": {"value": "t"}, "engines": ENGINES}, "model is required"),
    "no-token": ({"model": "m", "engines": ENGINES}, "adminToken.value or"),
    "no-fleet": ({**BASE}, "give the fleet"),
    "etcd-without-endpoints": (
        {**BASE, "engines": ENGINES, "config": {"lease": {"backend": "etcd"}}},
        "config.lease.endpoints is required",
    ),
    "owned-key": (
        {**BASE, "engines": ENGINES, "config": {"listen": "127.0.0.1:1"}},
        "config.listen is set by the chart",
    ),
    "owned-watch-interval": (
        {**BASE, "engines": ENGINES, "config": {"controller": {"config_watch_interval_s": 1}}},
        "config.controller.config_watch_interval_s is set by the chart",
    ),
    "config-change-mode": (
        {**BASE, "engines": ENGINES, "configChange": {"mode": "rollout"}},
        'configChange.mode must be reload or restart, got "rollout"',
    ),
    "config-change-interval": (
        {**BASE, "engines": ENGINES, "configChange": {"mode": "reload", "watchIntervalSeconds": 0}},
        "configChange.watchIntervalSeconds must be a number of seconds > 0",
    ),
    "owned-active-url": (
        {
            **BASE,
            "engines": ENGINES,
            "config": {"lease": ETCD, "standby": {"active_url": "http://x:1"}},
        },
        "config.standby.active_url is set by the chart",
    ),
}


# One value changed from VARIANT_BASE at a time (Helm merges each into the chart's defaults),
# with `configChange.mode` reload: hot keys, keys that size what was built at start, keys the
# chart derives (listen from containerPort), the watch interval itself.
VARIANT_BASE: dict[str, Any] = {**BASE, "engines": ENGINES}
MOVED_D0 = {**ENGINES[1], "url": "http://vllm-decode-1.vllm-decode.inference:8000"}
VARIANTS: dict[str, dict[str, Any]] = {
    "model": {"model": "other-model"},
    "engines": {"engines": [ENGINES[0], MOVED_D0]},
    "discovery": {"engines": [], "discovery": {"dns": DNS}},
    "serving.request_timeout_s": {"config": {"serving": {"request_timeout_s": 90}}},
    "serving.policy": {"config": {"serving": {"policy": "bounded"}}},
    "serving.workers": {"config": {"serving": {"workers": 3}}},
    "serving.max_connections": {"config": {"serving": {"max_connections": 100}}},
    "engine.health_timeout_s": {"config": {"engine": {"health_timeout_s": 2.5}}},
    "engine.control_connections": {"config": {"engine": {"control_connections": 4}}},
    "recovery.eject_after": {"config": {"recovery": {"eject_after": 5}}},
    "logging.access": {"config": {"logging": {"access": True}}},
    "controller.monitor_interval_s": {"config": {"controller": {"monitor_interval_s": 2}}},
    "lease.ttl_s": {"config": {"lease": {"ttl_s": 20}}},
    "handoff.path": {"config": {"handoff": {"path": "state/other.json"}}},
    "watch-interval": {"configChange": {"watchIntervalSeconds": 2}},
    "containerPort": {"containerPort": 9090},
}


def _variants() -> dict[str, dict[str, Any]]:
    cases = {"variant-base": VARIANT_BASE}
    cases.update({f"variant-{name}": {**VARIANT_BASE, **v} for name, v in VARIANTS.items()})
    restart = {**VARIANT_BASE, "configChange": {"mode": "restart"}}
    cases["restart-base"] = restart
    cases["restart-hot"] = {**restart, **VARIANTS["serving.request_timeout_s"]}
    return cases


@pytest.fixture(scope="module")
def rendered() -> dict[str, Any]:
    cases = {**GOOD, **{name: values for name, (values, _) in BAD.items()}, **_variants()}
    return render(cases, release=RELEASE, namespace=NAMESPACE)


def objects(rendered: dict[str, Any], case: str) -> list[dict[str, Any]]:
    answer = rendered["cases"][case]
    assert "error" not in answer, answer.get("error")
    docs = []
    for template, text in sorted(answer["manifests"].items()):
        if template.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc is not None:
                doc["__template"] = template
                docs.append(doc)
    return docs


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, (kind, name, [d["metadata"]["name"] for d in found])
    return found[0]


def strip(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k != "__template"}


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod = one(docs, "StatefulSet")["spec"]["template"]["spec"]
    (narwhal,) = pod["containers"]
    return narwhal


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# -- 1. Kubernetes schemas ---------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(GOOD))
def test_every_object_validates_against_the_kubernetes_schemas(
    rendered: dict[str, Any], case: str
) -> None:
    docs = objects(rendered, case)
    assert docs
    for doc in docs:
        if doc["kind"] in CRDS:
            continue  # CRDs: test_the_prometheus_operator_objects_are_well_formed
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(strip(doc), version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{doc['__template']} {doc['kind']} on {version}: {exc.message}")


@pytest.mark.parametrize("manifest", ["vllm-pd.yaml", "etcd.yaml"])
def test_the_example_manifests_validate_against_the_kubernetes_schemas(manifest: str) -> None:
    docs = [d for d in yaml.safe_load_all((EXAMPLES / manifest).read_text()) if d]
    assert docs
    for doc in docs:
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_examples_discover_each_engine_by_its_http_port() -> None:
    """vllm-pd.yaml's Services expose `http` and `nixl`; values-pair.yaml must pick the HTTP
    port of each (the named port's SRV name, or `port`), or a pod would be found twice."""
    services = {
        (d["metadata"]["name"], d["metadata"]["namespace"]): {
            p["name"]: p for p in d["spec"]["ports"]
        }
        for d in yaml.safe_load_all((EXAMPLES / "vllm-pd.yaml").read_text())
        if d and d["kind"] == "Service"
    }
    assert services and all({"http", "nixl"} <= set(ports) for ports in services.values())
    dns = GOOD["example-pair"]["discovery"]["dns"]
    assert {e["role"] for e in dns} == {"prefill", "decode"}
    for entry in dns:
        named = entry["name"].startswith("_http._tcp.")
        service, namespace = entry["name"].removeprefix("_http._tcp.").split(".")[:2]
        ports = services[(service, namespace)]
        assert named or entry.get("port") == ports["http"]["port"], entry


def test_the_prometheus_operator_objects_are_well_formed(rendered: dict[str, Any]) -> None:
    docs = objects(rendered, "pair-discovery")
    monitor = one(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == CRDS["ServiceMonitor"]
    assert monitor["metadata"]["labels"]["release"] == "prom"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    # It scrapes through the Service that publishes not-ready pods: the standby too.
    services = [d for d in docs if d["kind"] == "Service"]
    scraped = [
        s
        for s in services
        if matches(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
    ]
    assert [s["spec"].get("publishNotReadyAddresses") for s in scraped] == [True]
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]

    rule = one(docs, "PrometheusRule")
    assert rule["apiVersion"] == CRDS["PrometheusRule"]
    alerts = yaml.safe_load((REPO / "deploy" / "prometheus-alerts.yaml").read_text())
    assert rule["spec"] == alerts  # unchanged, {{ $labels }} included

    plain = objects(rendered, "single")
    assert not [d for d in plain if d["kind"] in CRDS], "CRDs must be opt-in"


# -- 2. The narwhal YAML in the ConfigMap ------------------------------------------------


def router_configs(docs: list[dict[str, Any]]) -> dict[str, str]:
    return one(docs, "ConfigMap", f"{FULLNAME}-config")["data"]


def workdir() -> PurePosixPath:
    """The image's working directory, which relative state paths resolve against."""
    dirs = re.findall(r"^WORKDIR\s+(\S+)", DOCKERFILE.read_text(), flags=re.M)
    return PurePosixPath(dirs[-1])


def load(tmp_path: Path, name: str, data: dict[str, Any] | str) -> Any:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return load_config(path)


@pytest.mark.parametrize("case", sorted(GOOD))
def test_each_router_config_is_accepted_by_narwhals_loader(
    rendered: dict[str, Any], case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = objects(rendered, case)
    configs = router_configs(docs)
    sts = one(docs, "StatefulSet")
    replicas = sts["spec"]["replicas"]
    assert sorted(configs) == [f"{FULLNAME}-{i}.yaml" for i in range(replicas)]
    monkeypatch.setenv("NARWHAL_ADMIN_TOKEN", "from-the-secret")
    for name, text in configs.items():
        data = yaml.safe_load(text)
        config = load(tmp_path, name, text)  # the file as rendered, strict loader
        if "discovery" in data:
            assert not config.engines, "discovery and static engines are exclusive"
            written = data["discovery"]["dns"]
            loaded = config.discovery.dns
            assert len(loaded) == len(written)
            for source, entry in zip(loaded, written, strict=True):
                assert source.model_dump(mode="json", include=set(entry)) == entry
        assert config.router_id == name.removesuffix(".yaml")  # = the pod name
        assert check_startable(config) == []  # token set, listening off loopback


@pytest.mark.parametrize("case", sorted(GOOD))
def test_the_router_configs_agree_with_the_statefulset(rendered: dict[str, Any], case: str) -> None:
    docs = objects(rendered, case)
    values = GOOD[case]
    sts = one(docs, "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    narwhal = container(docs)
    configs = {k: yaml.safe_load(v) for k, v in router_configs(docs).items()}
    port = next(p["containerPort"] for p in narwhal["ports"] if p["name"] == "http")

    # Each pod reads its own file: --config /etc/narwhal/$(POD_NAME).yaml, POD_NAME from the API.
    args = narwhal["args"]
    assert args[args.index("--config") + 1] == "/etc/narwhal/$(POD_NAME).yaml"
    env = {e["name"]: e for e in narwhal["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    mounts = {m["mountPath"]: m for m in narwhal["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/etc/narwhal"]["name"]]["configMap"]["name"] == f"{FULLNAME}-config"
    # A directory mount: kubelet updates it in place (a subPath mount is never updated).
    assert "subPath" not in mounts["/etc/narwhal"]
    assert ("--resume" in args) == values.get("resume", True)

    # Config changes: reloaded in place by a file watch, or a roll on every change.
    annotations = sts["spec"]["template"]["metadata"]["annotations"]
    assert "checksum/admin-token" in annotations  # a new token always rolls: it is an env var
    watches = {c.get("controller", {}).get("config_watch_interval_s") for c in configs.values()}
    if values.get("configChange", {}).get("mode", "reload") == "reload":
        assert watches == {values.get("configChange", {}).get("watchIntervalSeconds", 5)}
        assert "checksum/restart-config" in annotations and "checksum/config" not in annotations
    else:
        assert watches == {None}
        assert "checksum/config" in annotations and "checksum/restart-config" not in annotations

    # The admin token: the variable the config names, from the Secret.
    token_env = {c["admin"]["token_env"] for c in configs.values()}
    assert token_env == {"NARWHAL_ADMIN_TOKEN"}
    ref = env["NARWHAL_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    token = values["adminToken"]
    if token.get("existingSecret"):
        key = token.get("existingSecretKey", "token")
        assert ref == {"name": token["existingSecret"], "key": key}
        assert not [d for d in docs if d["kind"] == "Secret"]
    else:
        secret = one(docs, "Secret", ref["name"])
        assert base64.b64decode(secret["data"][ref["key"]]).decode() == token["value"]

    writable = [
        PurePosixPath(path)
        for path, m in mounts.items()
        if not m.get("readOnly") and ("emptyDir" in volumes.get(m["name"], {}) or _claimed(sts, m))
    ]
    assert PurePosixPath("/tmp") in writable  # the workers' runtime directory
    for name, cfg in configs.items():
        assert cfg["listen"] == f"0.0.0.0:{port}"
        assert cfg["model"] == values["model"]
        # State paths resolve against the image's WORKDIR; they must land on a writable volume
        # (the root filesystem is read-only).
        lease = cfg.get("lease", {})
        state = [cfg.get("handoff", {}).get("path", "state/handoff.json")]
        if lease and lease.get("backend", "file") == "file":
            state.append(lease.get("path", "state/lease.json"))
        for path in state:
            full = workdir() / path
            assert any(full.is_relative_to(w) for w in writable), (name, full, writable)

    if sts["spec"]["replicas"] == 2:  # the pair: each router watches the other's /ready
        headless = sts["spec"]["serviceName"]
        for i in (0, 1):
            cfg = configs[f"{FULLNAME}-{i}.yaml"]
            peer = f"{FULLNAME}-{1 - i}.{headless}.{NAMESPACE}.svc.cluster.local:{port}"
            assert cfg["standby"]["active_url"] == f"http://{peer}"
            assert cfg["lease"]["backend"] == "etcd"
        assert one(docs, "Service", headless)["spec"]["publishNotReadyAddresses"] is True
        assert sts["spec"]["updateStrategy"]["type"] == "OnDelete"
        assert "podAntiAffinity" in pod["affinity"]
    else:
        assert all("standby" not in c for c in configs.values())
        assert sts["spec"]["updateStrategy"]["type"] == "RollingUpdate"


def _claimed(sts: dict[str, Any], mount: dict[str, Any]) -> bool:
    claims = sts["spec"].get("volumeClaimTemplates", [])
    return any(c["metadata"]["name"] == mount["name"] for c in claims)


def test_the_rendered_config_shapes(rendered: dict[str, Any]) -> None:
    """Static engines verbatim, or exactly the discovery section; never both."""
    single = yaml.safe_load(router_configs(objects(rendered, "single"))[f"{FULLNAME}-0.yaml"])
    assert single["engines"] == ENGINES and "discovery" not in single
    pair = router_configs(objects(rendered, "pair-discovery"))
    for text in pair.values():
        cfg = yaml.safe_load(text)
        assert cfg["discovery"] == {"interval_s": 10, "grace_s": 60, "dns": DNS}
        assert "engines" not in cfg
        assert cfg["serving"] == {"workers": 4, "shutdown_grace_s": 12.5}
    sts = one(objects(rendered, "pair-discovery"), "StatefulSet")
    # shutdown_grace_s 12.5 -> 13, + preStop 5, + 10.
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 28


def _pod_annotations(rendered: dict[str, Any], case: str) -> dict[str, str]:
    sts = one(objects(rendered, case), "StatefulSet")
    annotations: dict[str, str] = sts["spec"]["template"]["metadata"]["annotations"]
    return annotations


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_with_reload_the_pods_roll_exactly_for_what_a_reload_cannot_apply(
    rendered: dict[str, Any], variant: str, tmp_path: Path
) -> None:
    """Narwhal's own `reload_changes` between the rendered configs decides: a change it
    applies in place leaves the pod template alone (the routers reload the new file), a
    change it reports as needing a restart changes the template's checksum (a roll)."""
    name = f"{FULLNAME}-0.yaml"
    before = load(tmp_path, "before.yaml", router_configs(objects(rendered, "variant-base"))[name])
    case = f"variant-{variant}"
    after = load(tmp_path, "after.yaml", router_configs(objects(rendered, case))[name])
    changes = reload_changes(before, after)
    assert changes.applied or changes.restart_required, "the variant changes nothing"
    key = "checksum/restart-config"
    rolls = _pod_annotations(rendered, case)[key] != _pod_annotations(rendered, "variant-base")[key]
    assert rolls == bool(changes.restart_required), changes.to_json()


def test_with_restart_every_config_change_rolls_the_pods(rendered: dict[str, Any]) -> None:
    base = _pod_annotations(rendered, "restart-base")
    hot = _pod_annotations(rendered, "restart-hot")  # a key a reload would apply in place
    assert base["checksum/config"] != hot["checksum/config"]
    assert base["checksum/admin-token"] == hot["checksum/admin-token"]


@pytest.mark.parametrize("case", sorted(BAD))
def test_the_chart_refuses_bad_values_with_a_message(rendered: dict[str, Any], case: str) -> None:
    answer = rendered["cases"][case]
    assert "manifests" not in answer
    assert BAD[case][1] in answer["error"]


# -- 3. Wiring -----------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(GOOD))
def test_probes_services_and_disruption_budget(rendered: dict[str, Any], case: str) -> None:
    docs = objects(rendered, case)
    sts = one(docs, "StatefulSet")
    narwhal = container(docs)
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert matches(sts["spec"]["selector"]["matchLabels"], pod_labels)

    assert narwhal["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert narwhal["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert narwhal["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}

    client = one(docs, "Service", FULLNAME)
    assert matches(client["spec"]["selector"], pod_labels)
    assert not client["spec"].get("publishNotReadyAddresses")  # Ready routers only
    assert client["spec"]["ports"][0]["targetPort"] == "http"

    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    if GOOD[case].get("podDisruptionBudget", {}).get("enabled", True):
        (pdb,) = pdbs
        assert matches(pdb["spec"]["selector"]["matchLabels"], pod_labels)
        assert pdb["spec"]["minAvailable"] == 1
        assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    else:
        assert pdbs == []


@pytest.mark.parametrize("case", sorted(GOOD))
def test_the_pod_runs_as_the_images_unprivileged_user(rendered: dict[str, Any], case: str) -> None:
    docs = objects(rendered, case)
    pod = one(docs, "StatefulSet")["spec"]["template"]["spec"]
    user = re.findall(r"^USER\s+(\d+)", DOCKERFILE.read_text(), flags=re.M)[-1]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == int(user)
    assert pod["automountServiceAccountToken"] is False
    sc = container(docs)["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]


def test_the_grafana_dashboard_configmap_is_the_dashboard(rendered: dict[str, Any]) -> None:
    docs = objects(rendered, "pair-discovery")
    cm = one(docs, "ConfigMap", f"{FULLNAME}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"  # the sidecar's default label
    assert cm["metadata"]["annotations"]["grafana_folder"] == "LLM serving"
    (key,) = cm["data"]
    assert key.endswith(".json")
    dashboard = json.loads((REPO / "deploy" / "grafana-dashboard.json").read_text())
    assert json.loads(cm["data"][key]) == dashboard
    # The chart reads the files in deploy/ itself (symlinks), so they cannot drift apart.
    for name in ("grafana-dashboard.json", "prometheus-alerts.yaml"):
        link = CHART / "files" / name
        assert link.is_symlink() and link.resolve() == (REPO / "deploy" / name).resolve()


def test_helm_lint_strict_finds_nothing(rendered: dict[str, Any]) -> None:
    lint = rendered["lint"]
    assert lint["errors"] == []
    worse_than_info = [m for m in lint["messages"] if m["severity"] >= 2]
    assert worse_than_info == []
