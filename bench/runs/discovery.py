"""Replicas added and removed through DNS while clients keep sending (`make bench-discovery`, ~1 min).

A real resolver on loopback (Debian's dnsmasq, re-reading a hosts file on SIGHUP), mock replicas on
127.0.0.2-5 on one port, the brain discovering them by DNS, and Envoy in the endpoint-picker shape in
front. Two records at the start; two added mid-load; one removed mid-load. Printed: how long each added
replica took to take traffic against the health window that bounds it, the client errors, and the
requests the removed replica served after the brain had seen it go (its in-flight ones drained first).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import orjson

from bench.harness import metric_total
from extproc.tools.workload.generate import MOCK_MODEL
from extproc.tools.stack.local import Stack, http_get, wait_for

NAME = "vllm.warmroute.test"
FAST_HEALTH = {"scrape_interval_s": 0.25, "probing_clean_window_s": 1.0, "cooldown_base_s": 1.0,
               "cooldown_max_s": 4.0, "stale_scrape_intervals": 8.0}


def free_port(host: str = "127.0.0.1", kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_dns_port() -> int:
    """A port free for both UDP and TCP on loopback: dnsmasq listens on both, and exits when either is taken."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u, socket.socket() as t:
            u.bind(("127.0.0.1", 0))
            port = u.getsockname()[1]
            try:
                t.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError("no port free for both UDP and TCP on 127.0.0.1")


class Dnsmasq:
    """dnsmasq answering NAME from a hosts file it re-reads on SIGHUP, on a loopback port (the OS's pick)."""

    def __init__(self, workdir: Path, addresses: list[str], port: int | None = None):
        if shutil.which("dnsmasq") is None:
            raise FileNotFoundError("dnsmasq is not installed (make system-deps installs Debian's dnsmasq)")
        self.hosts = workdir / "hosts"
        self.set(addresses)
        self.port = port or free_dns_port()
        user = "root" if os.getuid() == 0 else "nobody"
        # authoritative for the test domain (--local): AAAA gets an empty answer, not REFUSED for want of upstreams
        self.proc = subprocess.Popen(
            ["dnsmasq", "--keep-in-foreground", "--no-daemon", f"--port={self.port}", "--listen-address=127.0.0.1",
             "--bind-interfaces", "--no-resolv", "--no-hosts", "--local=/warmroute.test/",
             f"--addn-hosts={self.hosts}", "--local-ttl=0", "--pid-file=", f"--user={user}", "--log-facility=-"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def wait_ready(self, timeout: float = 10.0) -> "Dnsmasq":
        """Return once it answers a query for NAME; its own error if it exited (a port taken, a bad flag)."""
        import dns.exception
        import dns.resolver

        r = dns.resolver.Resolver(configure=False)
        r.nameservers, r.port, r.lifetime = ["127.0.0.1"], self.port, 0.5

        def answers() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dnsmasq exited: {self.proc.stderr.read().decode(errors='replace')[-500:]}")
            try:
                r.resolve(NAME, "A")
            except dns.resolver.NXDOMAIN:
                return True  # it answers: an empty hosts file has no record yet
            except dns.exception.DNSException:
                return False
            return True

        wait_for(answers, timeout, "dnsmasq to answer")
        return self

    def set(self, addresses: list[str]) -> None:
        self.hosts.write_text("".join(f"{a} {NAME}\n" for a in addresses))

    def reload(self, addresses: list[str]) -> None:
        self.set(addresses)
        self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def _sum_metric(host: str, port: int, *names: str) -> float:
    return metric_total(http_get(f"http://{host}:{port}/metrics").decode(), *names)


def served(host: str, port: int) -> float:
    """Requests a mock replica finished (its own counter)."""
    return _sum_metric(host, port, "vllm:request_success_total")


def in_flight(host: str, port: int) -> float:
    return _sum_metric(host, port, "vllm:num_requests_running", "vllm:num_requests_waiting")


class Load:
    """Clients that keep sending until stopped: each worker runs one conversation of 5 turns after another,
    each with its own prompt (shared prompts would rightly stay where their cache is)."""

    def __init__(self, url: str, workers: int = 3):
        self.url, self.ok, self.errors = url, 0, []
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(w,), daemon=True) for w in range(workers)]
        for t in self.threads:
            t.start()

    def _run(self, w: int) -> None:
        turn = 0
        while not self._stop.is_set():
            turn += 1
            body = orjson.dumps({"model": MOCK_MODEL, "max_tokens": 4, "messages": [
                {"role": "system", "content": f"agent {w} task {turn // 5} " * 100},
                {"role": "user", "content": f"turn {turn}"}]})
            req = urllib.request.Request(self.url + "/v1/chat/completions", body,
                                         {"content-type": "application/json", "x-session-id": f"s{w}-{turn // 5}"})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    r.read()
                self.ok += 1
            except Exception as e:  # noqa: BLE001 - every failure is a finding
                self.errors.append(repr(e)[:200])

    def stop(self) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(40)


def run(workdir: Path, speedup: float = 20.0) -> dict:
    """The scenario once; returns what it measured."""
    port = free_port()
    hosts = [f"127.0.0.{i}" for i in (2, 3, 4, 5)]
    d = Dnsmasq(workdir, hosts[:2]).wait_ready()
    interval = 0.3
    cfg = {"health": dict(FAST_HEALTH), "envoy": {"brain_health_check_interval_s": 0.5},
           "brain": {"protocol": "endpoint-picker"},
           "discovery": {"source": "dns", "dns_name": NAME, "port": port, "interval_s": interval,
                         "dns_servers": [f"127.0.0.1:{d.port}"]}}
    s = Stack(0, config=cfg, mock_args=["--speedup", str(speedup)])
    load = None
    try:
        for i, h in enumerate(hosts):
            s.start_replica(f"m{i}", port, ["--speedup", str(speedup), "--host", h])
        s.write_config()
        s.start_brain()
        s.start_envoy()

        def by_host() -> dict:
            return {r["url"].split("//")[1].rsplit(":", 1)[0]: r for r in s.state()["replicas"]}

        wait_for(lambda: set(by_host()) == set(hosts[:2]), 15, "the first two records discovered")
        s.wait_all_live(30)
        load = Load(s.url)
        wait_for(lambda: load.ok >= 10, 30, "traffic")
        d.reload(hosts)
        t_added = time.monotonic()
        took = {}

        def all_took() -> bool:
            now, st = time.monotonic(), by_host()
            for h in hosts[2:]:
                if h not in took and st.get(h, {}).get("decisions", 0) > 0:
                    took[h] = now - t_added
            return len(took) == 2

        wait_for(all_took, 60, "the added replicas to take traffic")
        h = FAST_HEALTH
        # the bound: the next lookup, two good scrapes to PROBING, the clean window to LIVE, one more scrape
        window = interval + 2 * h["scrape_interval_s"] + h["probing_clean_window_s"] + h["scrape_interval_s"]
        d.reload(hosts[1:])
        t_removed = time.monotonic()
        wait_for(lambda: hosts[0] not in by_host(), 10, "the removal seen")
        seen_s = time.monotonic() - t_removed
        wait_for(lambda: in_flight(hosts[0], port) == 0, 20, "its requests in flight to finish")
        settled = served(hosts[0], port)
        ok_at_removal = load.ok
        wait_for(lambda: load.ok >= ok_at_removal + 30, 60, "more traffic after the removal")
        after = served(hosts[0], port) - settled
        load.stop()
        return {"took_s": took, "window_s": window, "removal_seen_s": seen_s, "after_removal": after,
                "ok": load.ok, "errors": len(load.errors), "error_samples": load.errors[:3]}
    finally:
        if load is not None:
            load.stop()
        s.stop()
        d.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speedup", type=float, default=20.0, help="the mocks' time compression")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="warmroute-discovery-") as tmp:
        r = run(Path(tmp), args.speedup)
    print(f"health window (next lookup + 2 scrapes to PROBING + clean window + 1 scrape): {r['window_s']:.2f} s")
    for h, t in sorted(r["took_s"].items()):
        print(f"  added {h}: first request after {t:.2f} s ({t / r['window_s']:.2f}x the window)")
    print(f"removed 127.0.0.2: seen by the brain after {r['removal_seen_s']:.2f} s; requests it served after that "
          f"(its in-flight ones drained): {r['after_removal']:.0f}")
    print(f"clients: {r['ok']} answered, {r['errors']} errors {r['error_samples'] or ''}")
    return 0 if r["errors"] == 0 and r["after_removal"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
