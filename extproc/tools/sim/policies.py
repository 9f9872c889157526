"""Routing policies to compare in the simulator.

``Warmroute`` drives the real core (``extproc.core.Router``), not a copy;
its ablations switch one rule off through the core's own config. The
others model what a user would deploy instead: Envoy's ROUND_ROBIN,
LEAST_REQUEST (power of two choices on in-flight requests) and RING_HASH
on the session key. Those know nothing of replica health beyond what a
refused connection tells them, as with Envoy's built-ins without outlier
detection: a request to a dead replica is retried once elsewhere.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import random

from ...core import RequestProfile, Router, RouterConfig, hash_key
from .workload import Request


class Policy:
    name = "policy"
    uses_health = False

    def __init__(self, n: int, seed: int):
        self.n = n
        self.rng = random.Random(seed)
        self.in_flight = [0] * n

    def choose(self, req: Request, now: float, exclude: frozenset[int] = frozenset()) -> int | None:
        raise NotImplementedError

    def retry_target(self, req: Request, now: float, exclude: frozenset[int]) -> int | None:
        """Where Envoy retries a request whose replica refused the connection."""
        return self.choose(req, now, exclude)

    def start(self, req: Request, i: int, now: float) -> None:
        self.in_flight[i] += 1

    def done(self, req: Request, now: float) -> None:
        if req.replica is not None:
            self.in_flight[req.replica] -= 1

    def on_scrape(self, i: int, ok: bool, now: float, running: int = 0, waiting: int = 0, kv: float = 0.0) -> None:
        pass

    def on_upstream(self, i: int, ok: bool, now: float) -> None:
        pass

    def tick(self, now: float) -> None:
        pass


class RoundRobin(Policy):
    name = "envoy_round_robin"

    def __init__(self, n: int, seed: int):
        super().__init__(n, seed)
        self.next = 0

    def choose(self, req, now, exclude=frozenset()):
        for _ in range(self.n):
            i = self.next
            self.next = (self.next + 1) % self.n
            if i not in exclude:
                return i
        return None


class LeastRequest(Policy):
    """Envoy's LEAST_REQUEST: two random choices, the one with fewer active requests wins."""

    name = "envoy_least_request"

    def choose(self, req, now, exclude=frozenset()):
        pool = [i for i in range(self.n) if i not in exclude]
        if not pool:
            return None
        a, b = self.rng.choice(pool), self.rng.choice(pool)
        return a if self.in_flight[a] <= self.in_flight[b] else b


class RingHash(Policy):
    """Envoy's RING_HASH on the session header (a one-shot has its own key)."""

    name = "envoy_ring_hash"

    def __init__(self, n: int, seed: int, vnodes: int = 100):
        super().__init__(n, seed)
        ring = []
        for i in range(n):
            for v in range(vnodes):
                ring.append((int.from_bytes(hashlib.md5(f"r{i}-{v}".encode()).digest()[:8], "big"), i))
        ring.sort()
        self.keys = [k for k, _ in ring]
        self.owners = [o for _, o in ring]

    def choose(self, req, now, exclude=frozenset()):
        h = int.from_bytes(hashlib.md5(f"s{req.sid}".encode()).digest()[:8], "big")
        j = bisect.bisect(self.keys, h)
        for k in range(len(self.keys)):
            o = self.owners[(j + k) % len(self.keys)]
            if o not in exclude:
                return o
        return None


class Warmroute(Policy):
    """The real routing core behind the simulator's clock."""

    name = "warmroute"
    uses_health = True

    def __init__(self, n: int, seed: int, cfg: RouterConfig | None = None, name: str | None = None):
        super().__init__(n, seed)
        self.router = Router(dataclasses.replace(cfg or RouterConfig(), seed=seed), [f"r{i}" for i in range(n)], 0.0)
        if name:
            self.name = name
        self._session_keys: dict[int, bytes] = {}
        self._prefix_keys: dict[int, bytes] = {}
        self.pins_on_non_live = 0  # a pin created or moved onto a replica that is not LIVE (must stay 0)

    def _profile(self, req: Request) -> RequestProfile:
        sk = None
        if not req.oneshot:
            sk = self._session_keys.get(req.sid)
            if sk is None:
                sk = self._session_keys[req.sid] = hash_key("session", None, str(req.sid))
        pk = self._prefix_keys.get(req.project)
        if pk is None:
            pk = self._prefix_keys[req.project] = hash_key("prefix", None, f"project-{req.project}")
        return RequestProfile(sk, pk, req.prompt_tokens, "ok")

    def choose(self, req, now, exclude=frozenset()):
        d = self.router.select(self._profile(req), now)
        if d.replica is None:
            return None
        req.extra["reservation"] = d.reservation
        req.extra["reason"] = d.reason
        if any(e.action in ("pin", "rebind") for e in d.events) and d.replica.state.value != "LIVE":
            self.pins_on_non_live += 1
        for e in d.events:
            key = f"{e.action}:{e.kind}" + (f":{e.cause}" if e.cause and e.cause != "new" else "")
            req.extra.setdefault("events", []).append(key)
        return int(d.replica.name[1:])

    def retry_target(self, req, now, exclude):
        # Envoy retries without asking the brain: the replica cluster's priority 1 (the other
        # replicas) with LEAST_REQUEST, i.e. two random choices on active requests.
        pool = [i for i in range(self.n) if i not in exclude]
        if not pool:
            return None
        a, b = self.rng.choice(pool), self.rng.choice(pool)
        return a if self.in_flight[a] <= self.in_flight[b] else b

    def done(self, req, now):
        super().done(req, now)
        self.router.release(req.extra.pop("reservation", None), now)

    def on_scrape(self, i, ok, now, running=0, waiting=0, kv=0.0):
        self.router.on_scrape(f"r{i}", ok, now, running, waiting, kv)

    def on_upstream(self, i, ok, now):
        self.router.on_upstream(f"r{i}", ok, now)

    def tick(self, now):
        self.router.tick(now)


def ablation(name: str, n: int, seed: int) -> Warmroute:
    """warmroute with one rule switched off (the simulator's ablations)."""
    base = RouterConfig()
    cfgs = {
        "warmroute_no_pin_ttl": dataclasses.replace(base, pins=dataclasses.replace(base.pins, ttl_enabled=False)),
        "warmroute_no_spill": dataclasses.replace(base, pins=dataclasses.replace(base.pins, spill_enabled=False)),
        "warmroute_no_wlc": dataclasses.replace(base, wlc_enabled=False),
        "warmroute_no_no_wait": dataclasses.replace(base, no_wait_enabled=False),
        # the seed's first version: pins lived forever and never moved
        "warmroute_no_ttl_no_spill": dataclasses.replace(
            base, pins=dataclasses.replace(base.pins, ttl_enabled=False, spill_enabled=False)),
    }
    return Warmroute(n, seed, cfgs[name], name)


POLICIES = ["warmroute", "envoy_round_robin", "envoy_least_request", "envoy_ring_hash",
            "warmroute_no_pin_ttl", "warmroute_no_spill", "warmroute_no_wlc", "warmroute_no_no_wait"]


def make_policy(name: str, n: int, seed: int, router_cfg: RouterConfig | None = None) -> Policy:
    if name == "warmroute":
        return Warmroute(n, seed, router_cfg)
    if name.startswith("warmroute_"):
        return ablation(name, n, seed)
    return {"envoy_round_robin": RoundRobin, "envoy_least_request": LeastRequest, "envoy_ring_hash": RingHash}[name](n, seed)


__all__ = ["Policy", "RoundRobin", "LeastRequest", "RingHash", "Warmroute", "ablation", "make_policy", "POLICIES"]
