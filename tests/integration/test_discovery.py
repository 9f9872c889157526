"""Replica discovery through a real DNS server on loopback (Debian's dnsmasq): records added and removed
while clients keep sending, behind Envoy in the endpoint-picker shape."""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request

import orjson
import pytest

from extproc.config import DiscoveryConfig
from extproc.discovery import DiscoveryError
from extproc.discovery.dns import DnsSource
from extproc.tools.stack import Stack, http_get, wait_for

from .conftest import FAST

pytestmark = pytest.mark.integration
NAME = "vllm.warmroute.test"


def free_port(host: str = "127.0.0.1", kind=socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Dnsmasq:
    """dnsmasq answering NAME from a hosts file it re-reads on SIGHUP, on a loopback port the OS picked."""

    def __init__(self, tmp, addresses: list[str]):
        if shutil.which("dnsmasq") is None:
            pytest.skip("dnsmasq is not installed (make system-deps installs Debian's dnsmasq)")
        self.hosts = tmp / "hosts"
        self.set(addresses)
        self.port = free_port(kind=socket.SOCK_DGRAM)
        self.proc = subprocess.Popen(
            ["dnsmasq", "--keep-in-foreground", "--no-daemon", f"--port={self.port}", "--listen-address=127.0.0.1",
             "--bind-interfaces", "--no-resolv", "--no-hosts", "--local=/warmroute.test/", f"--addn-hosts={self.hosts}", "--local-ttl=0",
             "--pid-file=", "--user=" + ("root" if __import__("os").getuid() == 0 else "nobody"), "--log-facility=-"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def set(self, addresses: list[str]) -> None:
        self.hosts.write_text("".join(f"{a} {NAME}\n" for a in addresses))

    def reload(self, addresses: list[str]) -> None:
        self.set(addresses)
        self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def dnsmasq(tmp_path):
    made = []

    def make(addresses):
        d = Dnsmasq(tmp_path, addresses)
        made.append(d)
        return d

    yield make
    for d in made:
        d.stop()


def test_dns_source_reads_the_records_and_a_dead_resolver_is_an_error_not_an_empty_fleet(dnsmasq):
    import asyncio

    d = dnsmasq(["127.0.0.2", "127.0.0.3"])
    src = DnsSource(DiscoveryConfig(source="dns", dns_name=NAME, port=8123, dns_servers=(f"127.0.0.1:{d.port}",)))

    def lookup():
        return asyncio.run(src.lookup())

    found = wait_for(lambda: (x := _try(lookup)) and x, 10, "dnsmasq to answer")
    assert [r.url for r in found] == ["http://127.0.0.2:8123", "http://127.0.0.3:8123"]
    d.reload(["127.0.0.3"])
    wait_for(lambda: [r.url for r in lookup()] == ["http://127.0.0.3:8123"], 10, "the removed record gone")
    d.stop()
    with pytest.raises(DiscoveryError, match=NAME):
        lookup()


def _try(f):
    try:
        return f()
    except DiscoveryError:
        return None


def success_count(replica) -> float:
    text = http_get(f"http://{replica.host}:{replica.port}/metrics").decode()
    return sum(float(m) for m in re.findall(r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


def in_flight(replica) -> float:
    text = http_get(f"http://{replica.host}:{replica.port}/metrics").decode()
    return sum(float(m) for m in re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.e+]+)$", text, re.M))


class Load:
    """Clients that keep sending chat requests until stopped: each worker runs one conversation of 5 turns after
    another, each with its own prompt (shared prompts would rightly stay where their cache is)."""

    def __init__(self, url: str, workers: int = 3):
        self.url, self.ok, self.errors, self.stop_at = url, 0, [], None
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(w,), daemon=True) for w in range(workers)]
        for t in self.threads:
            t.start()

    def _run(self, w: int) -> None:
        turn = 0
        while not self._stop.is_set():
            turn += 1
            body = orjson.dumps({"model": "m", "max_tokens": 4, "messages": [
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


class Hosted:
    def __init__(self, rep, host):
        self.rep, self.host, self.port, self.name = rep, host, rep.port, rep.name


def test_replicas_added_and_removed_through_dns_mid_load(dnsmasq):
    port = free_port()
    hosts = [f"127.0.0.{i}" for i in (2, 3, 4, 5)]
    d = dnsmasq(hosts[:2])
    cfg = {k: dict(v) for k, v in FAST.items()}
    cfg.update({"brain": {"protocol": "endpoint-picker"},
                "discovery": {"source": "dns", "dns_name": NAME, "port": port, "interval_s": 0.3,
                              "dns_servers": [f"127.0.0.1:{d.port}"]}})
    s = Stack(0, config=cfg, mock_args=["--speedup", "20"])
    load = None
    try:
        reps = [Hosted(s.start_replica(f"m{i}", port, ["--speedup", "20", "--host", h]), h) for i, h in enumerate(hosts)]
        s.write_config()
        s.start_brain()
        s.start_envoy()
        by_host = lambda st: {r["url"].split("//")[1].rsplit(":", 1)[0]: r for r in st["replicas"]}  # noqa: E731
        wait_for(lambda: set(by_host(s.state())) == set(hosts[:2]), 15, "the first two records discovered")
        s.wait_all_live(30)
        load = Load(s.url)
        wait_for(lambda: load.ok >= 10, 30, "traffic")
        # two more records: they start EJECTED, earn LIVE from their scrapes and then take traffic
        d.reload(hosts)
        t_added = time.monotonic()
        wait_for(lambda: all(by_host(x := s.state()).get(h, {}).get("decisions", 0) > 0 for h in hosts[2:]), 30,
                 "the added replicas to take traffic")
        took_s = time.monotonic() - t_added
        window = FAST["health"]["probing_clean_window_s"] + 3 * FAST["health"]["scrape_interval_s"] + 2
        assert took_s < window + 5, took_s
        # one record removed: nothing new is sent to it once the brain has seen it go; its requests finish
        d.reload(hosts[1:])
        wait_for(lambda: hosts[0] not in by_host(s.state()), 10, "the removal seen")
        gone = reps[0]
        wait_for(lambda: in_flight(gone) == 0, 20, "its requests in flight to finish")
        settled = success_count(gone)
        ok_at_removal = load.ok
        wait_for(lambda: load.ok >= ok_at_removal + 30, 60, "more traffic after the removal")
        assert success_count(gone) == settled, "a request reached the removed replica after its removal was seen"
        load.stop()
        assert load.errors == [], load.errors[:5]
        st = s.state()
        assert st["discovery"]["synced"] and st["discovery"]["error"] is None
    finally:
        if load is not None:
            load.stop()
        s.stop()
