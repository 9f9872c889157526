"""Reload: the config changes under a running brain and Envoy; nothing in flight is dropped."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request

import openai
import pytest

from extproc.tools.stack.local import http_get, wait_for

from .conftest import quiet

pytestmark = pytest.mark.integration


def envoy_clusters(s) -> set[str]:
    doc = json.loads(http_get(s.envoy_admin + "/clusters?format=json"))
    return {c["name"] for c in doc.get("cluster_statuses", [])}


def test_reload_adds_and_removes_replicas_without_dropping_in_flight_requests(own_stack):
    s = own_stack(2, mock_args=["--speedup", "2"])
    s.wait_all_live(30)
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
    assert envoy_clusters(s) >= {"r0", "r1"} and "r2" not in envoy_clusters(s)

    # a session pinned to r1, and a long stream in flight on it across both reloads
    quiet(s)
    served = set()
    while "r1" not in served:
        sid = f"sess-{len(served)}-{os.getpid()}"
        out = c.chat.completions.create(model="mock-coder-30b", messages=[{"role": "user", "content": "x"}],
                                        max_tokens=2,
                                        extra_headers={"x-session-id": sid})
        served.add(out.system_fingerprint)
        quiet(s)
    pinned_sid = sid
    assert json.loads(s.admin_get(f"/pins/session/{pinned_sid}"))["replica"] == "r1"
    result = {}

    def long_stream():
        chunks = list(c.chat.completions.create(model="mock-coder-30b", messages=[{"role": "user", "content": "long"}],
                                                max_tokens=150, stream=True,
                                                extra_headers={"x-session-id": pinned_sid}))
        result["tokens"] = sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content)

    t = threading.Thread(target=long_stream)
    t.start()
    wait_for(lambda: s.state()["open_reservations"] >= 1, 10, "the long stream in flight")

    # add r2: by POST /reload
    r2 = s.start_replica("r2", extra=["--speedup", "2"])
    s.set_replicas([*s.replicas, r2])
    info = json.loads(s.admin_post("/reload"))
    assert info["added"] == ["r2"] and info["removed"] == []
    wait_for(lambda: "r2" in envoy_clusters(s), 10, "Envoy to learn cluster r2 without a restart")
    wait_for(lambda: s.replica_state("r2")["state"] == "LIVE", 30, "r2 LIVE through the health machine")

    # remove r1: by SIGHUP
    s.set_replicas([r for r in s.replicas if r.name != "r1"])
    os.kill(s.brain.popen.pid, signal.SIGHUP)
    wait_for(lambda: "r1" not in {r["name"] for r in s.state()["replicas"]}, 10, "the brain to forget r1")
    wait_for(lambda: "r1" not in envoy_clusters(s), 10, "Envoy to drop cluster r1")

    t.join(60)
    assert result.get("tokens") == 150  # the stream that was running on r1 finished whole
    assert s.envoy.alive() and s.brain.alive()
    quiet(s)
    out = c.chat.completions.create(model="mock-coder-30b", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                    extra_headers={"x-session-id": pinned_sid})
    assert out.system_fingerprint in ("r0", "r2")  # the pin to the removed replica rebinds
    assert json.loads(s.admin_get(f"/pins/session/{pinned_sid}"))["replica"] == out.system_fingerprint
    assert s.state()["open_reservations"] == 0 or wait_for(lambda: s.state()["open_reservations"] == 0, 10, "releases")


def test_a_broken_config_on_reload_keeps_the_old_one_and_says_which_field(own_stack):
    s = own_stack(1)
    (s.dir / "warmroute.yaml").write_text("pins: {session_ttl_s: soon}\n")
    with pytest.raises(urllib.error.HTTPError) as e:
        s.admin_post("/reload")
    assert e.value.code == 400 and "pins.session_ttl_s" in json.loads(e.value.read())["error"]
    assert [r["name"] for r in s.state()["replicas"]] == ["r0"]
