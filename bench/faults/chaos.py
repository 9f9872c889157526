"""``make chaos``: faults injected into a live local stack under a steady, bounded load, one table.

One stack (Envoy + brain + 4 mock vLLM replicas, the shipped health timings: a replica that comes
back earns 2 good scrapes, then a 15 s clean window) serves a steady load of agent sessions (some
streamed) for the whole run. Each scenario injects one fault, heals it, and waits for the fleet to
be whole again. Per scenario:

- requests: sent by the load during the scenario;
- client errors: answers that were not 200, or connections that failed (what a client sees);
- lost: requests with no answer at all within the client's 60 s (hung, never answered);
- open reservations after: the brain's in-flight count once the load of the scenario has ended and
  Envoy's access log has caught up (anything left is phantom load on a replica);
- time to recover: from the heal (or the fault, when nothing heals it) until every replica is LIVE
  and the brain decides again.

Every scenario has a fast assertion test in ``make test`` (docs/failure-behaviour.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

import aiohttp

from extproc.tools.workload.generate import MOCK_MODEL
from bench.faults.hostile import ENDLESS_METRICS, connect_as, cpu_s
from bench.faults.probes import Probes, unexpected
from extproc.contract import EXT_PROC_STAT_PREFIX
from extproc.tools.stack.local import Stack, http_post_json, wait_for
from extproc.tools.stack.procs import rss_mib
from extproc.tools.workload.open_loop import OpenLoad, write_report

SESSIONS = 24
RATE = 8.0  # requests per second (light: the faults are the point, not the load)


@dataclass
class Result:
    t0: float
    status: int | None = None  # None: no answer at all
    error: str = ""
    t1: float | None = None  # when the answer was read whole
    tf: float | None = None  # when its first byte came (the first token of a stream)


class Load(OpenLoad):
    """A steady open-loop load: chat requests from ``SESSIONS`` sessions, a third streamed (long enough that a
    replica killed at any moment has streams in flight)."""

    def __init__(self, stack: Stack, rate: float = RATE):
        super().__init__(rate)
        self.stack = stack
        self.results: list[Result] = []

    def since(self, t: float) -> list[Result]:
        return [r for r in list(self.results) if r.t0 >= t]

    async def _one(self, http: aiohttp.ClientSession, i: int) -> None:
        r = Result(time.monotonic())
        self.results.append(r)
        stream = i % 3 == 0
        # streams of ~1 s (400 tokens at 10x engine speed): a killed replica has some in flight
        body = {"model": MOCK_MODEL, "max_tokens": 400 if stream else 12, "stream": stream,
                "messages": [{"role": "system", "content": "You are a coding agent. " * 40},
                             {"role": "user", "content": f"turn {i} of session {i % SESSIONS}"}]}
        try:
            async with http.post(self.stack.url + "/v1/chat/completions", json=body,
                                 headers={"x-session-id": f"chaos-{i % SESSIONS}"}) as resp:
                async for _ in resp.content.iter_any():
                    if r.tf is None:
                        r.tf = time.monotonic()
                r.t1 = time.monotonic()
                r.status = resp.status
                if resp.status != 200:
                    r.error = f"HTTP {resp.status}"
        except asyncio.TimeoutError:
            r.error = "lost"
        except Exception as e:  # refused, reset: the client saw a failure
            r.status = 0
            r.error = type(e).__name__


@dataclass
class Row:
    scenario: str
    requests: int
    errors: int
    lost: int
    open_after: int
    recover_s: float | None
    note: str = ""
    extra: dict = field(default_factory=dict)


def _decisions(stack: Stack) -> int:
    return sum(r["decisions"] for r in stack.state()["replicas"])


def whole(stack: Stack) -> bool:
    try:
        return all(r["state"] == "LIVE" for r in stack.state()["replicas"]) and stack.brain_healthy_in_envoy()
    except OSError:
        return False


def recover_time(stack: Stack, since: float, limit: float = 120.0) -> float | None:
    """Seconds from ``since`` until every replica is LIVE and the brain decides again (None: not within limit)."""
    try:
        wait_for(lambda: whole(stack), max(1.0, since + limit - time.monotonic()), "a whole fleet", every=0.2)
        d = _decisions(stack)
        wait_for(lambda: _decisions(stack) > d, 30, "a decision", every=0.1)
    except Exception:
        return None
    return time.monotonic() - since


def open_after(stack: Stack, load: Load) -> int:
    """The brain's open reservations once this scenario's requests have all ended (and their log entries came)."""
    wait_for(lambda: all(r.status is not None or r.error for r in list(load.results)), 90, "the load to drain")
    try:
        wait_for(lambda: stack.state()["open_reservations"] == 0, 10, "releases", every=0.1)
    except Exception:
        pass
    return stack.state()["open_reservations"]


def _replica(stack: Stack, name: str):
    return next(r for r in stack.replicas if r.name == name)


def _fault(stack: Stack, name: str, doc: dict) -> None:
    http_post_json(_replica(stack, name).url + "/admin/fault", doc)


# --------------------------------------------------------------------------- scenarios
# Each takes the stack and the running load, injects and heals, and returns (heal time, note).

def brain_kill(stack: Stack, load: Load) -> tuple[float, str]:
    stack.brain.kill()
    time.sleep(5)  # the fault lasts this long
    stack.start_brain()
    healed = time.monotonic()
    wait_for(stack.brain_healthy_in_envoy, 30, "Envoy to see the new brain")
    return healed, ("5 s without a brain: Envoy fails open to the bounded ring hash; the new brain re-earns every "
                    "replica")


def replica_kill(stack: Stack, load: Load) -> tuple[float, str]:
    # kill the first replica seen with 2 requests in flight (the brain's count), so that some are cut mid-stream
    def busy():
        r = max(stack.state()["replicas"], key=lambda x: x["in_flight_requests"])
        return r["in_flight_requests"] >= 2 and (r["name"], r["in_flight_requests"])

    name, n = wait_for(busy, 60, "a replica with 2 requests in flight", every=0.02)
    stack.kill_replica(name)
    time.sleep(5)
    stack.restart_replica(name)
    return time.monotonic(), (f"kill -9 {name} with {n} requests in flight, back after 5 s (30 s cooldown, 15 s clean "
                              "window); the errors are the streams it was sending")


def replica_sigstop(stack: Stack, load: Load) -> tuple[float, str]:
    pid = _replica(stack, "r2").proc.popen.pid
    os.killpg(pid, signal.SIGSTOP)
    time.sleep(20)
    os.killpg(pid, signal.SIGCONT)
    return time.monotonic(), "SIGSTOP r2 for 20 s: its in-flight requests wait, new ones go elsewhere"


def replica_flap(stack: Stack, load: Load) -> tuple[float, str]:
    for _ in range(3):
        _fault(stack, "r3", {"die_for_s": 3})
        time.sleep(6)
    return time.monotonic(), "r3 down 3 s in every 6 s, three times (cooldown doubles per ejection in a row)"


def envoy_kill(stack: Stack, load: Load) -> tuple[float, str]:
    stack.envoy.kill()
    time.sleep(2)
    stack.start_envoy()  # a new listener port: the load follows stack.url
    return time.monotonic(), "kill -9 Envoy, restarted after 2 s: requests in flight and during the gap fail"


def nan_metrics(stack: Stack, load: Load) -> tuple[float, str]:
    _fault(stack, "r0", {"metrics": "nan"})
    wait_for(lambda: stack.replica_state("r0")["state"] == "EJECTED", 30, "r0 ejected")
    reason = stack.replica_state("r0")["scrape_error"]
    time.sleep(5)
    _fault(stack, "r0", {"metrics": "ok"})
    return time.monotonic(), f"r0 reports NaN for 5 s: ejected ({reason}), back after"


def spoofed_headers(stack: Stack, load: Load) -> tuple[float, str]:
    """Each session's first turn says where the brain keeps it; its next turns name another replica in the routing
    header (or the brain's own cluster). Served by the named replica = routed by the client's header."""
    body = json.dumps({"model": MOCK_MODEL, "max_tokens": 2, "messages": [{"role": "user",
                                                                                 "content": "spoof"}]}).encode()
    names = [r.name for r in stack.replicas]

    def served(headers: dict) -> str:
        req = urllib.request.Request(stack.url + "/v1/chat/completions", data=body, method="POST",
                                     headers={"content-type": "application/json", **headers})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())["system_fingerprint"]  # the mock names who served

    by_header, reached, not_found = 0, 0, 0
    for i in range(40):
        session = f"spoof-{i // 5}"
        if i % 5 == 0:  # the session's first turn: where the brain keeps it
            home = served({"x-session-id": session})
        named = "warmroute_brain" if i % 10 == 9 else next(n for n in names if n != home)
        got = served({"x-session-id": session, "x-warmroute-cluster": named, "x-warmroute-tenant": "victim",
                      "x-request-id": "same-id", "x-warmroute-reservation": "0.1"})
        by_header += got == named
        for path in ("/metrics", "/admin/fault"):
            try:
                urllib.request.urlopen(urllib.request.Request(stack.url + path,
                                                              data=b"{}" if "admin" in path else None),
                                       timeout=10).read()
                reached += 1
            except urllib.error.HTTPError as e:
                not_found += e.code == 404
    return time.monotonic(), (f"40 requests naming another replica than their session's (or warmroute_brain), a victim "
                              f"tenant, a shared request id: {by_header} served by the named replica; 80 GET /metrics, "
                              f"POST /admin/fault: {not_found} x 404, {reached} reached a replica")


def big_bodies(stack: Stack, load: Load) -> tuple[float, str]:
    before = stack.envoy_stats().get("http.ingress.ext_proc.warmroute.failure_mode_allowed", 0)
    big = json.dumps({"model": MOCK_MODEL, "max_tokens": 2, "messages": [{"role": "user",
                                                                                "content": "x " * (16
                                                                                                   * 2**20)}]}).encode()

    def send(i):
        req = urllib.request.Request(stack.url + "/v1/chat/completions", data=big, method="POST",
                                     headers={"content-type": "application/json", "x-session-id": f"big-{i}"})
        try:
            urllib.request.urlopen(req, timeout=120).read()
        except urllib.error.HTTPError:
            pass  # the replica's 400: 8M tokens fit no KV cache

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    failed_open = stack.envoy_stats().get("http.ingress.ext_proc.warmroute.failure_mode_allowed", 0) - before
    return time.monotonic(), f"8 bodies of 32 MiB at once: {failed_open} requests failed open (brain too slow)"


def _with_config(stack: Stack, change) -> None:
    import yaml

    path = stack.dir / "warmroute.yaml"
    doc = yaml.safe_load(path.read_text())
    change(doc)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    stack.admin_post("/reload")


def endless_metrics(stack: Stack, load: Load) -> tuple[float, str]:
    import sys

    from extproc.tools.stack.local import Proc

    pid = stack.brain.popen.pid
    before = rss_mib(pid)
    proc = Proc("endless-metrics", [sys.executable, "-c", ENDLESS_METRICS], stack.dir)
    try:
        port = wait_for(lambda: json.loads(proc.log_path.read_text().splitlines()[0])["port"], 20, "the endless server")
        _with_config(stack, lambda d: d["replicas"].append({"name": "endless", "url": f"http://127.0.0.1:{port}"}))
        time.sleep(15)  # 5 health scrapes of an endless page, each cut at health.max_metrics_bytes
        during = rss_mib(pid)
        reason = stack.replica_state("endless").get("scrape_error")
        _with_config(stack, lambda d: d.update(replicas=[r for r in d["replicas"] if r["name"] != "endless"]))
    finally:
        proc.stop()
    after = rss_mib(pid)
    return time.monotonic(), (f"a replica whose /metrics never ends, for 15 s: refused ({reason}); brain RSS "
                              f"{before:.0f} MiB before, {during:.0f} during, {after:.0f} after its removal")


BOMB = ("replicas: [{name: r0, url: 'http://127.0.0.1:9'}]\npins:\n  session_ttl_s: [" + ", ".join(
    ["&a [x, x, x, x, x, x, x, x, x]"] + [f"&{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]" for i in range(8)])
    + "]\n")  # nine levels of nine: 9^9 values wherever the value is walked (an error message's repr)


def alias_bomb_reload(stack: Stack, load: Load) -> tuple[float, str]:
    """Reloads of an alias bomb and of a 0.9 MiB file, while the load runs: the brain parses them in a thread."""
    path = stack.dir / "warmroute.yaml"
    good = path.read_text()
    t_before = time.monotonic()
    time.sleep(10)
    before = [r.t1 - r.t0 for r in load.since(t_before) if r.t1]
    t_during = time.monotonic()
    answers = []
    # 0.9 MiB that parses slowly and is refused only after the parse (an unknown field at the end)
    big = (good + "# " + "padding " * 100_000 + "\nprofile: {session_headers: [" + ", ".join(f"h{i}" for i
                                                                                             in range(20_000))
           + "], not_a_field: 1}\n")
    try:
        while time.monotonic() < t_during + 10:
            for text in (BOMB, big):
                path.write_text(text)
                try:
                    stack.admin_post("/reload")
                    answers.append(200)
                except urllib.error.HTTPError as e:
                    answers.append(e.code)
    finally:
        path.write_text(good)
        stack.admin_post("/reload")
    during = [r.t1 - r.t0 for r in load.since(t_during) if r.t1 and r.t0 < t_during + 10]

    def p99(xs):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")

    return time.monotonic(), (f"{len(answers)} reloads of an alias bomb and a 0.9 MiB file in 10 s: answers "
                              f"{sorted(set(answers))} (refused, old config kept); request p99 {p99(before):.2f} s in "
                              f"the 10 s "
                              f"before, {p99(during):.2f} s during (same run)")


def rogue_client(stack: Stack, load: Load) -> tuple[float, str]:
    """A local user who is not the brain's: the brain's socket refuses them; the admin API wants the token."""
    as_nobody = connect_as(stack.cfg.brain.grpc_socket)
    try:
        http_post_json(stack.brain_admin + "/replicas/r1/drain", {})
        drain = "drained r1"
    except urllib.error.HTTPError as e:
        drain = f"HTTP {e.code}"
    ejected = [r["name"] for r in stack.state()["replicas"] if r["state"] != "LIVE" or r["drained"]]
    return time.monotonic(), (f"as user nobody: connect to the brain's socket: {as_nobody}; POST drain without the "
                              f"admin "
                              f"token: {drain}; replicas out of service after: {ejected or 'none'}. (With auth off, "
                              "i.e. brain.grpc_port on a reachable address and insecure: true, a peer can forge "
                              "access-log entries: up to health.max_passive_ejection_percent of the fleet ejected, "
                              "its own reservations opened until the liveness bound)")


def _machine_busy() -> tuple[int, int]:
    with open("/proc/stat") as f:
        v = list(map(int, f.readline().split()[1:]))
    return sum(v) - v[3] - v[4], sum(v)  # busy and total jiffies (idle and iowait are not busy)


def burst(stack: Stack, load: Load) -> tuple[float, str]:
    """1,500 connections from wrk for 20 s: the fail-open share, split into calls Envoy did not make because the
    brain already had envoy.brain_max_in_flight in flight and calls that timed out; each process's CPU."""
    import shutil
    import subprocess

    if not shutil.which("wrk"):
        return time.monotonic(), "skipped: wrk is not installed (apt-get install wrk)"
    script = stack.dir / "burst.lua"
    script.write_text(
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\ncounter = 0\n'
        'request = function()\n  counter = counter + 1\n  wrk.headers["x-session-id"] = "burst-" .. (counter % 300)\n'
        f'  wrk.body = \'{{"model": "{MOCK_MODEL}", "max_tokens": 2, '
        '"messages": [{"role": "user", "content": "turn \' '
        '.. counter '
        '.. \' hello"}]}\'\n  return wrk.format()\nend\n')
    procs = {"brain": stack.brain.popen.pid, "envoy": stack.envoy.popen.pid,
             **{r.name: r.proc.popen.pid for r in stack.replicas}}
    prefix = f"http.ingress.ext_proc.{EXT_PROC_STAT_PREFIX}."
    keys = {"failed_open": prefix + "failure_mode_allowed", "timeouts": prefix + "message_timeouts",
            "busy": "cluster.warmroute_brain.upstream_rq_active_overflow",
            "requests": "http.ingress.downstream_rq_total"}
    st0, c0, m0, t0, d0 = stack.envoy_stats(), {k: cpu_s(p) for k,
                                                p in procs.items()}, _machine_busy(), time.monotonic(), \
        _decisions(stack)
    subprocess.run(["wrk", "-t2", "-c1500", "-d20s", "--timeout", "30s", "-s", str(script),
                    stack.url + "/v1/chat/completions"], capture_output=True, timeout=120)
    dt = time.monotonic() - t0
    st1, m1 = stack.envoy_stats(), _machine_busy()
    n = {k: st1.get(v, 0) - st0.get(v, 0) for k, v in keys.items()}
    cpu = {k: (cpu_s(p) - c0[k]) / dt for k, p in procs.items()}
    replicas = sum(v for k, v in cpu.items() if k not in ("brain", "envoy"))
    decided = _decisions(stack) - d0
    return time.monotonic(), (
        f"wrk, 1,500 connections, 20 s, small chat bodies: {n['requests']} requests ({n['requests'] / dt:.0f}/s), "
        f"{n['failed_open']} failed open ({n['failed_open'] / max(1, n['requests']):.1%}): {n['busy']} at once because "
        f"the brain had envoy.brain_max_in_flight calls in flight, {n['timeouts']} timed out. The brain decided "
        f"{decided / dt:.0f}/s on {cpu['brain']:.2f} of a core; Envoy {cpu['envoy']:.2f}, replicas {replicas:.2f}; "
        f"the machine {(m1[0] - m0[0]) / max(1, m1[1] - m0[1]):.0%} busy")


SCENARIOS = {
    "brain_kill_restart": brain_kill,
    "replica_kill_midstream": replica_kill,
    "replica_sigstop_20s": replica_sigstop,
    "replica_flapping": replica_flap,
    "envoy_kill_restart": envoy_kill,
    "replica_nan_metrics": nan_metrics,
    "spoofed_headers": spoofed_headers,
    "big_bodies_under_load": big_bodies,
    "rogue_local_client": rogue_client,
    "alias_bomb_reload": alias_bomb_reload,
    "endless_metrics": endless_metrics,
    "burst_1500_connections": burst,
}


def run_scenario(stack: Stack, name: str, rate: float) -> Row:
    wait_for(lambda: whole(stack), 180, "a whole fleet before the scenario", every=0.2)
    load = Load(stack, rate).start()
    time.sleep(3)  # steady load before the fault
    t0 = time.monotonic()
    healed, note = SCENARIOS[name](stack, load)
    recover = recover_time(stack, healed)
    time.sleep(2)
    load.stop()
    res = load.since(0)
    errors = sum(1 for r in res if r.error and r.error != "lost")
    lost = sum(1 for r in res if r.error == "lost")
    row = Row(name, len(res), errors, lost, open_after(stack, load), recover, note)
    row.extra["fault_s"] = round(healed - t0, 1)
    return row


def table(rows: list[Row]) -> str:
    out = ["| scenario | requests | client errors | lost | open reservations after | time to recover | what happened |",
           "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        rec = f"{r.recover_s:.1f} s" if r.recover_s is not None else "not within 120 s"
        out.append(f"| {r.scenario} | {r.requests} | {r.errors} | {r.lost} | {r.open_after} | {rec} | {r.note} |")
    return "\n".join(out)


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")


def _ttfts(load: Load) -> list[float]:
    return [r.tf - r.t0 for r in load.since(0) if r.tf is not None and not r.error]


def _memory(stack: Stack) -> tuple[float, float]:
    return rss_mib(stack.brain.popen.pid), rss_mib(stack.envoy.popen.pid)


QUEUED = ("predicted_wait_seconds", "in_flight_work_seconds", "pending_kv_tokens")  # what requests leave behind


def _predicted_left(stack: Stack) -> dict[str, dict]:
    """Per replica, what routing still believes is queued there once nothing is in flight (all must be 0; the
    active sessions' contexts and the cache's size are no queue)."""
    return {r["name"]: {k: r["predicted"][k] for k in QUEUED} for r in stack.state()["replicas"]
            if any(r.get("predicted", {}).get(k) for k in QUEUED)}


def _probe_phase(stack: Stack, rate: float, minutes: float) -> tuple[Load, Probes, int]:
    probes = Probes(stack.url, stack.envoy_admin_path, stack.brain_admin).start()
    load = Load(stack, rate).start()
    time.sleep(minutes * 60)
    load.stop()
    probes.stop()
    left_open = open_after(stack, load)
    time.sleep(10)  # the last access-log entries, a scrape or two, and Envoy's heap shrinking
    return load, probes, left_open


def mixed_probes(stack: Stack, rate: float, minutes: float) -> str:
    """Normal clients alone for ``minutes``, then the same clients beside every probe of issue 30 at once for as
    long, twice: their errors, their first-token p99 against the run without probes, ejections, the brain's and
    Envoy's memory (start, after the first probe run, after the second: what a bounded structure takes once is
    taken again, what leaks grows again), and the predictions left on the replicas once everything ended."""
    wait_for(lambda: whole(stack), 180, "a whole fleet", every=0.2)
    base = Load(stack, rate).start()
    time.sleep(minutes * 60)
    base.stop()
    open_after(stack, base)
    time.sleep(10)
    mem0 = _memory(stack)
    ejections0 = sum(r["ejections"] for r in stack.state()["replicas"])
    load, probes, left_open = _probe_phase(stack, rate, minutes)
    mem1 = _memory(stack)
    left = _predicted_left(stack)
    load2, probes2, left_open2 = _probe_phase(stack, rate, minutes)
    mem2 = _memory(stack)
    left2 = _predicted_left(stack)
    ejections = sum(r["ejections"] for r in stack.state()["replicas"]) - ejections0
    b, m, m2 = _ttfts(base), _ttfts(load), _ttfts(load2)
    errors = [r.error for r in load.since(0) + load2.since(0) if r.error]

    def mem(k: int) -> str:
        return (f"{mem0[k]:.0f} MiB | {mem1[k]:.0f} MiB ({mem1[k] / mem0[k] - 1:+.0%}), then {mem2[k]:.0f} MiB "
                f"({mem2[k] / mem1[k] - 1:+.0%} over the second run)")

    rows = [
        "| measure | without probes | with every probe (two runs) | target |", "|---|---:|---:|---|",
        f"| normal clients' requests | {len(base.since(0))} | {len(load.since(0))} + {len(load2.since(0))} | |",
        f"| normal clients' errors | {sum(1 for r in base.since(0) if r.error)} | {len(errors)} | 0 |",
        f"| normal clients' first-token p99 | {_p99(b):.3f} s | {_p99(m):.3f} s ({_p99(m) / _p99(b):.2f}x), "
        f"{_p99(m2):.3f} s ({_p99(m2) / _p99(b):.2f}x) | <= 1.5x |",
        f"| replicas ejected | | {ejections} | 0 |",
        f"| brain memory | {mem(0)} | within 10% |",
        f"| Envoy memory | {mem(1)} | within 10% |",
        f"| open reservations after | | {left_open}, {left_open2} | 0 |",
        f"| replicas with a prediction left | | {len(left)}, {len(left2)} {left or ''}{left2 or ''} | 0 |",
    ]
    probe_rows = ["", "| probe | sent | outcomes |", "|---|---:|---|"]
    for name in sorted(set(probes.counts) | set(probes2.counts)):
        c = probes.counts.get(name, Counter()) + probes2.counts.get(name, Counter())
        probe_rows.append(f"| {name} | {sum(c.values())} | {', '.join(f'{k}: {v}' for k, v in sorted(c.items()))} |")
    bad = {**unexpected(probes.counts), **unexpected(probes2.counts)}
    probe_rows.append(f"\nprobe outcomes outside what each must get: {bad or 'none'}")
    return "\n".join(rows + probe_rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, from: " + ", ".join(SCENARIOS))
    ap.add_argument("--rate", type=float, default=RATE, help="requests per second of the steady load")
    ap.add_argument("--out", default="docs/chaos.md", help="where the table is written ('' : print only)")
    ap.add_argument("--mixed-minutes", type=float, default=5.0,
                    help="then normal clients alone, and twice beside every probe of issue 30 at once, this long each "
                    "(0: skip)")
    args = ap.parse_args(argv)
    names = [n for n in args.scenarios.split(",") if n]
    for n in names:
        if n not in SCENARIOS:
            ap.error(f"unknown scenario {n!r}")
    rows = []
    with Stack(4, mock_args=["--speedup", "10"]) as stack:
        print("stack up; waiting for every replica to earn LIVE (2 scrapes + 15 s) ...", flush=True)
        for n in names:
            print(f"-- {n}", flush=True)
            row = run_scenario(stack, n, args.rate)
            print(f"   {row.requests} requests, {row.errors} errors, {row.lost} lost, {row.open_after} open after, "
                  f"recovered in {row.recover_s if row.recover_s is None else round(row.recover_s, 1)} s", flush=True)
            rows.append(row)
        mixed = ""
        if args.mixed_minutes > 0:
            print(f"-- every probe at once beside normal clients ({args.mixed_minutes:g} min alone, then twice as long "
                  "with the probes)", flush=True)
            mixed = ("\n\n## Every probe at once (issue 30)\n\n" + mixed_probes(stack, args.rate, args.mixed_minutes))
    write_report(args.out, "`make chaos`: faults under a steady load",
                 f"One stack: Envoy + brain + 4 mock vLLM replicas (10x engine speed), the shipped health timings, a "
                 f"steady load of {args.rate:g} requests/s from {SESSIONS} agent sessions (a third streamed). Columns: "
                 "see `bench/faults/chaos.py`.", (table(rows) if rows else "") + mixed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
