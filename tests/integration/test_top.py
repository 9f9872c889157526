"""`warmroute top --once` shows the brain's view and Envoy's counters side by side."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest

from extproc.tools.stack.local import wait_for

pytestmark = pytest.mark.integration


def test_top_shows_states_pins_shares_and_last_changes(own_stack):
    s = own_stack(2)
    s.wait_all_live(30)
    body = json.dumps({"model": "mock-coder-30b", "max_tokens": 2, "messages": [{"role": "user",
                                                                                 "content": "u"}]}).encode()
    for i in range(6):
        req = urllib.request.Request(s.url + "/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json", "x-session-id": f"t{i}"})
        urllib.request.urlopen(req, timeout=30).read()
    s.admin_post("/replicas/r1/drain")
    wait_for(lambda: s.state()["open_reservations"] == 0, 10, "releases")
    p = subprocess.run([sys.executable, "-m", "extproc.cli", "top", "--once", "--brain-admin", s.brain_admin,
                        "--envoy-admin", s.envoy_admin_path, "--token-file", s.cfg.brain.admin_token_file],
                       capture_output=True, text=True, timeout=30,
                       env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
    out = p.stdout
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 5 and ("r0" in line
                                                                                                      or "r1" in line)}
    assert set(rows) == {"r0", "r1"}
    assert "LIVE*" in rows["r1"]  # drained
    assert "envoy share" in out and "brain share" in out
    assert "decisions 6; Envoy upstream requests 6" in out
    assert "PROBING -> LIVE" in out  # last state changes
