"""deploy/kubernetes/: the base and its overlays (endpoint picker, autoscaling with KEDA or an
HPA), rendered by kustomize (`kubectl kustomize`, as `kubectl apply -k` renders them), every
object of a built-in kind (the HPA among them) validated against the Kubernetes API's schemas by
kubernetes-validate (strict: an unknown field fails), the config and keys they carry checked by
`bouncer config check`, the custom resources (ServiceMonitor, PrometheusRule, InferencePool,
HTTPRoute, ScaledObject) checked against what they point at, and the autoscalers' queries checked
by promtool against the metric the gateway exports."""

from __future__ import annotations

import base64
import pathlib
import re
import shutil
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from bouncer.cli import build_parser

ROOT = pathlib.Path(__file__).resolve().parent.parent
KUBE = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.33"  # gRPC probes (1.27) and preStop sleep (1.30) are GA here
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule", "InferencePool", "HTTPRoute", "ScaledObject"}
OVERLAYS = ["base", "overlays/endpoint-picker", "overlays/autoscaling-keda", "overlays/autoscaling-hpa"]


def render(where: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl missing: `make system-tools` installs Debian's kubernetes-client"
    out = subprocess.run([kubectl, "kustomize", str(KUBE / where)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(request.param)


def test_every_built_in_object_is_valid_for_the_kubernetes_api(rendered):
    where, docs = rendered
    checked = 0
    for d in docs:
        if d["kind"] in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(d, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where}: {d['kind']} {d['metadata']['name']}: {exc.message} at "
                        f"{'.'.join(map(str, exc.path))}")
        checked += 1
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "Secret", "PodDisruptionBudget"} <= kinds
    assert checked == len([d for d in docs if d["kind"] not in CUSTOM_KINDS]) >= 8
    # the validator fails what is wrong: a field the API does not have
    bad = {**one(docs, "PodDisruptionBudget", "bouncer"), "spec": {"maxUnavailable": 1, "maxUnavaliable": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_the_config_and_keys_pass_bouncer_config_check(rendered, tmp_path):
    where, docs = rendered
    cms = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("bouncer-config")]
    secrets = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].startswith("bouncer-keys")]
    assert len(cms) == len(secrets) == 1
    config = yaml.safe_load(cms[0]["data"]["bouncer.yaml"])
    keys = base64.b64decode(secrets[0]["data"]["keys.yaml"])
    deployment = one(docs, "Deployment", "bouncer")
    pod = deployment["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    # the pod mounts what kustomize named (its content hash suffix), where the config looks
    assert volumes["config"]["configMap"]["name"] == cms[0]["metadata"]["name"]
    assert volumes["keys"]["secret"]["secretName"] == secrets[0]["metadata"]["name"]
    assert config["keys_file"] == f"{mounts['keys']}/keys.yaml"
    args = build_parser().parse_args(pod["containers"][0]["args"])
    assert args.config == f"{mounts['config']}/bouncer.yaml"
    (tmp_path / "keys.yaml").write_bytes(keys)
    (tmp_path / "bouncer.yaml").write_text(yaml.safe_dump({**config, "keys_file": str(tmp_path / "keys.yaml")}))
    check = subprocess.run([sys.executable, "-m", "bouncer", "config", "check", str(tmp_path / "bouncer.yaml")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    assert "found by dns A vllm-llama-3-1-8b" in check.stdout
    # the drain fits the pod's grace period, the probes are the gateway's
    assert config["listen"]["drain_s"] < pod["terminationGracePeriodSeconds"]
    container = pod["containers"][0]
    if where != "overlays/endpoint-picker":
        assert args.mode == "proxy"
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    else:
        assert args.mode == "epp"
        for probe, service in (("readinessProbe", "readiness"), ("livenessProbe", "liveness")):
            assert "httpGet" not in container[probe]
            assert container[probe]["grpc"] == {"port": config["picker"]["port"], "service": service}
    # several gateways share their state in the Redis the manifests run
    redis = one(docs, "Service", "bouncer-redis")
    assert config["shared_state"]["url"] == f"redis://bouncer-redis:{redis['spec']['ports'][0]['port']}/0"
    # the engines' headless Service is the name the discovery resolves
    engines = one(docs, "Service", config["models"][0]["discovery"]["dns"]["name"])
    assert engines["spec"]["clusterIP"] == "None"
    assert engines["spec"]["ports"][0]["port"] == config["models"][0]["discovery"]["dns"]["port"]


def test_the_custom_resources_point_at_what_runs(rendered):
    where, docs = rendered
    kinds = by_kind(docs)
    service = one(docs, "Service", "bouncer")
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    monitor = one(docs, "ServiceMonitor", "bouncer")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] in ports and monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    rule = one(docs, "PrometheusRule", "bouncer")
    shipped = yaml.safe_load((ROOT / "deploy/prometheus/bouncer-alerts.yaml").read_text())["groups"]
    assert rule["spec"]["groups"] == shipped  # and test_dashboards runs promtool on those rules
    budget = one(docs, "PodDisruptionBudget", "bouncer")
    deployment = one(docs, "Deployment", "bouncer")
    assert budget["spec"]["selector"]["matchLabels"].items() <= \
        deployment["spec"]["template"]["metadata"]["labels"].items()
    assert deployment["spec"]["replicas"] >= 2 > budget["spec"]["maxUnavailable"]
    if where != "overlays/endpoint-picker":
        assert "InferencePool" not in kinds
        return
    pool = one(docs, "InferencePool", "llama-3-1-8b")
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == service["metadata"]["name"] and ref["port"]["number"] == ports["grpc"]
    engines = one(docs, "Service", "vllm-llama-3-1-8b")
    assert pool["spec"]["selector"]["matchLabels"] == engines["spec"]["selector"]
    assert pool["spec"]["targetPorts"][0]["number"] == engines["spec"]["ports"][0]["port"]
    route = one(docs, "HTTPRoute", "llama-3-1-8b")
    assert route["spec"]["rules"][0]["backendRefs"][0]["name"] == pool["metadata"]["name"]


def test_the_prometheus_rule_is_the_shipped_rules():
    out = subprocess.run([sys.executable, str(ROOT / "scripts/prometheus_rule.py"), "--check"], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr


def _config(docs: list[dict]) -> dict:
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("bouncer-config")]
    return yaml.safe_load(cm["data"]["bouncer.yaml"])


def _promql_is_valid(expr: str, tmp_path) -> None:
    """promtool parses it (as a recording rule's expression: promtool has no query linter)."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: `make system-tools` installs Debian's prometheus"
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "check", "rules": [{"record": "check:x", "expr": expr}]}]}))
    out = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True)
    assert out.returncode == 0, f"{expr}: {out.stdout}{out.stderr}"


def _exported_metrics() -> set[str]:
    text = (ROOT / "docs/reference/metrics.md").read_text()  # written from the collectors (test_reference)
    return set(re.findall(r"`(bouncer_[a-z_]+)`", text))


def test_keda_scales_the_engines_from_zero_on_the_demand_gauge(tmp_path):
    docs = render("overlays/autoscaling-keda")
    config = _config(docs)
    model = config["models"][0]
    scaled = one(docs, "ScaledObject", "vllm-llama-3-1-8b")["spec"]
    # it scales the engines the discovery finds: the Deployment behind the headless Service, by name
    assert scaled["scaleTargetRef"]["name"] == model["discovery"]["dns"]["name"]
    # from zero: the gateway holds a request while the first replica starts, longer than a start
    assert scaled["minReplicaCount"] == 0 and model["hold_without_replicas_s"] >= 180
    (trigger,) = scaled["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    query = trigger["metadata"]["query"]
    assert query == f'sum(avg_over_time(bouncer_demand_replicas{{model="{model["name"]}",scope="all"}}[5m]))'
    assert "bouncer_demand_replicas" in _exported_metrics()
    _promql_is_valid(query, tmp_path)
    # a request held at zero (the gauge at 0.5) wakes it at the first scrape that sees it, averaged
    # with 5 minutes of zeros scraped every 15 s; a replica is planned below its full batch
    assert 0 < float(trigger["metadata"]["activationThreshold"]) < 0.5 / (300 / 15)
    assert 0.5 <= float(trigger["metadata"]["threshold"]) <= 1


def test_the_hpa_scales_the_engines_on_the_demand_gauge_through_the_adapter(tmp_path):
    docs = render("overlays/autoscaling-hpa")
    model = _config(docs)["models"][0]
    hpa = one(docs, "HorizontalPodAutoscaler", "vllm-llama-3-1-8b")["spec"]
    assert hpa["scaleTargetRef"]["name"] == model["discovery"]["dns"]["name"] and hpa["minReplicas"] >= 1
    (metric,) = hpa["metrics"]
    external = metric["external"]
    assert metric["type"] == "External" and external["metric"]["name"] == "bouncer_demand_replicas"
    assert external["metric"]["selector"]["matchLabels"] == {"model": model["name"], "scope": "all"}
    # AverageValue: replicas = ceil(metric / target), the demand read as replicas
    assert external["target"]["type"] == "AverageValue"
    # prometheus-adapter's rule serves that name, summed over the gateways; its query once
    # templated (as the adapter fills it in) is valid PromQL
    adapter = yaml.safe_load((KUBE / "overlays/autoscaling-hpa/adapter-rules.yaml").read_text())
    (rule,) = adapter["externalRules"]
    assert rule["seriesQuery"].startswith("bouncer_demand_replicas{")
    query = rule["metricsQuery"].replace("<<.Series>>", "bouncer_demand_replicas").replace(
        "<<.LabelMatchers>>", f'model="{model["name"]}",scope="all"')
    _promql_is_valid(query, tmp_path)
