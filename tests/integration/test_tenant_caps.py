"""Per-tenant token caps live (issue 63, item 3): through a real Envoy to mock replicas, a tenant past its engine tokens
a minute gets 429 with Retry-After, in OpenAI's shape on chat and Anthropic's on Messages, while another tenant is
served; nothing is lost or left held, and /metrics counts the tenant by its hash."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from extproc.core.flow import tenant_key
from extproc.tools.stack.procs import wait_for

pytestmark = pytest.mark.integration


def _post(url: str, path: str, tenant: str, i: int) -> tuple[int, dict, dict]:
    body = {"model": "mock-coder-30b", "max_tokens": 4,
            "messages": [{"role": "user", "content": f"request {i} of {tenant}: " + "fix the failing test. " * 60}]}
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json", "x-warmroute-tenant": tenant})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read() or b"{}")


def test_a_tenant_past_its_cap_gets_429_with_retry_after_and_the_others_are_served(own_stack):
    # a tenant's header, as the proxy in front of Envoy that authenticates clients sets it (trusted here)
    s = own_stack(2, config={"flow_control": {"tenant_tokens_per_minute": 2500},
                             "envoy": {"trust_downstream_tenant_header": True}})
    wait_for(lambda: all(r["state"] == "LIVE" for r in s.state()["replicas"]), 60, "replicas LIVE")
    got = [_post(s.url, "/v1/chat/completions", "noisy", i) for i in range(12)]
    codes = [c for c, _, _ in got]
    assert 200 in codes and 429 in codes, codes
    first = codes.index(429)
    assert all(c == 429 for c in codes[first:]), codes  # refused until its bucket refills (a minute's tokens)
    _, headers, doc = got[first]
    headers = {k.lower(): v for k, v in headers.items()}
    assert int(headers["retry-after"]) >= 1 and doc["error"]["code"] == "tenant_over_cap", (headers, doc)
    status, _, doc = _post(s.url, "/v1/messages", "noisy", 99)
    assert status == 429 and doc["type"] == "error" and doc["error"]["type"] == "rate_limit_error", doc
    assert all(_post(s.url, "/v1/chat/completions", "quiet", i)[0] == 200 for i in range(3))
    text = urllib.request.urlopen(s.brain_metrics, timeout=5).read().decode()
    assert f'warmroute_tenant_capped_requests_total{{tenant="{tenant_key("noisy")}"}}' in text
    assert f'warmroute_tenant_tokens_total{{tenant="{tenant_key("quiet")}"}}' in text
    assert 'warmroute_flow_refused_total{reason="tenant_over_cap"}' in text
    # nothing lost: every request answered above; nothing left held or reserved
    wait_for(lambda: s.state()["open_reservations"] == 0, 30, "every reservation released")
    assert s.state()["flow_control"]["held"] == 0
