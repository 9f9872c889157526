"""Replica discovery through a real DNS server on loopback (Debian's dnsmasq): records added and removed
while clients keep sending, behind Envoy in the endpoint-picker shape."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from extproc.config import DiscoveryConfig
from extproc.discovery import DiscoveryError
from extproc.discovery.dns import DnsSource
from bench.runs import discovery as bench_discovery
from bench.runs.discovery import NAME, Dnsmasq, free_dns_port, free_port
from extproc.tools.stack.local import Stack, wait_for

from .conftest import FAST

pytestmark = pytest.mark.integration


@pytest.fixture
def dnsmasq(tmp_path):
    made = []

    def make(addresses, port=None):
        try:
            d = Dnsmasq(tmp_path, addresses, port)
        except FileNotFoundError as e:
            pytest.skip(str(e))
        made.append(d)
        return d.wait_ready()

    yield make
    for d in made:
        d.stop()


def test_dns_source_reads_the_records_and_a_dead_resolver_is_an_error_not_an_empty_fleet(dnsmasq):
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


def test_replicas_added_and_removed_through_dns_mid_load(tmp_path):
    """Two records added mid-load take traffic (how long, against the health window, `make bench-discovery`
    prints), one removed: no client error, and no request reaches it once the brain has seen it go and its
    requests in flight have finished."""
    if shutil.which("dnsmasq") is None:
        pytest.skip("dnsmasq is not installed (make system-deps installs Debian's dnsmasq)")
    r = bench_discovery.run(tmp_path)
    assert set(r["took_s"]) == {"127.0.0.4", "127.0.0.5"}
    assert r["errors"] == 0, r["error_samples"]
    assert r["after_removal"] == 0
    assert r["ok"] >= 40


def test_the_brain_is_not_ready_until_discovery_first_answers(dnsmasq, tmp_path):
    """Gateways probe `readiness` (and the ext_proc service's name): NOT_SERVING while the fleet is unknown (the
    brain starts against a resolver that is not there yet), `liveness` SERVING all along; the resolver coming up
    makes it ready, without a restart."""
    from extproc.brain.healthcheck import check

    dns_port = free_dns_port()
    cfg = {k: dict(v) for k, v in FAST.items()}
    cfg.update({"brain": {"protocol": "endpoint-picker", "grpc_socket": None, "grpc_port": 0, "insecure": True},
                "discovery": {"source": "dns", "dns_name": NAME, "port": free_port(), "interval_s": 0.2,
                              "dns_servers": [f"127.0.0.1:{dns_port}"]}})
    s = Stack(0, config=cfg)
    try:
        s.write_config()
        s.start_brain()
        target = f"127.0.0.1:{s.brain_ports['grpc_port']}"
        assert check(target, "liveness")[0]
        for service in ("readiness", "envoy.service.ext_proc.v3.ExternalProcessor", ""):
            ok, line = check(target, service)
            assert not ok and "NOT_SERVING" in line, line
        wait_for(lambda: s.state()["discovery"]["error"], 10, "the failed lookup to be reported")
        dnsmasq(["127.0.0.2"], dns_port)  # the resolver the brain was told about comes up
        wait_for(lambda: check(target, "readiness")[0], 30, "readiness once discovery answered")
        st = s.state()
        assert st["discovery"]["synced"] and [r["url"] for r in st["replicas"]][0].startswith("http://127.0.0.2:")
    finally:
        s.stop()
