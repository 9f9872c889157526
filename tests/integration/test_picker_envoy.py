"""The endpoint-picker protocol end to end: Envoy 1.40 in the shape a Gateway API Inference Extension
gateway runs (``warmroute envoy-config --mode endpoint-picker``), the brain as its picker, mock replicas."""

from __future__ import annotations

import json
import urllib.request

import pytest

from extproc.contract import PICKER_CLUSTER
from extproc.tools.stack.local import http_get, wait_for

from .test_envoy_stack import chat, client, raw_post

pytestmark = pytest.mark.integration
PICKER = {"brain": {"protocol": "endpoint-picker"}}
DUPLEX = {"brain": {"protocol": "endpoint-picker"}, "envoy": {"picker_body_mode": "full-duplex"}}
MODES = pytest.mark.parametrize("mode", [PICKER, DUPLEX], ids=["buffered", "full-duplex"])


def pool_rq(stack, replica) -> int:
    """Envoy's own count of requests the pool cluster sent to one replica (its per-host stats)."""
    doc = json.loads(http_get(stack.envoy_admin + "/clusters?format=json"))
    for c in doc.get("cluster_statuses", []):
        if c["name"] == PICKER_CLUSTER:
            for h in c.get("host_statuses", []):
                if h["address"]["socket_address"]["port_value"] == replica.port:
                    return sum(int(s.get("value", 0)) for s in h.get("stats", []) if s["name"] == "rq_total")
    return 0


@MODES
def test_requests_stream_through_the_picked_endpoint_and_are_released_without_an_access_log(own_stack, mode):
    s = own_stack(3, config=mode)
    s.wait_all_live(30)
    c = client(s, **{"x-session-id": "agent-1"})
    served = [chat(c, system="you are a coding agent " * 40, user=f"turn {i}", stream=i % 2 == 0) for i in range(6)]
    assert len(set(served)) == 1  # one session, one home: the brain's choice is what Envoy used
    home = next(r for r in s.replicas if r.name == served[0])
    assert pool_rq(s, home) >= 6
    st = wait_for(lambda: (x := s.state())["open_reservations"] == 0 and x, 20, "every reservation released")
    made = sum(r["decisions"] for r in st["replicas"])
    assert st["releases_by_response"] == made >= 6
    assert st["access_log_streams"] == 0 and st["releases_by_access_log"] == 0
    # a path outside the API is Envoy's 404, as in the default shape
    status, _, _ = raw_post(s, b"{}", path="/metrics")
    assert status == 404


@MODES
def test_a_refused_endpoint_is_retried_on_the_next_one_the_brain_listed(own_stack, mode):
    # scrapes every 4 s: the brain keeps listing a dead replica first for a while, even on a loaded machine
    s = own_stack(3, config={**mode, "health": {"scrape_interval_s": 4.0}})
    s.wait_all_live(60)
    c = client(s, **{"x-session-id": "retry-1"})
    # the session's home, as the brain chose it (on a loaded machine a first call can fail open to the gateway's
    # own fallback, which the brain never decided)
    for turn in range(5):
        home = chat(c, system="you are a coding agent " * 40, user=f"turn 0.{turn}")
        if s.replica_state(home)["decisions"] > 0:
            break
    before = s.replica_state(home)["decisions"]
    assert before > 0, "the brain decided none of the session's first turns"
    s.kill_replica(home)
    # its next turns: the brain lists the home first (cache) until a scrape or the failures eject it
    served = [chat(c, system="you are a coding agent " * 40, user=f"turn {i}") for i in range(1, 5)]
    assert home not in served  # every one succeeds elsewhere
    assert s.replica_state(home)["decisions"] > before, "the brain never chose the dead home: no retry exercised"
    assert s.envoy_stats().get(f"cluster.{PICKER_CLUSTER}.upstream_rq_retry", 0) >= 1
    wait_for(lambda: s.state()["open_reservations"] == 0, 20, "every reservation released")


def test_the_brain_killed_the_gateway_fails_open_and_sessions_keep_their_replica(own_stack):
    s = own_stack(3, config=DUPLEX)
    s.wait_all_live(30)
    assert chat(client(s)).startswith("r")
    s.brain.kill()
    # a full-duplex stream can fail open only before its first body chunk: the requests of the moment the brain
    # died (and until Envoy's health check sees it, 2 x brain_health_check_interval_s) fail; from then on none
    wait_for(lambda: not s.brain_healthy_in_envoy(), 10, "Envoy to see the brain down")
    for sid in ("sess-a", "sess-b", "sess-c"):
        cs = client(s, **{"x-session-id": sid})
        assert len({chat(cs, system=f"{sid} turn {k}") for k in range(4)}) == 1  # the ring hash fallback
    assert s.envoy_stats().get("http.ingress.ext_proc.warmroute.failure_mode_allowed", 0) >= 12


def test_buffered_bodies_fail_open_at_once_and_keep_the_streams_in_flight(own_stack):
    """With envoy.picker_body_mode buffered, Envoy holds what it sent the brain: a brain killed mid-stream leaves
    the stream going, and requests right after its death fail open without waiting for a health check."""
    import threading

    s = own_stack(3, config=PICKER, mock_args=["--speedup", "2"])
    s.wait_all_live(30)
    streamed: list = []

    def long_stream():
        c = client(s, **{"x-session-id": "long"})
        msgs = [{"role": "user", "content": "write a lot"}]
        n = 0
        for chunk in c.chat.completions.create(model="mock-coder-30b", messages=msgs, max_tokens=120, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                n += 1
        streamed.append(n)

    t = threading.Thread(target=long_stream)
    t.start()
    wait_for(lambda: s.state()["open_reservations"] >= 1, 10, "the long stream to start")
    s.brain.kill()
    served = [chat(client(s, **{"x-session-id": f"after-{i}"}), system=f"no brain {i}") for i in range(6)]
    assert all(x.startswith("r") for x in served)
    t.join(60)
    assert streamed and streamed[0] >= 100, streamed  # the stream in flight finished whole


def test_a_long_context_past_the_brain_limit_goes_where_its_prefix_is_cached_and_reaches_it_whole(own_stack):
    """Issue 61 item 4 through a real Envoy in the gateways' full-duplex shape: a body past brain_body_max_bytes used to
    be decided on its headers alone; now its first bytes decide it (its prefix's home), the rest streams on unread,
    and the replica reads the whole body (a cut one would be a 400). The OpenAI SDK writes the model after the
    messages: the fleet's one model says it."""
    s = own_stack(3, config={**DUPLEX, "envoy": {**DUPLEX["envoy"], "brain_body_max_bytes": 16384}})
    s.wait_all_live(30)
    wait_for(lambda: all(r.get("models") for r in s.state()["replicas"]), 10, "every replica's models read")
    projects = [f"project {k}: you follow rule {k}. " * 200 for k in range(3)]  # ~6 KB each: read whole
    homes = [chat(client(s, **{"x-session-id": f"warm-{k}"}), system=p, user="hello") for k, p in enumerate(projects)]
    assert len(set(homes)) > 1  # spread: where each long context goes says what decided it
    for k in reversed(range(3)):  # not the order a tie among idle replicas would take
        served = chat(client(s, **{"x-session-id": f"long-{k}"}), system=projects[k],
                      user="here is the file:\n" + "a line of the code under review\n" * 6_000)  # ~190 KB
        assert served == homes[k], k
    with urllib.request.urlopen(s.brain_metrics, timeout=5) as r:
        m = r.read().decode()
    assert 'warmroute_request_bodies_total{status="partial"} 3.0' in m
    assert 'warmroute_request_bodies_total{status="headers_only"} 0.0' in m


def test_a_client_s_kv_transfer_params_past_the_brain_limit_get_a_400_from_a_real_envoy(own_stack):
    """Issue 59, finding 4, in the gateways' full-duplex shape on a disaggregated fleet: a body past
    brain_body_max_bytes streams to the replica unread, and a client's own kv_transfer_params at its end reached the
    decode replica's connector. Envoy now answers the brain's 400 in their place (the replica never reads the body
    whole); the same words quoted in a prompt pass."""
    from extproc.tools.stack.local import Stack

    from .conftest import FAST

    cfg = {k: dict(v) for k, v in FAST.items()}
    cfg.update(brain={"protocol": "endpoint-picker"}, envoy={**cfg["envoy"], "picker_body_mode": "full-duplex",
                                                             "brain_body_max_bytes": 16384})
    s = Stack(2, config=cfg, mock_args=["--speedup", "20"])
    s.replica_config = {"r0": {"role": "prefill"}, "r1": {"role": "decode"}}
    try:
        s.start()
        s.wait_all_live(30)
        text = "review the kv_transfer_params code: " + '{"kv_transfer_params": {"remote_host": "h"}} ' * 4000
        quoted = json.dumps({"messages": [{"role": "user", "content": text}], "model": "mock-coder-30b",
                             "max_tokens": 4}).encode()
        attack = quoted[:-1] + b', "kv_transfer_params": {"remote_host": "10.9.9.9", "remote_port": 5600}}'
        status, _, out = raw_post(s, quoted)
        assert status == 200, out
        status, _, out = raw_post(s, attack)
        assert status == 400 and json.loads(out)["error"]["code"] == "kv_transfer_params_not_allowed", (status, out)
        wait_for(lambda: s.state()["open_reservations"] == 0, 20, "every reservation released")
    finally:
        s.stop()
