"""Several brains in the simulator (issue 33): ``K`` routers, each fed 1/K of the requests at random (what a
gateway spreading requests over K pickers, or clients spreading over K Envoys, does), each scraping every
replica itself, and each seeing the outcomes of its own requests only. With ``delay_s`` set, warmroute's
brains share state: every decision's events reach the other brains ``delay_s`` later, applied in order (what
the Redis stream does); ``None``: no sharing, each brain knows its own share (llm-d's active-active pickers
today, and warmroute with sharing off).

Named ``<policy>:<K>:<delay ms | off>`` (``warmroute:4:100``, ``llmd_epp_2025:4:off``).
"""

from __future__ import annotations

import random
from collections import deque
from typing import Callable

from extproc.core import RouterConfig
from extproc.tools.sim.policies import Policy, Warmroute, make_policy
from extproc.tools.workload.generate import Request


class Brains(Policy):
    uses_health = True

    def __init__(self, n: int, seed: int, k: int, delay_s: float | None, make: Callable[[int], Policy], name: str):
        super().__init__(n, seed)
        self.name = name
        self.brains = [make(seed + 7919 * i) for i in range(k)]
        self.pick = random.Random(seed ^ 0x5EED)
        self.delay_s = delay_s
        self.uses_health = self.brains[0].uses_health
        self.load_refresh_s = self.brains[0].load_refresh_s
        self.shared = delay_s is not None and all(isinstance(b, Warmroute) for b in self.brains)
        if self.shared:
            for b in self.brains:
                b.router.share()
        self._wire: deque[tuple[float, int, list]] = deque()  # (due, origin, events), in publish order
        self._chosen = 0  # the brain that chose last (the simulator asks it whether the replica was ejected)
        self._last = 0  # the brain whose request ended last: the outcome that follows is its Envoy's

    def attach(self, sim) -> None:
        for b in self.brains:
            b.attach(sim)

    def _publish(self, i: int, now: float) -> None:
        if self.shared:
            ev = self.brains[i].router.outbox.take()
            if ev:
                self._wire.append((now + self.delay_s, i, ev))

    def _deliver(self, now: float) -> None:
        w = self._wire
        while w and w[0][0] <= now:
            due, origin, ev = w.popleft()
            for j, b in enumerate(self.brains):
                if j != origin:
                    b.router.apply(str(origin), ev, 0.0, now)

    def choose(self, req: Request, now: float, exclude: frozenset[int] = frozenset()) -> int | None:
        self._deliver(now)
        i = req.extra.get("brain")
        if i is None:
            i = req.extra["brain"] = self.pick.randrange(len(self.brains))
        self._chosen = i
        out = self.brains[i].choose(req, now, exclude)
        self._publish(i, now)
        return out

    def retry_target(self, req: Request, now: float, exclude: frozenset[int]) -> int | None:
        b = self.brains[req.extra.get("brain", 0)]
        out = b.retry_target(req, now, exclude)
        return out

    def start(self, req: Request, i: int, now: float) -> None:
        super().start(req, i, now)
        self.brains[req.extra.get("brain", 0)].start(req, i, now)

    def done(self, req: Request, now: float) -> None:
        super().done(req, now)
        i = self._last = req.extra.get("brain", 0)
        self._deliver(now)
        self.brains[i].done(req, now)
        self._publish(i, now)

    def on_scrape(self, i, ok, now, sample=None):
        for b in self.brains:
            b.on_scrape(i, ok, now, sample)

    def on_load(self, i, sample, now):
        for b in self.brains:
            b.on_load(i, sample, now)

    def on_upstream(self, i, ok, now):
        self.brains[self._last].on_upstream(i, ok, now)

    def tick(self, now):
        self._deliver(now)
        for b in self.brains:
            b.tick(now)

    def routable(self, i):
        return any(b.routable(i) for b in self.brains)

    def ejected(self, i):
        return self.brains[self._chosen].ejected(i)

    def health_transitions(self):
        return self.brains[0].health_transitions()


def make(name: str, n: int, seed: int, router_cfg: RouterConfig | None = None) -> Policy:
    """Any policy of ``make_policy``, or several brains of one (``<policy>:<K>:<delay ms | off>``)."""
    spec = parse(name)
    if spec is None:
        return make_policy(name, n, seed, router_cfg)
    base, k, delay = spec
    return Brains(n, seed, k, delay, lambda s: make_policy(base, n, s, router_cfg), name)


def parse(name: str) -> tuple[str, int, float | None] | None:
    """``warmroute:4:100`` -> ("warmroute", 4, 0.1); ``llmd_epp_2025:4:off`` -> (..., None); else None."""
    parts = name.split(":")
    if len(parts) not in (2, 3):
        return None
    base, k = parts[0], parts[1]
    d = parts[2] if len(parts) == 3 else "off"
    if not k.isdigit() or int(k) < 1 or not (d == "off" or d.replace(".", "", 1).isdigit()):
        raise ValueError(f"policy {name!r}: expected <policy>:<brains>:<sync delay ms | off>")
    return base, int(k), None if d == "off" else float(d) / 1000


__all__ = ["Brains", "make", "parse"]
