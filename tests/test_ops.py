"""Alert rules (promtool) and the Grafana dashboard: both well-formed, both refer to real metrics."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml

OPS = Path(__file__).resolve().parents[1] / "extproc" / "ops"
_NAME = re.compile(r"\b((?:warmroute|envoy)_[a-zA-Z0-9_]+)\b")


def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool is missing: apt-get install prometheus (.ci/run and `make test` install it)"
    return found


def test_alert_rules_are_valid_and_each_alert_fires_and_stays_quiet_in_promtool_tests():
    check = subprocess.run([promtool(), "check", "rules", str(OPS / "alerts.yaml")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    test = subprocess.run([promtool(), "test", "rules", str(OPS / "alerts_test.yaml")], capture_output=True, text=True, cwd=OPS)
    assert test.returncode == 0, test.stdout + test.stderr
    tested = yaml.safe_load((OPS / "alerts_test.yaml").read_text())
    by_alert: dict[str, set[bool]] = {}
    for t in tested["tests"]:
        for a in t["alert_rule_test"]:
            by_alert.setdefault(a["alertname"], set()).add(bool(a["exp_alerts"]))
    rules = [r["alert"] for g in yaml.safe_load((OPS / "alerts.yaml").read_text())["groups"] for r in g["rules"]]
    assert len(rules) == 8
    for name in rules:
        assert by_alert.get(name) == {True, False}, f"{name} must be tested both fired and not fired"


def test_every_alert_has_a_one_line_runbook():
    for g in yaml.safe_load((OPS / "alerts.yaml").read_text())["groups"]:
        for r in g["rules"]:
            rb = r["annotations"]["runbook"]
            assert rb and "\n" not in rb.strip()


def metric_names() -> set[str]:
    """Every metric name the dashboard and the alert rules use (histograms by their _bucket series)."""
    exprs = [t["expr"] for p in json.loads((OPS / "grafana-dashboard.json").read_text())["panels"] for t in p["targets"]]
    exprs += [r["expr"] for g in yaml.safe_load((OPS / "alerts.yaml").read_text())["groups"] for r in g["rules"]]
    out = set()
    for e in exprs:
        e = re.sub(r"\{[^}]*\}", "", e)  # label matchers: {envoy_cluster_name="..."}
        e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)  # grouping labels
        out.update(_NAME.findall(e))
    return out


def test_the_dashboard_covers_what_operators_watch():
    names = metric_names()
    for m in ["warmroute_decisions_total", "warmroute_imbalance_index", "warmroute_replica_state", "warmroute_cooldown_seconds",
              "warmroute_pins", "warmroute_spills_total", "warmroute_rebinds_total", "warmroute_scrapes_total",
              "warmroute_decision_duration_seconds_bucket", "envoy_cluster_upstream_rq_total",
              "envoy_http_ext_proc_warmroute_failure_mode_allowed"]:
        assert m in names, m
