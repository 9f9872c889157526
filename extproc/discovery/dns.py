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
        answered, errors = False, []
        for rdtype in ("A", "AAAA"):
            try:
                answer = await self.resolver.resolve(name, rdtype, search=True)
            except dns.resolver.NoAnswer:
                answered = True  # the name exists, without records of this family
                continue
            except dns.resolver.NXDOMAIN:
                continue
            except dns.exception.DNSException as e:
                # a resolver that refuses one family (no upstream for AAAA) must not hide the other's records
                errors.append(f"{rdtype}: {type(e).__name__}: {e}")
                continue
            answered = True
            addresses += [r.address for r in answer]
        if errors and not addresses:
            raise DiscoveryError(f"dns {name} {'; '.join(errors)}"[:300])
        if not answered:
            # NXDOMAIN for both: a typo, or a name not yet created; the last good set stays rather than none
            raise DiscoveryError(f"dns {name}: no such name (NXDOMAIN)")
        return [spec(self.d, replica_name("dns", a, port), a, port) for a in sorted(set(addresses))]

    async def close(self) -> None:
        pass
