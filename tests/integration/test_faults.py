"""The fast versions of `make chaos`'s replica faults (the rest live in test_envoy_stack.py, test_big_bodies.py):
a replica that reports NaN, one that is SIGSTOPped, one that flaps. Each time the fleet routes around it with
no client error, says why, and takes it back."""

from __future__ import annotations

import json
import os
import signal
import urllib.request

import pytest

from extproc.tools.stack.local import http_post_json, wait_for

pytestmark = pytest.mark.integration


def post(s, session: str) -> str:
    body = json.dumps({"model": "mock-coder-30b", "max_tokens": 2, "messages": [{"role": "user",
                                                                                 "content": f"{session} q"}]}).encode()
    req = urllib.request.Request(s.url + "/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json", "x-session-id": session})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        return json.loads(r.read())["system_fingerprint"]


def state_of(s, name: str) -> str:
    return s.replica_state(name)["state"]


def test_nan_metrics_sigstop_and_flapping_replicas_are_routed_around_and_taken_back(own_stack):
    s = own_stack(4)
    s.wait_all_live(30)
    r0, r1, r2 = (next(r for r in s.replicas if r.name == n) for n in ("r0", "r1", "r2"))

    # r0 reports NaN: a failed scrape with the reason, ejected, no client error
    http_post_json(r0.url + "/admin/fault", {"metrics": "nan"})
    wait_for(lambda: state_of(s, "r0") == "EJECTED", 20, "r0 ejected for NaN")
    assert "NaN" in s.replica_state("r0")["scrape_error"] or "nan" in s.replica_state("r0")["scrape_error"]
    # r1 stopped: its scrapes time out, it is ejected
    os.killpg(r1.proc.popen.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: state_of(s, "r1") == "EJECTED", 20, "r1 ejected while stopped")
        served = {post(s, f"fault-{i}") for i in range(12)}
        assert served <= {"r2", "r3"}, served  # every request answered, none sent to a faulty replica
    finally:
        os.killpg(r1.proc.popen.pid, signal.SIGCONT)
    http_post_json(r0.url + "/admin/fault", {"metrics": "ok"})
    wait_for(lambda: state_of(s, "r0") == "LIVE" and state_of(s, "r1") == "LIVE", 30, "r0 and r1 back")

    # r2 flaps: down, up, down, up; the fleet answers every request throughout and takes it back
    for _ in range(2):
        http_post_json(r2.url + "/admin/fault", {"die_for_s": 1.0})
        wait_for(lambda: state_of(s, "r2") == "EJECTED", 20, "r2 ejected")
        assert all(post(s, f"flap-{i}") != "r2" for i in range(4))
        wait_for(lambda: state_of(s, "r2") == "LIVE", 30, "r2 back")
    assert s.state()["safety_timeouts"] == 0
