"""Per-tenant token caps (issue 63, item 3): a tenant's engine tokens a minute, counted by every brain, enforced
before anything is read or priced, answered 429 with Retry-After in the API's own error shape."""

from __future__ import annotations

import json

import orjson
import pytest

from extproc.config import parse_config
from extproc.core import Router, RouterConfig
from extproc.core.caps import TenantCaps, caps_of
from extproc.core.flow import CRITICAL, tenant_key
from extproc.core.names import Reason
from extproc.core.profile import RequestProfile
from extproc.core.shared import Outbox, Remote

from ..helpers import envoy_at_headers, envoy_decide, envoy_look, live_brain

BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello " * 400}], "max_tokens": 8})


def test_a_bucket_lets_a_tenant_in_while_it_holds_anything_and_refills_at_its_rate():
    caps = TenantCaps(6000.0)  # 100 tokens a second
    assert caps.retry_after("a", 0.0) is None
    caps.spend("a", 9000.0, 0.0)  # past its minute: in debt 3,000, bounded at one minute's worth
    wait = caps.retry_after("a", 0.0)
    assert wait == pytest.approx(30.01, abs=0.02)  # 3,000 tokens (+1) at 100 a second
    assert caps.retry_after("a", 29.0) is not None and caps.retry_after("a", 30.1) is None
    assert caps.retry_after("b", 0.0) is None  # another tenant: its own bucket
    caps.spend("a", 10**9, 31.0)
    assert caps.retry_after("a", 31.0) == pytest.approx(60.01, abs=0.02)  # the debt is at most one minute's
    assert caps.refused == {"a": 3} and caps.spent["a"] == pytest.approx(9000.0 + 10**9)


def test_a_tenant_named_in_the_config_has_its_own_cap_and_zero_means_none():
    cfg = parse_config({"flow_control": {"tenant_tokens_per_minute": 1000, "tenant_caps": {"acme": 0, "free": 10}}})
    caps = caps_of(cfg.flow_control)
    caps.spend(tenant_key("acme"), 10**6, 0.0)
    caps.spend(tenant_key("free"), 20.0, 0.0)
    caps.spend(tenant_key("other"), 2000.0, 0.0)
    assert caps.retry_after(tenant_key("acme"), 0.0) is None  # uncapped by name
    assert caps.retry_after(tenant_key("free"), 0.0) is not None
    assert caps.retry_after(tenant_key("other"), 0.0) is not None  # the default
    assert caps_of(parse_config({}).flow_control) is None


def _live(names: list[str]) -> Router:
    router = Router(RouterConfig(), names, 0.0)
    for k in range(7):
        for name in names:
            router.on_scrape(name, True, 3.0 * k - 20.0)
    return router


def _profile(tenant: str | None, priority: int = 1) -> RequestProfile:
    return RequestProfile(tokens=1000, tenant=tenant, priority=priority)


def test_the_router_refuses_a_capped_tenant_before_it_prices_or_books_anything():
    router = _live(["r0", "r1"])
    router.caps = TenantCaps(1200.0)
    d = router.select(_profile("a"), 1.0)
    assert d.replica is not None  # placed: its cost (1,000 uncached + the expected answer) out of its bucket
    spent = router.caps.spent[tenant_key("a")]
    assert spent >= 1000.0
    router.caps.spend(tenant_key("a"), 1200.0, 1.0)  # the rest of its minute
    selects, flight = router.selects, sum(r.in_flight_requests for r in router.replicas)
    d = router.select(_profile("a"), 1.5)
    assert d.reason is Reason.TENANT_CAP and d.replica is None and d.reservation is None and d.retry_after_s > 0
    assert sum(r.in_flight_requests for r in router.replicas) == flight  # nothing booked
    assert router.select(_profile("b"), 1.5).replica is not None  # another tenant is not
    assert router.select(_profile("a", CRITICAL), 1.5).replica is not None  # critical work never capped
    assert router.select(_profile(None), 1.5).replica is not None  # no tenant named: never capped
    assert router.selects == selects + 4


def test_another_brain_s_placements_count_against_a_tenant_s_cap():
    """Shared state: brain A places a tenant's request, brain B's bucket for it is spent by as much."""
    a, b = _live(["r0"]), _live(["r0"])
    for router in (a, b):
        router.caps = TenantCaps(1500.0)
    a.outbox = Outbox()
    a.policy.outbox = a.outbox
    assert a.select(_profile("t"), 1.0).replica is not None
    events = [ev for ev in a.outbox.events if ev[0] == "t"]
    assert events and events[0][1] == tenant_key("t")
    Remote().apply(b, "brain-a", events, 0.0, 1.0)
    assert b.caps.spent[tenant_key("t")] == pytest.approx(a.caps.spent[tenant_key("t")], abs=1.0)
    Remote().apply(b, "brain-a", [("t", tenant_key("t"), float("nan")), ("t", tenant_key("t"), -5)], 0.0, 1.0)
    assert b.caps.spent[tenant_key("t")] == pytest.approx(a.caps.spent[tenant_key("t")], abs=1.0)  # nonsense ignored


def _brain(per_minute: int = 1500):
    return live_brain(parse_config({
        "replicas": [{"name": f"r{i}", "url": f"http://127.0.0.1:{8001 + i}", "models": ["m"]} for i in range(2)],
        "flow_control": {"tenant_tokens_per_minute": per_minute}}))


def _status(out) -> int:
    return out.immediate_response.status.code if out.HasField("immediate_response") else 200


def test_the_brain_answers_a_capped_tenant_429_with_retry_after_in_the_api_s_own_shape():
    b = _brain()
    chat = {":path": "/v1/chat/completions", ":method": "POST", "x-warmroute-tenant": "acme"}
    assert _status(envoy_decide(b, {**chat, "x-session-id": "s1"}, BODY)) == 200  # a session under way
    for _ in range(10):  # a minute's tokens gone: the first prompt's tokens, each answer, then what is not cached
        out = envoy_decide(b, chat, BODY)
        if _status(out) == 429:
            break
    assert _status(out) == 429
    headers = {h.header.key: h.header.raw_value.decode() or h.header.value
               for h in out.immediate_response.headers.set_headers}
    assert int(headers["retry-after"]) >= 1 and headers["x-llm-d-request-dropped-reason"] == "tenant_over_cap"
    assert json.loads(out.immediate_response.body)["error"]["code"] == "tenant_over_cap"
    messages = envoy_decide(b, {":path": "/v1/messages", "x-warmroute-tenant": "acme"}, BODY)
    doc = json.loads(messages.immediate_response.body)
    assert _status(messages) == 429 and doc["type"] == "error" and doc["error"]["type"] == "rate_limit_error"
    assert _status(envoy_decide(b, {":path": "/v1/chat/completions", "x-warmroute-tenant": "other"}, BODY)) == 200
    # a large body's look refuses it before it is uploaded; a turn of a session under way, at its headers
    assert _status(envoy_look(b, chat, 0.0)) == 429
    turn = {**chat, "x-session-id": "s1", "content-length": str(len(BODY))}
    answer = envoy_at_headers(b, turn)
    assert answer is not None and _status(answer) == 429
    assert b.stats.flow_refused["tenant_over_cap"] >= 3


def test_tenants_beyond_the_bound_are_forgotten_least_recently_charged_first_a_tenth_at_a_time(monkeypatch):
    """As many tenants as credentials a client can invent: the buckets stay within MAX_TENANTS, the walk that trims
    them runs once per tenth of the bound (not on every request), and the tenant charged last is kept."""
    from extproc.core import caps as caps_module

    monkeypatch.setattr(caps_module, "MAX_TENANTS", 100)
    caps = TenantCaps(1000.0)
    caps.spend("keep", 900.0, 0.0)  # 100 left: forgotten, it would come back with a full bucket
    walks = 0
    for i in range(1000):
        before = len(caps.buckets)
        caps.spend(f"t{i}", 500.0, 0.0)  # all in the same second: none full again, every one still in its bucket
        caps.spend("keep", 0.01, 0.0)
        walks += len(caps.buckets) <= before  # a new tenant came in and yet there are no more: a trim
        assert len(caps.buckets) <= 100
    assert walks <= 1000 // 9 and caps.buckets["keep"][0] < 100 and caps.retry_after("keep", 0.0) is None


def test_the_metrics_show_the_largest_spenders_only_and_another_brain_names_tenants_by_hash_alone():
    from prometheus_client.core import CounterMetricFamily

    from extproc.brain.metrics import MAX_TENANT_SERIES, _tenants

    caps = TenantCaps(10.0**9)
    for i in range(MAX_TENANT_SERIES + 50):
        caps.spend(tenant_key(f"t{i}"), float(i + 1), 0.0)
    spent, _ = list(_tenants(caps))
    assert isinstance(spent, CounterMetricFamily)
    values = sorted(s.value for s in spent.samples if s.name.endswith("_total"))
    assert len(values) == MAX_TENANT_SERIES and values[0] == 51.0  # the 50 smallest left out
    router = _live(["r0"])
    router.caps = TenantCaps(1000.0)
    Remote().apply(router, "brain-a", [("t", "x" * 10_000, 5.0), ("t", "ZZZZZZZZZZZZZZZZ", 5.0), ("t", None, 5.0)],
                   0.0, 1.0)
    assert not router.caps.buckets  # a name, a non-hash or none: nothing a brain sends
