"""compose.yaml cannot run here (no Docker engine): check it against what `warmroute up` runs."""

from __future__ import annotations

import argparse
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from extproc.config import load_config
from extproc.envoy_config import SHIPPED
from extproc.tools.mock.options import add_arguments
from extproc.tools.stack.local import mock_argv

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]


def mock_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd")
    add_arguments(ap)
    return ap.parse_args(argv)


def brain_config_path() -> Path:
    cmd = SERVICES["brain"]["command"]
    return ROOT / cmd[cmd.index("--config") + 1]


def test_same_topology_as_warmroute_up_envoy_brain_and_4_mock_replicas():
    replicas = sorted(n for n in SERVICES if n.startswith("r") and n != "redis")
    assert replicas == ["r0", "r1", "r2", "r3"]
    assert {"brain", "envoy"} <= set(SERVICES)


def test_each_replica_runs_the_mock_exactly_as_warmroute_up_does():
    cfg = load_config(brain_config_path())
    by_name = {r.name: r for r in cfg.replicas}
    for name in ("r0", "r1", "r2", "r3"):
        cmd = SERVICES[name]["command"]
        assert cmd[0] == "warmroute"
        got = mock_args(cmd[1:])
        want = mock_args(mock_argv(name, got.port))
        assert vars(got) | {"host": want.host} == vars(want)  # only the bind address differs
        assert got.host == "0.0.0.0"
        url = urlsplit(by_name[name].url)
        assert (url.hostname, url.port) == (name, got.port)  # the brain scrapes the service it runs


def test_the_brain_reads_the_compose_config_and_envoy_runs_its_rendered_bootstrap():
    cfg_path = brain_config_path()
    cfg = load_config(cfg_path)
    assert cfg.brain.host == "brain"
    cmd = SERVICES["brain"]["command"]
    assert cmd[:2] == ["warmroute", "brain"] and cmd[cmd.index("--host") + 1] == "0.0.0.0"
    rendered = SHIPPED[str(cfg_path.relative_to(ROOT))]
    mounts = SERVICES["envoy"]["volumes"]
    assert any(m.startswith(f"./{rendered}:/etc/envoy/envoy.yaml") for m in mounts)
    assert "/etc/envoy/envoy.yaml" in SERVICES["envoy"]["command"]
    assert SERVICES["envoy"]["ports"] == [f"{cfg.envoy.listen_port}:{cfg.envoy.listen_port}"]


def test_the_warmroute_services_run_the_image_built_from_the_dockerfile():
    for name in ("r0", "r1", "r2", "r3", "brain"):
        svc = SERVICES[name]
        assert svc["build"] == "." and (ROOT / "Dockerfile").exists()
        assert svc["entrypoint"] == []  # the command runs as given, from the image's PATH
        assert not any("pip" in str(x) for x in [svc.get("entrypoint"), svc.get("command")])
    # the brain reads its config from the mounted envoy/ directory
    assert "./envoy:/src/envoy:ro" in SERVICES["brain"]["volumes"] and SERVICES["brain"]["working_dir"] == "/src"


def test_the_brains_profile_runs_two_envoy_brain_pairs_sharing_one_redis():
    pairs = sorted(n for n in SERVICES if n.startswith("brain-"))
    assert pairs == ["brain-0", "brain-1"] and "redis" in SERVICES
    assert all(SERVICES[n].get("profiles") == ["brains"] for n in [*pairs, "envoy-0", "envoy-1", "redis"])
    assert "profiles" not in SERVICES["brain"]  # the default topology is unchanged
    ids, ports = set(), set()
    for i, name in enumerate(pairs):
        cmd = SERVICES[name]["command"]
        path = ROOT / cmd[cmd.index("--config") + 1]
        cfg = load_config(path)
        u = urlsplit(cfg.shared_state.redis_url)
        assert u.hostname == "redis" and "redis" in SERVICES[name]["depends_on"]
        # Redis wants the password the brains read from compose's secrets; they sign with the fleet's secret
        assert cfg.shared_state.password_file == "/run/secrets/redis_password" and "--requirepass" in \
            SERVICES["redis"]["command"][-1] and "/run/secrets/redis_password" in SERVICES["redis"]["command"][-1]
        assert cfg.shared_state.secret_file == "/run/secrets/shared_secret"
        assert set(SERVICES[name]["secrets"]) == {"redis_password", "shared_secret"}
        assert cfg.brain.host == name and [r.name for r in cfg.replicas] == ["r0", "r1", "r2", "r3"]
        ids.add(cfg.shared_state.brain_id)
        envoy = SERVICES[f"envoy-{i}"]
        rendered = SHIPPED[str(path.relative_to(ROOT))]
        assert any(m.startswith(f"./{rendered}:/etc/envoy/envoy.yaml") for m in envoy["volumes"])
        assert envoy["ports"] == [f"{cfg.envoy.listen_port}:{cfg.envoy.listen_port}"]
        ports.add(cfg.envoy.listen_port)
    assert len(ids) == 2 and len(ports) == 2
