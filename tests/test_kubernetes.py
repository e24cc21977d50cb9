"""deploy/kubernetes/: the base and the endpoint-picker overlay, rendered by kustomize (`kubectl
kustomize`, as `kubectl apply -k` renders them), every object of a built-in kind validated against
the Kubernetes API's schemas by kubernetes-validate (strict: an unknown field fails), the config
and keys they carry checked by `bouncer config check`, and the custom resources (ServiceMonitor,
PrometheusRule, InferencePool, HTTPRoute) checked against what they point at."""

from __future__ import annotations

import base64
import pathlib
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
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule", "InferencePool", "HTTPRoute"}


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


@pytest.fixture(scope="module", params=["base", "overlays/endpoint-picker"])
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
    if where == "base":
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
    if where == "base":
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
