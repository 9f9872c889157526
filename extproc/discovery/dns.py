"""Replicas from DNS: the A and AAAA records of one name (a headless Service lists its ready pods), on
one port, resolved again every ``interval_s``. dnspython asks the configured servers (or the system's)
itself, so a test can point it at a resolver on a loopback port."""

from __future__ import annotations

import asyncio

import dns.asyncresolver
import dns.exception
import dns.resolver

from ..config import DiscoveryConfig, ReplicaSpec
from . import DiscoveryError, replica_name, spec

_TIMEOUT_S = 2.0  # one lookup's bound: a dead resolver must not hold discovery up for its default 5 s x tries


class DnsSource:
    def __init__(self, d: DiscoveryConfig):
        self.d = d
        self.changed = asyncio.Event()
        if d.dns_servers:
            r = dns.asyncresolver.Resolver(configure=False)
            r.nameservers = [s.rpartition(":")[0] if s.count(":") == 1 else s for s in d.dns_servers]
            ports = {s.rpartition(":")[2] for s in d.dns_servers if s.count(":") == 1}
            if ports:
                r.port = int(sorted(ports)[0])  # dnspython asks every server on one port
        else:
            r = dns.asyncresolver.Resolver()
        r.lifetime = _TIMEOUT_S
        self.resolver = r

    async def lookup(self) -> list[ReplicaSpec]:
        name, port = self.d.dns_name, self.d.port
        addresses: list[str] = []
        answered = False
        for rdtype in ("A", "AAAA"):
            try:
                answer = await self.resolver.resolve(name, rdtype, search=True)
            except (dns.resolver.NoAnswer, dns.resolver.NXDOMAIN):
                # NXDOMAIN: a headless Service with no ready pod has no records at all; an answer for the other
                # family may still come. Both empty is an empty fleet only if the name exists (NoAnswer)
                continue
            except dns.exception.DNSException as e:
                raise DiscoveryError(f"dns {name} {rdtype}: {type(e).__name__}: {e}"[:300]) from None
            answered = True
            addresses += [r.address for r in answer]
        if not answered:
            raise DiscoveryError(f"dns {name}: no A or AAAA records (is the name right?)")
        return [spec(self.d, replica_name("dns", a, port), a, port) for a in sorted(set(addresses))]

    async def close(self) -> None:
        pass
