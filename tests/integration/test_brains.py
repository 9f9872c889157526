"""Several brains sharing state through a real Redis (issue 33): two Envoy + brain pairs over four mock replicas,
clients alternating Envoys request by request; Redis killed and back, a brain killed and restarted, Redis's
password, ACL user and TLS."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from extproc.contract import BRAIN_LOG_CLUSTER, FALLBACK_CLUSTER

from extproc.tools.stack.brains import BrainsStack
from extproc.tools.stack.procs import StackError, wait_for
from extproc.tools.stack.redis_server import RedisServer
from extproc.tools.stack.local import Stack

from .conftest import FAST
from .test_brain_access import make_pki

pytestmark = pytest.mark.integration


def post(url: str, sid: str, turn: int, timeout: float = 30.0) -> str:
    """One turn of a session whose prompt no other session shares: the replica that served it."""
    msgs = [{"role": "system", "content": f"You maintain repository {sid}. " * 120}]
    msgs += [{"role": "user", "content": f"{sid} turn {t}: fix the failing test " * 12} for t in range(turn + 1)]
    body = json.dumps({"model": "mock-coder-30b", "max_tokens": 4, "messages": msgs}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json", "x-session-id": sid})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())["system_fingerprint"]


def conversations(brains, tag: str, sessions: int = 7, turns: int = 5) -> int:
    """Sessions whose turns alternate between the Envoys; how many turns landed away from the session's home. Each
    session's next turn is sent once every brain has its home (the others through Redis): what is shared, not how
    soon (a loaded machine once took longer to carry a home over than five other turns took: 2 of 10 turns moved)."""
    urls = brains.urls
    pins = lambda: [x.state()["session_pins"] for x in brains.stacks]  # noqa: E731
    before = pins()
    homes: dict[str, str] = {}
    moved = 0
    i = 0
    for turn in range(turns):
        for s in range(sessions):
            sid = f"{tag}-{s}"
            served = post(urls[i % len(urls)], sid, turn)
            i += 1
            moved += sid in homes and homes[sid] != served
            homes[sid] = served
        if turn == 0:
            wait_for(lambda: all(n >= b + sessions for n, b in zip(pins(), before)), 20,
                     f"every brain to know the {sessions} new homes")
    return moved


def metric(stack: Stack, name: str) -> float:
    text = urllib.request.urlopen(stack.brain_metrics, timeout=5).read().decode()
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


class Load:
    """Clients in threads alternating the Envoys until stopped; errors counted per Envoy."""

    def __init__(self, urls: list[str], tag: str, clients: int = 3):
        self.urls, self.tag = urls, tag
        self.stop_ = threading.Event()
        self.ok = 0
        self.errors = [0] * len(urls)
        self.threads = [threading.Thread(target=self._run, args=(c,), daemon=True) for c in range(clients)]

    def _run(self, c: int) -> None:
        turn, k = 0, c
        while not self.stop_.is_set():
            for s in range(4):
                e = k % len(self.urls)
                k += 1
                try:
                    post(self.urls[e], f"{self.tag}-{c}-{s}", turn % 6)
                    self.ok += 1
                except (urllib.error.URLError, OSError, ValueError):
                    self.errors[e] += 1
            turn += 1

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_.set()
        for t in self.threads:
            t.join(60)


# a tenant cap that only test_a_tenant_s_cap_is_one_bucket_across_brains sends a tenant to (the others name none:
# never capped), and the tenant header as a trusted proxy in front would set it
CAPPED = {**FAST, "flow_control": {"tenant_tokens_per_minute": 4000},
          # periodic entries every second: a brain that has seen one expires a reservation Envoy stops naming (its end
          # lost with a killed brain's log stream) within seconds, not the hour of reservation_timeout_s
          "envoy": {**FAST["envoy"], "trust_downstream_tenant_header": True, "access_log_periodic_s": 1.0}}


def long_turn(url: str, sid: str) -> None:
    """A request that runs ~2 s (3,000 tokens at the mocks' 20x): Envoy logs it while it runs, so the brain that
    receives its entries learns that this Envoy sends periodic entries (``Brain.liveness_bound_s``)."""
    body = json.dumps({"model": "mock-coder-30b", "max_tokens": 3000,
                       "messages": [{"role": "user", "content": f"{sid}: write it all out"}]}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json", "x-session-id": sid})
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()


@pytest.fixture(scope="module")
def pairs():
    with BrainsStack(4, 2, config=CAPPED, mock_args=["--speedup", "20"]) as b:
        b.wait_all_live(30)
        for s in b.stacks:
            wait_for(lambda s=s: metric(s, "warmroute_shared_state_peers") == 1, 20, "the other brain heard from")
        yield b


def test_sessions_alternating_envoys_stay_home_because_the_brains_share_state(pairs):
    # each brain alone would place a session it has not seen by its own round-robin: turns would move
    assert conversations(pairs, "alt") == 0
    for s in pairs.stacks:
        assert metric(s, "warmroute_shared_state_up") == 1
        assert metric(s, "warmroute_shared_state_events_applied_total") > 0


def _tenant_post(url: str, i: int) -> int:
    body = json.dumps({"model": "mock-coder-30b", "max_tokens": 4, "messages": [
        {"role": "user", "content": f"capped request {i}: " + "summarise the failing build. " * 50}]}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json", "x-warmroute-tenant": "shared-cap"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_tenant_s_cap_is_one_bucket_across_brains(pairs):
    """Issue 63: a tenant whose requests alternate between two brains gets one cap's worth in all, not one per
    brain: each brain counts the other's placements (shared state) before the next request is sent."""
    from extproc.core.flow import tenant_key

    series = f'warmroute_tenant_tokens_total{{tenant="{tenant_key("shared-cap")}"}}'
    codes = []
    for i in range(30):
        code = _tenant_post(pairs.urls[i % 2], i)
        codes.append(code)
        if code == 429:
            break
        # both brains have counted it (the other through Redis) before the next is sent
        wait_for(lambda: metric(pairs.stacks[0], series) == metric(pairs.stacks[1], series), 20, "both brains counted")
    spent = metric(pairs.stacks[0], series)
    served = codes.count(200)
    assert codes[-1] == 429 and served >= 2, codes
    # one bucket: what was served, less the last one placed (the one that put it in debt), fits in one minute's cap
    # and what refilled meanwhile (4,000 a minute: ~700 in 10 s); a bucket per brain would have let ~8,000 through
    assert spent - spent / served <= 5000 and spent > 4000, (codes, spent)


def test_redis_killed_mid_load_fails_no_client_and_sharing_comes_back(pairs):
    with Load(pairs.urls, "redis") as load:
        wait_for(lambda: load.ok >= 10, 60, "load running")
        pairs.redis.kill()
        for s in pairs.stacks:
            wait_for(lambda s=s: metric(s, "warmroute_shared_state_up") == 0, 20, "the brains to see Redis gone")
        ok = load.ok
        wait_for(lambda: load.ok >= ok + 10, 60, "requests served while Redis is down")
        pairs.redis.start()  # the same port, empty
        for s in pairs.stacks:
            wait_for(lambda s=s: metric(s, "warmroute_shared_state_up") == 1, 60, "the brains back on Redis")
            wait_for(lambda s=s: metric(s, "warmroute_shared_state_peers") == 1, 20, "the other brain heard again")
    assert load.errors == [0, 0] and load.ok > 20
    for s in pairs.stacks:
        assert metric(s, 'warmroute_shared_state_failures_total{kind="connect"}') \
            + metric(s, 'warmroute_shared_state_failures_total{kind="timeout"}') \
            + metric(s, 'warmroute_shared_state_failures_total{kind="error"}') >= 1
    assert conversations(pairs, "after-redis") == 0  # new sessions shared again


def released(pairs, what: str) -> None:
    """Every brain's reservations released; past the deadline, what each brain still holds and how its sharing
    went (the failure says which end went missing)."""
    try:
        wait_for(lambda: all(x.state()["open_reservations"] == 0 for x in pairs.stacks), 20, what)
    except StackError as e:
        held = [{k: st.get(k) for k in ("oldest_open_reservations", "shared_state", "releases_by_access_log",
                                         "liveness_bound_s")} for st in (x.state() for x in pairs.stacks)]
        # whether each Envoy dropped entries (its log stream not writable: each a reservation left open), and which
        # brain its log stream is on (seen once on a loaded machine, 2026-12-06: two ends lost in a failover)
        envoys = [{k: v for k, v in x.envoy_stats().items() if v and (k.startswith("access_logs.") or (
            k.startswith(f"cluster.{BRAIN_LOG_CLUSTER}.") and any(w in k for w in (
                "cx_total", "connect_fail", "rq_total", "rq_reset", "health_check.failure", "membership_healthy"))))}
                  for x in pairs.stacks]
        raise StackError(f"{e}: {json.dumps(held)[:4000]} envoys: {json.dumps(envoys)[:3000]}") from None


def off_affinity(stack: Stack, homes: dict) -> str:
    """A brain's last six decisions that did not keep a session on its home: why a session moved."""
    return json.dumps([d for d in json.loads(stack.admin_get("/decisions?last=6"))["decisions"]
                       if d.get("replica") not in homes.values() or d.get("reason") != "affinity"])[:3000]


def test_a_brain_killed_mid_load_costs_only_its_envoys_requests_then_it_restarts_warm(pairs):
    homes = {s: post(pairs.urls[0], f"before-kill-{s}", 0) for s in range(6)}
    # an end Envoy 1 sent on its log stream as brain 1 died is lost with it (seen once on a loaded machine: one
    # reservation left on brain 0): the survivor expires what Envoy stops naming once it knows Envoy names what runs
    long_turn(pairs.urls[0], "long-before-kill")
    wait_for(lambda: pairs.stacks[0].state()["liveness_bound_s"] is not None, 20, "periodic entries seen")
    fell_back = lambda: pairs.stacks[1].envoy_stats().get(f"cluster.{FALLBACK_CLUSTER}.upstream_rq_total", 0)  # noqa
    with Load(pairs.urls, "kill", clients=2) as load:
        wait_for(lambda: load.ok >= 10, 60, "load running")
        before_kill = fell_back()
        pairs.stacks[1].brain.kill()
        survivor = pairs.stacks[0]
        # the dead brain's requests in flight stop loading the replicas once it is silent (peer_timeout_s)
        wait_for(lambda: metric(survivor, "warmroute_shared_state_peers") == 0, 20, "the dead brain forgotten")
        wait_for(lambda: metric(survivor, "warmroute_shared_state_remote_reservations") == 0, 20,
                 "its reservations released")
        ok = load.ok
        wait_for(lambda: load.ok >= ok + 6, 60, "requests served with one brain")
    # Envoy 0's brain lives: none of its clients failed; Envoy 1's at most what was in flight through its brain
    assert load.errors[0] == 0 and load.errors[1] <= 2
    # Envoy 1 stops asking the dead brain at its first refused connection (outlier detection), not after its health
    # checks (~1 s: 41-72 requests failed open to the ring hash under this load without it, 1-2 with it)
    assert fell_back() - before_kill <= 10
    # Envoy 1's log stream fails over apart from its decisions (each cluster its own health check): an end sent to
    # the dead brain meanwhile is lost, and the survivor's reservation of it is load on its replica until the liveness
    # bound expires it (CI, 2026-12-07: every session homed on the two replicas that held such ends moved). What is
    # asked here is whether the survivor knows the sessions, so once those are gone
    wait_for(lambda: survivor.state()["open_reservations"] == 0, 30, "the ends lost with the dead brain expired")
    # Envoy 1 asks the surviving brain (envoy.brain_failover), which knows every session: no failing open to a
    # ring hash that would move them
    failed_over = {s: post(pairs.urls[1], f"before-kill-{s}", 1) for s in range(6)}
    assert failed_over == homes, f"the survivor's decisions off affinity: {off_affinity(survivor, homes)}"
    pairs.stacks[1].start_brain()  # on the same ports: Envoy 1 finds it again
    wait_for(lambda: pairs.stacks[1].brain_healthy_in_envoy(), 30, "Envoy 1 to see its brain again")
    assert metric(pairs.stacks[1], "warmroute_shared_state_warm_start_seconds") > 0
    assert any(r["state"] == "LIVE" for r in pairs.stacks[1].state()["replicas"])  # ready once its own view is
    pairs.stacks[1].wait_all_live(30)  # a session whose home it still probes would be placed elsewhere
    # the restarted brain knows the sessions it never saw, from the snapshot and the stream (each turn once the last
    # is released: Envoy 1 kept its log stream on brain 0, which hands the ends back through Redis, a few ms late)
    after = {}
    for s in range(6):
        after[s] = post(pairs.urls[1], f"before-kill-{s}", 2)
        released(pairs, "the turn released")
    # one run in ~10 under a loaded make test moved a session off its home (2026-12-06): say why the brain chose so
    assert after == homes, f"restarted brain's decisions off affinity: {off_affinity(pairs.stacks[1], homes)}"
    assert metric(pairs.stacks[1], "warmroute_shared_state_up") == 1
    # Envoy 1 kept its access-log stream on brain 0: the ends of brain 1's requests are handed back to it
    released(pairs, "every reservation released, those whose end reached the other brain included")
    wait_for(lambda: metric(pairs.stacks[0], "warmroute_shared_state_peers") == 1, 20, "the brain back in the fleet")


@pytest.fixture(scope="module")
def pickers():
    with BrainsStack(4, 2, config=FAST, mock_args=["--speedup", "20"], shape="picker") as b:
        b.wait_all_live(30)
        for s in b.stacks:
            wait_for(lambda s=s: metric(s, "warmroute_shared_state_peers") == 1, 20, "the other brain heard from")
        yield b


def test_two_pickers_behind_one_envoy_share_their_sessions_and_survive_one_killed(pickers):
    url = pickers.urls[0]
    # a loaded machine can fail a health check of one picker for a moment: Envoy then sends it nothing
    wait_for(lambda: pickers.stacks[0].brain_healthy_in_envoy(), 30, "Envoy to see both pickers healthy")
    homes = {f"pick-{s}": post(url, f"pick-{s}", 0) for s in range(8)}
    made = [0, 0]
    turn = 1
    deadline = time.monotonic() + 60
    # Envoy spreads the streams over both brains: each decides turns the other began
    while min(made) < 4 and time.monotonic() < deadline:
        assert {sid: post(url, sid, turn) for sid in homes} == homes
        made = [sum(r["decisions"] for r in s.state()["replicas"]) for s in pickers.stacks]
        turn += 1
    assert min(made) >= 4, made  # both brains chose
    with Load([url], "pick-kill", clients=2) as load:
        wait_for(lambda: load.ok >= 10, 60, "load running")
        pickers.stacks[1].brain.kill()
        wait_for(lambda: metric(pickers.stacks[0], "warmroute_shared_state_peers") == 0, 20,
                 "the dead picker forgotten")
        ok = load.ok
        wait_for(lambda: load.ok >= ok + 8, 60, "requests served by the other picker")
    assert load.errors[0] <= 2  # at most what was in flight on the killed picker's streams
    assert {sid: post(url, sid, turn) for sid in homes} == homes


def test_brain_processes_behind_one_envoy_share_the_sessions_and_every_end_reaches_its_owner():
    """Several ext_proc brain processes of one host behind one Envoy (envoy.brain_endpoints, the default shape):
    Envoy spreads the decisions over them, its one access-log stream reaches one of them, which hands the others'
    ends back through Redis."""
    with BrainsStack(4, 2, config=FAST, mock_args=["--speedup", "20"], shape="processes") as b:
        b.wait_all_live(30)
        for s in b.stacks:
            wait_for(lambda s=s: metric(s, "warmroute_shared_state_peers") == 1, 20, "the other brain heard from")
        wait_for(lambda: b.stacks[0].brain_healthy_in_envoy(), 30, "Envoy to see both processes healthy")
        url = b.urls[0]
        homes = {f"proc-{s}": post(url, f"proc-{s}", 0) for s in range(8)}
        made, turn, deadline = [0, 0], 1, time.monotonic() + 60
        while min(made) < 4 and time.monotonic() < deadline:
            assert {sid: post(url, sid, turn) for sid in homes} == homes
            made = [sum(r["decisions"] for r in s.state()["replicas"]) for s in b.stacks]
            turn += 1
        assert min(made) >= 4, made  # both processes decided
        wait_for(lambda: all(s.state()["open_reservations"] == 0 for s in b.stacks), 20,
                 "every request released by its owner, whichever process its access-log entry reached")


def _one_brain(tmp: Path, redis: RedisServer, shared: dict) -> Stack:
    s = Stack(2, config={**FAST, "shared_state": {"redis_url": redis.url, "heartbeat_s": 0.5, "peer_timeout_s": 3.0,
                                                  **shared}},
              mock_args=["--speedup", "20"], workdir=tmp / "stack")
    return s


def test_a_wrong_password_is_one_log_line_and_routing_goes_on(tmp_path):
    (tmp_path / "pw").write_text("not-the-password\n")
    with RedisServer(tmp_path, password="s3cret") as redis, \
            _one_brain(tmp_path, redis, {"password_file": str(tmp_path / "pw")}) as s:
        s.wait_all_live(30)
        wait_for(lambda: metric(s, 'warmroute_shared_state_failures_total{kind="auth"}') >= 2, 30,
                 "the brain to retry with backoff")
        assert post(s.url, "pw", 0)
        assert s.brain.alive() and metric(s, "warmroute_shared_state_up") == 0
        log = s.brain.log_tail(200_000)
        assert log.count('"shared_state_down"') == 1 and "refused" in log
        assert "s3cret" not in log and "not-the-password" not in log


def test_an_acl_user_over_tls_shares_state(tmp_path):
    pki = make_pki(tmp_path)
    (tmp_path / "pw").write_text("brain-pw\n")
    tls = {"cert": pki["server.pem"], "key": pki["server.key"], "ca": pki["ca.pem"]}
    with RedisServer(tmp_path, password="admin-only", acl_user=("brain", "brain-pw"), tls=tls,
                     tls_auth_clients=True) as redis:
        shared = {"redis_url": redis.url, "username": "brain", "password_file": str(tmp_path / "pw"),
                  "tls_ca_file": pki["ca.pem"], "tls_cert_file": pki["client.pem"], "tls_key_file": pki["client.key"]}
        with BrainsStack(2, 2, config=FAST, mock_args=["--speedup", "20"], workdir=tmp_path / "b", redis=redis,
                         shared_state={k: v for k, v in shared.items() if k != "redis_url"}) as b:
            b.wait_all_live(30)
            for s in b.stacks:
                wait_for(lambda s=s: metric(s, "warmroute_shared_state_peers") == 1, 30, "sharing over TLS")
            assert conversations(b, "tls", sessions=5, turns=3) == 0


def test_warmroute_up_with_two_brains_serves_the_demo_load_and_stops_everything(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "extproc.cli", "up", "--brains", "2", "--minutes", "0.5",
                          "--no-serve"], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "errors none" in out.stdout and "brain 0:" in out.stdout and "brain 1:" in out.stdout
    sent = re.search(r"done: (\d+)/(\d+) ok", out.stdout)
    assert sent and sent.group(1) == sent.group(2) and int(sent.group(1)) > 0


_RESP_AS_ANOTHER_USER = r'''
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5)
out = []
for cmd in (b"*1\r\n$4\r\nPING\r\n", b"*5\r\n$4\r\nXADD\r\n$16\r\nwarmroute:events\r\n$1\r\n*\r\n$1\r\no\r\n$1\r\nx\r\n"):
    s.sendall(cmd)
    out.append(s.recv(200).decode(errors="replace").split(" ")[0])
print(" ".join(out))
'''


def test_shared_state_trusts_nobody_another_user_a_forger_with_the_password_and_a_planted_largest_id(tmp_path):
    """Issue 43: `warmroute up --brains` started Redis open to every local user: forged reservations steered 40 of 40
    new sessions to one replica, and one XADD with the largest id stopped sharing for good. Now Redis wants the ACL
    user's password (a 0600 file; the default user is off), entries not signed with the fleet's secret are dropped
    and counted, and a stream that cannot advance is started again: sessions still alternate Envoys and stay home."""
    import os
    import subprocess

    import redis

    with BrainsStack(4, 2, config=FAST, mock_args=["--speedup", "20"], workdir=tmp_path / "b") as b:
        b.wait_all_live(30)
        for s in b.stacks:
            wait_for(lambda s=s: metric(s, "warmroute_shared_state_peers") == 1, 30, "the other brain heard from")
        pw_file, secret_file = b.dir / "redis.password", b.dir / "shared.secret"
        assert oct(os.stat(pw_file).st_mode & 0o777) == "0o600" and oct(os.stat(secret_file).st_mode & 0o777) == "0o600"
        assert pw_file.read_text().strip() not in " ".join(b.redis.proc.popen.args)  # never in argv (ps shows it)
        # another local user reaches the port and is refused every command
        got = subprocess.run(["/usr/bin/python3", "-c", _RESP_AS_ANOTHER_USER, str(b.redis.port)], user="nobody",
                             capture_output=True, text=True, timeout=30, cwd="/").stdout.split()
        assert got == ["-NOAUTH", "-NOAUTH"], got
        # one who has the password but not the fleet's secret writes forged reservations: none is applied
        r = redis.Redis(host="127.0.0.1", port=b.redis.port, username="warmroute", password=pw_file.read_text().strip())
        forged = json.dumps([["o", k, f"r{k % 3}", None, 1000, False, 3333.0, 3333.0, 0, None, 0, 0.0]
                             for k in range(9)])
        for _ in range(3):
            r.xadd("warmroute:events", {"o": "brain-9~00000000", "t": "0.0", "w": repr(time.time()), "e": forged})
        for s in b.stacks:
            wait_for(lambda s=s: metric(s, 'warmroute_shared_state_rejected_total{reason="entry_not_signed"}') >= 3,
                     20, "the forged entries rejected")
            assert metric(s, "warmroute_shared_state_remote_reservations") == 0
        # issue 59: the password alone pauses no brain's sharing and kills no connection (CLIENT SETINFO only)
        for call in (lambda: r.client_pause(10_000), lambda: r.client_kill_filter(_type="normal"), r.client_list):
            with pytest.raises(redis.exceptions.NoPermissionError):
                call()
        # ... and one who has the fleet's secret too cannot write as a live brain: its key is not the one that
        # brain's id names. Brain 0 drops the entries and counts them (brain 1 skips what claims to be its own)
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        from extproc.brain.files import read_secret_file
        from extproc.brain.shared import _mac, _signed_parts

        (victim,) = b.stacks[0].state()["shared_state"]["peers"]
        fleet, key = read_secret_file(str(secret_file), "secret"), Ed25519PrivateKey.generate()
        o, t, e = victim.encode(), b"0.0", forged.encode()
        for _ in range(3):
            w = repr(time.time()).encode()
            r.xadd("warmroute:events", {"o": o, "t": t, "w": w, "e": e, "m": _mac(fleet, o, t, w, e),
                                        "k": key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw),
                                        "s": key.sign(_signed_parts(o, t, w, e))})
        wait_for(lambda: metric(b.stacks[0],
                                'warmroute_shared_state_rejected_total{reason="entry_not_signed_by_origin"}') >= 3,
                 20, "the entries forged under a live brain's id rejected")
        assert metric(b.stacks[0], "warmroute_shared_state_remote_reservations") == 0
        # the largest id: no XADD can follow it. The brains delete the stream, start it again and go on sharing
        r.xadd("warmroute:events", {"o": "x"}, id="18446744073709551615-18446744073709551615")
        for s in b.stacks:
            wait_for(lambda s=s: metric(s, "warmroute_shared_state_stream_stuck_total") >= 1
                     or metric(s, "warmroute_shared_state_future_ids_total") >= 1, 30, "the stuck stream mended")
        for s in b.stacks:
            wait_for(lambda s=s: metric(s, "warmroute_shared_state_peers") == 1, 30, "sharing again")
        assert conversations(b, "after", sessions=5, turns=3) == 0
        r.close()
