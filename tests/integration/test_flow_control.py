"""Flow control with a real Envoy (issue 34, experimental): the brain holds a request every replica is saturated
for past Envoy's ext_proc message timeout (override_message_timeout), and answers it once a replica has room;
Envoy does not fail open meanwhile. In both shapes: the brain as Envoy's ext_proc service, and as the endpoint
picker of a gateway (buffered bodies, and full duplex as GIE gateways run it)."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request

import pytest

from extproc.tools.stack.procs import wait_for

from .conftest import FAST

pytestmark = pytest.mark.integration


def _post(url: str, content: str, sid: str, out: dict) -> None:
    body = json.dumps({"model": "mock-coder-30b", "max_tokens": 2,
                       "messages": [{"role": "user", "content": content}]}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json", "x-session-id": sid})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=60) as r:
        out[sid] = (r.status, json.loads(r.read())["system_fingerprint"], time.monotonic() - t0)


def _metric(s, name: str) -> float:
    text = urllib.request.urlopen(s.brain_metrics, timeout=5).read().decode()
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


SHAPES = pytest.mark.parametrize("shape", [{}, {"brain": {"protocol": "endpoint-picker"}},
                                            {"brain": {"protocol": "endpoint-picker"},
                                             "envoy": {"picker_body_mode": "full-duplex"}}],
                                   ids=["ext_proc", "picker-buffered", "picker-full-duplex"])


@SHAPES
def test_a_saturated_fleet_holds_the_request_in_the_brain_past_envoy_s_timeout_and_then_serves_it(own_stack, shape):
    s = own_stack(2, config={**shape, "flow_control": {"enabled": True, "hold_on_wait": True, "wait_s": 30},
                             "envoy": {**FAST["envoy"], **shape.get("envoy", {}), "ext_proc_timeout_s": 1.0}},
                  mock_args=["--speedup", "1"])
    s.wait_all_live(30)
    out: dict = {}
    # a long prompt on each replica: seconds of prefill ahead of anything that comes next
    bigs = [threading.Thread(target=_post, args=(s.url, f"long {i} " + "word " * 60_000, f"big{i}", out))
            for i in range(2)]
    for t in bigs:
        t.start()
    wait_for(lambda: s.state()["open_reservations"] == 2, 20, "both long requests placed")
    failed_open = s.envoy_stats().get("http.ingress.ext_proc.warmroute.failure_mode_allowed", 0)
    small = threading.Thread(target=_post, args=(s.url, "a short question", "small", out))
    small.start()
    wait_for(lambda: _metric(s, "warmroute_flow_held_requests") == 1, 10, "the short request held in the brain")
    small.join(60)
    for t in bigs:
        t.join(60)
    status, replica, took = out["small"]
    assert status == 200 and replica in ("r0", "r1")
    assert took > 1.0  # held past Envoy's ext_proc message timeout ...
    # ... without Envoy failing open: the brain placed it (a decision of its own) once a replica had room
    assert s.envoy_stats().get("http.ingress.ext_proc.warmroute.failure_mode_allowed", 0) == failed_open
    assert sum(r["decisions"] for r in s.state()["replicas"]) == 3
    assert s.state()["flow_control"]["classes"]["standard"]["released"] == 1
    wait_for(lambda: s.state()["open_reservations"] == 0, 20, "every request released")
    assert _metric(s, "warmroute_flow_held_requests") == 0
