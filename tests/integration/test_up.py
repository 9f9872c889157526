"""``warmroute up`` watches its brain (issue 19, part 7): killed, it is restarted and said so; Envoy fails
open meanwhile and routes through the new brain once it is back."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from extproc.tools.stack import admin_http
from extproc.tools.stack.local import wait_for

from ..helpers import stop_group

pytestmark = pytest.mark.integration


def test_warmroute_up_restarts_a_killed_brain_and_says_so():
    p = subprocess.Popen([sys.executable, "-m", "extproc.cli", "up", "--replicas", "2", "--minutes", "0.05",
                          "--sessions-per-min", "20"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True, env={**os.environ, "COLUMNS": "120"})
    lines: list[str] = []
    workdir = None
    threading.Thread(target=lambda: lines.extend(iter(p.stdout.readline, "")), daemon=True).start()
    try:
        wait_for(lambda: any("serving on" in x for x in lines), 180, "warmroute up to serve")
        text = "".join(lines)
        workdir = Path(re.search(r"logs \(kept after exit\): (\S+)/", text).group(1))
        url = re.search(r"serving on (http://\S+)", text).group(1)

        def respond(doc: dict) -> dict:
            req = urllib.request.Request(url + "/v1/responses", data=json.dumps(doc).encode(),
                                         headers={"content-type": "application/json"})
            return json.loads(urllib.request.urlopen(req, timeout=30).read())

        # a Responses follow-up on the demo stack, as the README says it works (the mocks keep what they stored)
        first = respond({"model": "mock-coder-30b", "input": "hello", "max_output_tokens": 4})
        assert respond({"model": "mock-coder-30b", "input": "and then?", "max_output_tokens": 4,
                        "previous_response_id": first["id"]})["status"] == "completed"
        admin = re.search(r"brain admin (http://\S+)\)", text).group(1)
        pid = json.loads((workdir / "brain.ready.json").read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: any("brain exited" in x for x in lines), 30, "up to see the brain die")
        wait_for(lambda: any("brain restarted" in x for x in lines), 30, "up to restart the brain")
        new_pid = json.loads((workdir / "brain.ready.json").read_text())["pid"]
        assert new_pid != pid

        def decided_by_new_brain() -> bool:
            body = json.dumps({"model": "mock-coder-30b", "max_tokens": 2, "messages": [{"role": "user",
                                                                                         "content": "hi"}]}).encode()
            req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                         headers={"content-type": "application/json"})
            urllib.request.urlopen(req, timeout=30).read()  # served all along: fail-open, then the brain
            token = (workdir / "admin.token").read_text().strip()
            req = urllib.request.Request(admin + "/state", headers={"Authorization": f"Bearer {token}"})
            st = json.loads(urllib.request.urlopen(req, timeout=5).read())
            return sum(r["decisions"] for r in st["replicas"]) > 0

        wait_for(decided_by_new_brain, 60, "the new brain to decide", every=0.5)
        assert (workdir / "brain.1.log").exists()  # the dead brain's log is kept

        # Envoy stopped through its admin socket (by its own user: nobody else may open it): restarted on its port
        envoy_admin = re.search(r"Envoy admin socket (\S+),", text).group(1)
        admin_http.request(admin_http.unix_url(envoy_admin) + "/quitquitquit", "POST")
        wait_for(lambda: any("Envoy exited" in x for x in lines), 30, "up to see Envoy stop")
        wait_for(lambda: any("Envoy restarted" in x for x in lines), 60, "up to restart Envoy")
        wait_for(decided_by_new_brain, 60, "the restarted Envoy to serve", every=0.5)
        assert sum("Envoy exited" in x for x in lines) == 1  # said once
    finally:
        stop_group(p, signal.SIGINT, 30)
        if workdir is not None:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)  # up keeps its logs for a person; a test does not


def test_a_process_a_stack_started_dies_with_its_starter_however_that_one_dies(tmp_path):
    """up (or a test runner) killed with -9 cannot stop its replicas and brain: they get SIGTERM from the kernel
    (setpriv --pdeathsig) instead of running on orphaned."""
    script = ("import sys, time; from pathlib import Path; from extproc.tools.stack.procs import Proc; "
              "p = Proc('sleeper', [sys.executable, '-c', 'import time; time.sleep(120)'], Path(sys.argv[1])); "
              "print(p.popen.pid, flush=True); time.sleep(120)")
    starter = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    child = int(starter.stdout.readline())
    try:
        # setpriv sets the signal, then execs the command: a starter killed before that leaves nothing armed. The
        # command line must be the command's own: mid-exec it reads empty (a CI run killed the starter then)
        command = [sys.executable, "-c", "import time; time.sleep(120)"]
        wait_for(lambda: Path(f"/proc/{child}/cmdline").read_bytes().decode().split("\0")[:-1] == command, 10,
                 "the child to run its command")
        assert _alive(child)
        os.kill(starter.pid, signal.SIGKILL)  # the child is in a session of its own: only its starter dies
        starter.wait(10)
        wait_for(lambda: not _alive(child), 10, "the child to die with its starter")
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # a zombie has ended; only its parent's reaping is left


def test_warmroute_up_pd_runs_a_disaggregated_fleet_and_says_what_went_where():
    out = subprocess.run([sys.executable, "-m", "extproc.cli", "up", "--pd", "--replicas", "3", "--minutes", "0.5",
                          "--sessions-per-min", "20", "--no-serve"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "COLUMNS": "120"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "errors none" in out.stdout, out.stdout[-2000:]
    assert re.search(r"prefill/decode: abandoned \d+, local_fallback 0, remote \d+", out.stdout), out.stdout[-2000:]
    # r0 is of role prefill: the table says so instead of calling it passed over
    assert "r0 took 0% of the decisions: it is of role prefill" in out.stdout.replace("\n  ", " "), out.stdout[-2000:]
