"""Alert rules (promtool) and the Grafana dashboard: both well-formed, both refer to real metrics."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml
from ..helpers import envoy_decide

OPS = Path(__file__).resolve().parents[2] / "extproc" / "ops"
_NAME = re.compile(r"\b((?:warmroute|envoy)_[a-zA-Z0-9_]+)\b")


def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool is missing: apt-get install prometheus (.ci/run and `make test` install it)"
    return found


def test_alert_rules_are_valid_and_each_alert_fires_and_stays_quiet_in_promtool_tests():
    check = subprocess.run([promtool(), "check", "rules", str(OPS / "alerts.yaml")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    test = subprocess.run([promtool(), "test", "rules", str(OPS / "alerts_test.yaml")], capture_output=True, text=True,
                          cwd=OPS)
    assert test.returncode == 0, test.stdout + test.stderr
    tested = yaml.safe_load((OPS / "alerts_test.yaml").read_text())
    by_alert: dict[str, set[bool]] = {}
    for t in tested["tests"]:
        for a in t["alert_rule_test"]:
            by_alert.setdefault(a["alertname"], set()).add(bool(a["exp_alerts"]))
    rules = [r["alert"] for g in yaml.safe_load((OPS / "alerts.yaml").read_text())["groups"] for r in g["rules"]]
    assert len(rules) == 12
    for name in rules:
        assert by_alert.get(name) == {True, False}, f"{name} must be tested both fired and not fired"


def test_every_alert_has_a_one_line_runbook():
    for g in yaml.safe_load((OPS / "alerts.yaml").read_text())["groups"]:
        for r in g["rules"]:
            rb = r["annotations"]["runbook"]
            assert rb and "\n" not in rb.strip()


def metric_names() -> set[str]:
    """Every metric name the dashboard and the alert rules use (histograms by their _bucket series)."""
    exprs = [t["expr"] for p in json.loads((OPS / "grafana-dashboard.json").read_text())["panels"] for t
             in p["targets"]]
    exprs += [r["expr"] for g in yaml.safe_load((OPS / "alerts.yaml").read_text())["groups"] for r in g["rules"]]
    out = set()
    for e in exprs:
        e = re.sub(r"\{[^}]*\}", "", e)  # label matchers: {envoy_cluster_name="..."}
        e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)  # grouping labels
        out.update(_NAME.findall(e))
    return out


def test_the_dashboard_covers_what_operators_watch():
    names = metric_names()
    for m in ["warmroute_decisions_total", "warmroute_imbalance_index", "warmroute_replica_state",
              "warmroute_cooldown_seconds",
              "warmroute_pins", "warmroute_spills_total", "warmroute_rebinds_total", "warmroute_scrapes_total",
              "warmroute_decision_duration_seconds_bucket", "envoy_cluster_upstream_rq_total",
              "envoy_http_ext_proc_warmroute_failure_mode_allowed"]:
        assert m in names, m


def test_the_brain_exports_the_cached_tokens_it_predicted_beside_the_engine_s_own_hits():
    """What WarmrouteCacheBeliefShort compares: per replica, the cached tokens routing predicted for the requests it
    placed there, and the engine's prefix-cache hits as last scraped; both in /state too."""
    import orjson
    from prometheus_client import generate_latest

    from extproc.core import LoadSample

    from ..brain.test_brain_access import live

    b, clock = live({"routing": {"policy": "warm"}})
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "shared context " * 4000}]})
    first = envoy_decide(b, {"x-request-id": "a", "x-session-id": "s"}, body)
    assert first is not None
    b.router.release(b.router.reservation(1), clock.t)
    envoy_decide(b, {"x-request-id": "b", "x-session-id": "s"}, body + b" ")
    d = b.recent_decisions("b")[-1]
    assert d["predicted_cached_tokens"] > 0
    home = d["replica"]
    b.router.on_load(home, LoadSample(cached_tokens=12_345.0), clock.t)
    reps = {r["name"]: r["cached_tokens"] for r in b.state()["replicas"]}
    assert reps[home] == {"predicted": d["predicted_cached_tokens"], "engine": 12_345.0}
    assert all(v["engine"] is None for n, v in reps.items() if n != home)  # never scraped: not made up
    text = generate_latest(b.registry).decode()
    assert f'warmroute_predicted_cached_tokens_total{{replica="{home}"}} {float(d["predicted_cached_tokens"])}' in text
    assert f'warmroute_engine_cached_tokens_total{{replica="{home}"}} 12345.0' in text
