"""A real Prometheus server scrapes the brain and Envoy and evaluates the shipped alert rules
(their durations shortened, their expressions unchanged) through a crystallizing fleet and a
flapping replica; the right alerts go pending and firing, the others stay quiet."""

from __future__ import annotations

import json
import re
import shutil
import socket
import threading
import urllib.request
from pathlib import Path

import pytest
import yaml

from extproc.tools.stack.local import Proc, http_get, wait_for

pytestmark = pytest.mark.integration

OPS = Path(__file__).resolve().parents[2] / "extproc" / "ops"
SHORTER = {"15m": "8s", "10m": "8s", "5m": "6s", "2m": "4s", "1m": "4s"}


def shortened_rules() -> str:
    text = (OPS / "alerts.yaml").read_text()
    text = re.sub(r"for: (\d+m)", lambda m: f"for: {SHORTER[m.group(1)]}", text)
    return re.sub(r"\[(\d+m)\]", lambda m: "[10s]", text)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_alerts_fire_for_a_crystallizing_fleet_and_a_flapping_replica(own_stack, tmp_path):
    prom_bin = shutil.which("prometheus")
    assert prom_bin, "the prometheus server is missing: apt-get install prometheus (.ci/run installs it)"
    crystallize = {  # the rule switched off in config: pins live forever and never spill
        "routing": {"policy": "seed_pins_forever"},
        "health": {"cooldown_max_s": 4.0},
    }
    # 5 replicas: r4 flaps (EJECTED, not routable), all traffic on one of the 4 others -> imbalance 4 > 3
    s = own_stack(5, config={**crystallize, "envoy": {"stats_port": 0}}, mock_args=["--speedup", "20"])
    s.wait_all_live(30)

    (tmp_path / "rules.yaml").write_text(shortened_rules())
    envoy_stats = f"127.0.0.1:{s.envoy_stats_port}"  # the read-only stats listener: the admin is a Unix socket
    brain_metrics = s.brain_metrics.removeprefix("http://").removesuffix("/metrics")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(tmp_path / "rules.yaml")],
        "scrape_configs": [
            {"job_name": "warmroute", "static_configs": [{"targets": [brain_metrics]}]},
            {"job_name": "envoy", "metrics_path": "/stats/prometheus", "static_configs": [{"targets": [envoy_stats]}]},
        ],
    }))
    port = free_port()
    prom = Proc("prometheus", [prom_bin, f"--config.file={tmp_path / 'prometheus.yml'}",
                               f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                               tmp_path)
    stop = threading.Event()
    try:
        api = f"http://127.0.0.1:{port}"
        wait_for(lambda: http_get(api + "/-/ready") is not None, 30, "Prometheus ready", prom)

        # one shared system prompt, a new session each time: the prefix pin holds one replica
        body = json.dumps({"model": "mock-coder-30b", "max_tokens": 2, "messages": [
            {"role": "system", "content": "You are the one shared agent prompt. " * 40}, {"role": "user",
                                                                                          "content": "go"}]}).encode()

        def traffic():
            while not stop.is_set():
                req = urllib.request.Request(s.url + "/v1/chat/completions", data=body,
                                             headers={"content-type": "application/json"})
                try:
                    urllib.request.urlopen(req, timeout=10).read()
                except OSError:
                    pass

        threading.Thread(target=traffic, daemon=True).start()
        # a replica that dies every 2 s for 1 s: its cooldown climbs 1, 2, 4 s (the configured ceiling)
        r4 = next(r for r in s.replicas if r.name == "r4")
        flap_errors: list[str] = []

        def flap():
            while not stop.is_set():
                try:
                    req = urllib.request.Request(r4.url + "/admin/fault", data=b'{"die_for_s": 1.0}', method="POST")
                    urllib.request.urlopen(req, timeout=2).read()
                except OSError as e:  # it may be down right now; try again next round
                    flap_errors.append(repr(e))
                stop.wait(2.0)

        threading.Thread(target=flap, daemon=True).start()

        seen: dict[str, set[str]] = {}

        def alerts_firing() -> bool:
            for a in json.loads(http_get(api + "/api/v1/alerts"))["data"]["alerts"]:
                seen.setdefault(a["labels"]["alertname"], set()).add(a["state"])
            want = {"WarmrouteAllTrafficOnOneReplica", "WarmrouteImbalance", "WarmrouteReplicaFlapping"}
            return all("firing" in seen.get(n, ()) for n in want)

        wait_for(alerts_firing, 90, "the crystallization and flapping alerts to fire", every=0.5)
        assert "pending" in seen["WarmrouteAllTrafficOnOneReplica"] and "pending" in seen["WarmrouteImbalance"]
        assert "WarmrouteFailOpen" not in seen  # the brain answered every request
        assert "WarmrouteProbeBroken" not in seen  # LIVE replicas keep being scraped
        flapping = [a for a in json.loads(http_get(api + "/api/v1/alerts"))["data"]["alerts"]
                    if a["labels"]["alertname"] == "WarmrouteReplicaFlapping"]
        assert {a["labels"]["replica"] for a in flapping} == {"r4"}
    finally:
        stop.set()
        prom.stop()
