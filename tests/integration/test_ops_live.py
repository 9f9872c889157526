"""Every metric the dashboard and the alert rules use is in a live scrape of the brain or Envoy."""

from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.tools.stack.local import http_get

from ..ops.test_ops import metric_names

pytestmark = pytest.mark.integration


def names_in(text: str) -> set[str]:
    out = set()
    for fam in text_string_to_metric_families(text):
        out.add(fam.name)
        out.update(s.name for s in fam.samples)
    return out


def test_dashboard_and_alert_metrics_exist_in_live_scrapes(stack):
    body = json.dumps({"model": "mock-coder-30b", "max_tokens": 2, "messages": [{"role": "system",
                                                                                 "content": "s" * 500},
                                                                   {"role": "user", "content": "u"}]}).encode()
    for _ in range(3):
        req = urllib.request.Request(stack.url + "/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
        urllib.request.urlopen(req, timeout=30).read()
    live = names_in(http_get(stack.brain_metrics).decode()) | names_in(http_get(stack.envoy_admin
                                                                                + "/stats/prometheus").decode())
    missing = sorted(m for m in metric_names() if m not in live)
    assert not missing, missing
