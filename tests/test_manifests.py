"""deploy/kubernetes rendered with `kubectl kustomize`, every object checked against the Kubernetes API's
types (the official client's models: a field they do not know is dropped, so a misspelt one shows) and
the InferencePool against its CRD's schema; the brain's config in them loads."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from kubernetes import client

from extproc.config import parse_config

ROOT = Path(__file__).resolve().parents[1]
OVERLAYS = ["gateway", "standalone", "brains"]
KINDS = {("v1", "ServiceAccount"): "V1ServiceAccount", ("v1", "Service"): "V1Service",
         ("v1", "ConfigMap"): "V1ConfigMap", ("apps/v1", "Deployment"): "V1Deployment",
         ("rbac.authorization.k8s.io/v1", "Role"): "V1Role",
         ("rbac.authorization.k8s.io/v1", "RoleBinding"): "V1RoleBinding"}
POOL_SCHEMA = yaml.safe_load((ROOT / "tests" / "fixtures" / "inferencepool-v1.schema.yaml").read_text())


def render(overlay: str) -> list[dict]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (make system-deps installs Debian's kubernetes-client)")
    out = subprocess.run(["kubectl", "kustomize", str(ROOT / "deploy" / "kubernetes" / overlay)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _strip_nulls(x):
    if isinstance(x, dict):
        return {k: _strip_nulls(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_strip_nulls(v) for v in x]
    return x


def check_object(doc: dict) -> None:
    key = (doc["apiVersion"], doc["kind"])
    if key == ("inference.networking.k8s.io/v1", "InferencePool"):
        jsonschema.validate(doc, POOL_SCHEMA)
        ref = doc["spec"]["endpointPickerRef"]
        # the CRD's CEL rule: a Service (the default kind) needs its port
        assert ref.get("kind", "Service") != "Service" or "port" in ref
        return
    assert key in KINDS, f"no check for {key}"
    api = client.ApiClient()
    obj = api.deserialize(json.dumps(doc), KINDS[key], "application/json")  # required fields, types: ValueError
    assert _strip_nulls(api.sanitize_for_serialization(obj)) == doc, f"{doc['kind']} {doc['metadata']['name']}: a field the API does not have"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid_against_the_api(overlay):
    docs = render(overlay)
    for doc in docs:
        check_object(doc)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding", "ConfigMap"} <= kinds


def test_a_misspelt_field_is_caught():
    doc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
           "spec": {"selector": {"a": "b"}, "ports": [{"port": 1, "targtPort": 2}]}}
    with pytest.raises(AssertionError, match="a field the API does not have"):
        check_object(doc)
    pool = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "gateway" / "inferencepool.yaml").read_text())
    pool["spec"]["targetPorts"] = [{"number": 70000}]
    with pytest.raises(jsonschema.ValidationError):
        check_object(pool)


def test_the_gateway_variant_points_its_pool_at_the_brain_and_fails_open():
    docs = render("gateway")
    pool = next(d for d in docs if d["kind"] == "InferencePool")
    svc = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == pool["spec"]["endpointPickerRef"]["name"])
    grpc = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] == grpc["port"]
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    cfg = brain_config(docs)
    assert cfg.brain.protocol == "endpoint-picker" and cfg.brain.grpc_port == grpc["port"]
    assert cfg.discovery.source == "kubernetes" and cfg.discovery.inference_pool == pool["metadata"]["name"]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["serviceAccountName"] == "warmroute"
    rules = next(d for d in docs if d["kind"] == "Role")["rules"]
    assert {r for rule in rules for r in rule["resources"]} == {"pods", "inferencepools", "endpointslices"}
    assert all(set(rule["verbs"]) <= {"get", "list", "watch"} for rule in rules)  # discovery only reads


def test_the_standalone_variant_runs_envoy_on_the_rendered_bootstrap():
    from extproc.envoy_config import bootstrap, dump

    docs = render("standalone")
    cfg = brain_config(docs)
    assert cfg.discovery.source == "dns"
    boot = next(d for d in docs if d["kind"] == "ConfigMap" and "envoy-bootstrap.yaml" in d["data"])
    assert yaml.safe_load(boot["data"]["envoy-bootstrap.yaml"]) == yaml.safe_load(dump(bootstrap(cfg)))
    headless = next(d for d in docs if d["kind"] == "Service" and d["spec"].get("clusterIP") == "None")
    assert headless["metadata"]["name"] == cfg.discovery.dns_name


def test_the_brains_variant_runs_two_pickers_sharing_state_through_its_redis():
    from urllib.parse import urlsplit

    docs = render("brains")
    dep = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "warmroute")
    assert dep["spec"]["replicas"] == 2
    cfg = brain_config(docs)
    assert cfg.brain.protocol == "endpoint-picker" and cfg.shared_state.redis_url
    u = urlsplit(cfg.shared_state.redis_url)
    svc = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == u.hostname)
    assert u.port in [p["port"] for p in svc["spec"]["ports"]]
    redis = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == u.hostname)
    assert svc["spec"]["selector"].items() <= redis["spec"]["template"]["metadata"]["labels"].items()
    # the password file the config names is the mounted secret's key, and Redis requires the same secret
    pod = dep["spec"]["template"]["spec"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if cfg.shared_state.password_file.startswith(m["mountPath"]))
    vol = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    key = cfg.shared_state.password_file[len(mount["mountPath"]):].strip("/")
    env = redis["spec"]["template"]["spec"]["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"]
    assert (vol["secret"]["secretName"], key) == (env["name"], env["key"])


def brain_config(docs):
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and "warmroute.yaml" in d["data"])
    return parse_config(yaml.safe_load(cm["data"]["warmroute.yaml"]))
