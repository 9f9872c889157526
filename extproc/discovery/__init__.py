"""Where replicas come from (DESIGN "Sources"): a file, DNS, or Kubernetes, behind one interface that
hands the brain a plain replica set. The fleet never learns which source spoke.

A source's ``lookup`` returns the set now, or raises ``DiscoveryError``: then the last good set stays
(a resolver or an API server that is down must never empty the fleet). ``changed`` is set by a source
that can tell early (a Kubernetes watch); every source is also asked again every ``interval_s``.
"""

from __future__ import annotations

import asyncio
import re
from typing import Callable, Protocol

from ..config import AppConfig, DiscoveryConfig, ReplicaSpec
from ..core.bounded import within


# A fleet is 4 to a few hundred replicas; a source that names more (a selector matching every pod, a resolver
# answering with a whole network) would start a scrape loop per address: refused, and the last good set kept
MAX_REPLICAS = 1000


class DiscoveryError(Exception):
    """A lookup that failed; the message names what failed, in one line."""


class Source(Protocol):
    changed: asyncio.Event

    async def lookup(self) -> list[ReplicaSpec]: ...

    async def close(self) -> None: ...


def replica_name(prefix: str, address: str, port: int) -> str:
    """A replica name from where it is: ``<prefix>-<address>-<port>``, in the characters names allow."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", f"{prefix}-{address}-{port}".strip("[]"))[:63]


def spec(d: DiscoveryConfig, name: str, address: str, port: int, role: str = "both",
         kv_ports: tuple[int | None, int | None] = (None, None)) -> ReplicaSpec:
    """A discovered replica; ``kv_ports``: its own KV events (publisher, replay) ports, else the config's."""
    host = f"[{address}]" if ":" in address else address
    pub, replay = kv_ports if kv_ports[0] is not None else (d.kv_events_port, d.kv_events_replay_port)
    kv = tuple((f"tcp://{host}:{pub + k}", f"tcp://{host}:{replay + k}" if replay is not None else None)
               for k in range(d.kv_events_data_parallel_size)) if pub is not None else ()
    return ReplicaSpec(name, f"{d.scheme}://{host}:{port}", d.engine, role=role, kv_events=kv)


class StaticSource:
    """The config file's ``replicas``: one lookup, never a change (a SIGHUP reload changes them)."""

    def __init__(self, replicas: tuple[ReplicaSpec, ...]):
        self.replicas = list(replicas)
        self.changed = asyncio.Event()

    async def lookup(self) -> list[ReplicaSpec]:
        return list(self.replicas)

    async def close(self) -> None:
        pass


def make_source(cfg: AppConfig) -> Source:
    d = cfg.discovery
    if d.source == "dns":
        from .dns import DnsSource

        return DnsSource(d)
    if d.source == "kubernetes":
        from .kubernetes import KubernetesSource

        return KubernetesSource(d)
    return StaticSource(cfg.replicas)


async def follow(source: Source, interval_s: float, apply: Callable[[list[ReplicaSpec]], None],
                 failed: Callable[[str], None], succeeded: Callable[[], None] = lambda: None) -> None:
    """Ask ``source`` every ``interval_s`` (sooner when it says it changed); ``apply`` each new set, ``failed``
    each failure's message, ``succeeded`` after every good lookup. Runs until cancelled."""
    last: list[ReplicaSpec] | None = None
    while True:
        source.changed.clear()
        try:
            found = sorted(await source.lookup(), key=lambda r: r.name)
            if len(found) > MAX_REPLICAS:
                raise DiscoveryError(f"{len(found)} replicas found, more than {MAX_REPLICAS}: is the selector or name "
                                     "right?")
        except DiscoveryError as e:
            failed(str(e))
        except Exception as e:  # a library's own error must not end discovery: the last good set stays
            failed(f"{type(e).__name__}: {e}"[:300])
        else:
            if found != last:
                apply(found)
                last = found
            succeeded()
        try:  # within, not wait_for: a cancel that lands as the source says it changed must end the loop
            await within(source.changed.wait(), interval_s)
        except TimeoutError:
            pass


__all__ = ["MAX_REPLICAS", "DiscoveryError", "Source", "StaticSource", "follow", "make_source", "replica_name", "spec"]
