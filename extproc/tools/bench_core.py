"""``make bench-core``: decisions per second of the routing core, and bytes per pin.

A decision here is select + reserve + release, the work the brain does per
request besides parsing. Each row also times a plain round-robin loop over
the same replicas in the same run, so the ratio survives a noisy machine.
Targets (issue 2): >= 50,000 decisions/s at 4 replicas, >= 20,000 at 30,
<= 400 bytes per pin at 1M pins.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import random
import time
import tracemalloc
from collections import deque

from ..core import HealthConfig, PinTable, RequestProfile, Router, RouterConfig


def _key(kind: str, i: int) -> bytes:
    return hashlib.md5(f"{kind}:{i}".encode()).digest()


def _live_router(n: int) -> tuple[Router, float]:
    # stale scrapes are not the point here: the benchmark feeds no scrapes while it runs
    cfg = RouterConfig(health=HealthConfig(stale_scrape_intervals=1e12))
    router = Router(cfg, [f"r{i}" for i in range(n)], 0.0)
    t = 0.0
    for _ in range(8):
        for r in router.replicas:
            router.on_scrape(r.name, True, t)
        t += 3.0
    return router, t


def _profiles(rng: random.Random, sessions: int, count: int) -> list[RequestProfile]:
    prompts = [_key("prefix", i) for i in range(20)]
    out = []
    for _ in range(count):
        s = rng.randrange(sessions)
        out.append(RequestProfile(_key("session", s), rng.choice(prompts), rng.choice([300, 2000, 8000, 40000]), "ok"))
    return out


def decisions_per_second(n_replicas: int, pins: int, decisions: int, seed: int = 1) -> tuple[float, float]:
    """(warmroute decisions/s, round-robin baseline decisions/s) with ``pins`` live session pins."""
    rng = random.Random(seed)
    router, now = _live_router(n_replicas)
    reps = router.replicas
    for i in range(pins):
        router.session_pins.put(_key("session", i), reps[i % n_replicas], now)
    profiles = _profiles(rng, pins, 10_000)
    in_flight: deque = deque()
    window = 2 * n_replicas  # some requests stay in flight so loads differ between decisions
    gc.collect()
    t0 = time.perf_counter()
    for i in range(decisions):
        d = router.select(profiles[i % 10_000], now)
        in_flight.append(d.reservation)
        if len(in_flight) > window:
            router.release(in_flight.popleft(), now)
    t1 = time.perf_counter()
    for res in in_flight:
        router.release(res, now)

    # baseline: round-robin with the same per-request bookkeeping shape (a dict lookup and a counter)
    table = {p.session_key: 0 for p in profiles}
    counts = [0] * n_replicas
    rr = 0
    t2 = time.perf_counter()
    for i in range(decisions):
        p = profiles[i % 10_000]
        table.get(p.session_key)
        rr = (rr + 1) % n_replicas
        counts[rr] += 1
    t3 = time.perf_counter()
    return decisions / (t1 - t0), decisions / (t3 - t2)


def bytes_per_pin(pins: int) -> float:
    """Python heap per pin (key digest, Pin object, table entry) at ``pins`` pins."""
    router, now = _live_router(4)
    reps = router.replicas
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    table = PinTable("session", 3600.0)
    for i in range(pins):
        table.put(_key("session", i), reps[i & 3], now + i * 1e-6)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert len(table) == pins
    return (after - before) / pins


def metrics_cost(decisions: int = 50_000) -> tuple[float, float]:
    """µs per Brain.decide (2 KB body) with the Prometheus bookkeeping, and with it replaced by no-ops."""
    import orjson

    from ..config import parse_config
    from ..brain.brain import Brain

    def run(with_metrics: bool) -> float:
        t = [0.0]
        brain = Brain(parse_config({"replicas": [{"name": f"r{i}", "url": f"http://127.0.0.1:{9000 + i}"} for i in range(4)],
                                    "health": {"stale_scrape_intervals": 1e12}}), clock=lambda: t[0])
        for k in range(8):
            t[0] = 3.0 * k
            for r in brain.router.replicas:
                brain.router.on_scrape(r.name, True, t[0])
        if not with_metrics:
            class _Nop:
                def observe(self, *_):
                    pass

            brain.decision_seconds = _Nop()
            brain.stats.record_decision = lambda *_: None
        body = orjson.dumps({"messages": [{"role": "system", "content": "You are a coding agent. " * 40},
                                          {"role": "user", "content": "x" * 1000}]})
        headers = [{"x-session-id": f"s{i % 500}", "x-request-id": f"q{i}"} for i in range(decisions)]
        gc.collect()
        t0 = time.perf_counter()
        for h in headers:
            brain.decide(h, body)
            res = brain.router.reservation(brain.router._next_reservation_id - 1)
            brain.router.release(res, t[0])
        return (time.perf_counter() - t0) / decisions * 1e6

    run(True)  # warm-up
    return run(True), run(False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decisions", type=int, default=200_000)
    ap.add_argument("--pins", type=int, default=100_000)
    ap.add_argument("--pin-memory-at", type=int, default=1_000_000)
    ap.add_argument("--replicas", type=int, nargs="+", default=[4, 30, 300])
    args = ap.parse_args(argv)

    targets = {4: 50_000, 30: 20_000}
    print(f"routing core: select + reserve + release, {args.pins:,} live session pins, {args.decisions:,} decisions")
    print(f"{'replicas':>8} {'decisions/s':>12} {'target':>8} {'round-robin/s':>14} {'rr/warmroute':>13}")
    for n in args.replicas:
        ours, rr = decisions_per_second(n, args.pins, args.decisions)
        tgt = targets.get(n)
        mark = "" if tgt is None else ("ok" if ours >= tgt else "MISSED")
        tgt_s = f"{tgt:,}" if tgt else "-"
        print(f"{n:>8} {ours:>12,.0f} {tgt_s:>8} {rr:>14,.0f} {rr / ours:>12.1f}x {mark}")
    with_m, without_m = metrics_cost()
    print(f"brain.decide with a 2 KB body: {with_m:.1f} µs with Prometheus bookkeeping, {without_m:.1f} µs without "
          f"(metrics {max(0.0, with_m - without_m) / with_m:.0%} of the decision)")
    bpp = bytes_per_pin(args.pin_memory_at)
    print(f"bytes per pin at {args.pin_memory_at:,} pins: {bpp:.0f} (target <= 400) {'ok' if bpp <= 400 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
