"""`warmroute up` (what `make demo` runs) end to end, without the serve-until-Ctrl-C part."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_up_starts_the_stack_sends_agent_load_and_shows_both_shares():
    import shutil
    from pathlib import Path

    port = _free_port()
    p = subprocess.run([sys.executable, "-m", "extproc.cli", "up", "--no-serve", "--minutes", "1", "--port", str(port)],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    out = p.stdout
    assert "LIVE LIVE LIVE LIVE" in out
    done = next(line for line in out.splitlines() if line.startswith("done:"))
    sent_ok, _, total = done.split()[1].partition("/")
    assert int(sent_ok) == int(total) > 0 and "lost 0" in done
    rows = [line for line in out.splitlines() if line[:2] in ("r0", "r1", "r2", "r3")]
    assert len(rows) == 4 and all("LIVE" in r for r in rows)
    assert "fail-open (brain did not answer) 0" in out and "open reservations 0" in out
    assert f"Envoy listens on http://127.0.0.1:{port}" in out  # --port: a stable URL
    logdir = Path(next(line for line in out.splitlines() if line.startswith("logs (kept after exit): "))
                  .split(": ", 1)[1].split()[0])
    try:
        assert {"brain.log", "envoy.log", "r0.log"} <= {f.name for f in logdir.iterdir()}  # kept after the stop
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
