"""``make bench-brains``: several brains sharing state (issue 33), measured side by side in one run.

- ``warm``: a brain's view with 100K sessions on 8 replicas (full prefix indexes) written as the snapshot to a real
  Redis; a new brain warms from it (snapshot + stream replay): seconds, and Redis's memory per session and per block.
- ``overhead``: decisions per second of the core with sharing on (its events written) against off, in one process,
  interleaved; and what applying another brain's events costs per decision.
- ``live``: the agent workload on mock replicas (time-compressed), clients alternating between two Envoys request by
  request: one brain taking all the traffic, two brains sharing through Redis, the same two with sharing off. Then,
  with sharing, one brain killed mid-run (hits in the 30 workload-seconds before and after), and Redis killed and
  brought back (hits in the 30 s after it returned).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

from bench.harness import bench_workload, live_router, scaled_warmroute_config, workload_arguments
from extproc.config import SharedStateConfig
from extproc.core import Router, hash_key
from extproc.core.blocks import chain_seed
from extproc.core.profile import RequestProfile
from extproc.core.shared import export_state
from extproc.tools.stack.brains import BrainsStack
from extproc.tools.stack.redis_server import RedisServer
from extproc.tools.workload.http_replay import replay
from extproc.tools.workload.measure import window_numbers


def _scrape(r: Router, now: float) -> None:
    for x in r.replicas:
        r.on_scrape(x.name, True, now)


def _profile(sid: int, turn: int, system: int) -> RequestProfile:
    blocks = [chain_seed("system", str(system), str(j)) for j in range(64)] + \
        [chain_seed(str(sid), str(j)) for j in range(24 + 8 * turn)]
    return RequestProfile(hash_key("session", None, str(sid)), None, len(blocks) * 16, "ok", None, blocks)


# ---------------------------------------------------------------------------------------------------- warm start


def warm(sessions: int, replicas: int) -> None:
    from extproc.brain.shared import SharedState

    a, now = live_router(replicas)
    t0 = time.monotonic()
    for sid in range(sessions):
        d = a.select(_profile(sid, sid % 3, sid % 20), now)
        a.release(d.reservation, now)
        now += 0.001
        if sid % 1000 == 0:  # a replica not scraped for a while would be ejected, its index cleared
            _scrape(a, now)
    blocks = sum(len(a.policy.index_of(r, None)) for r in a.replicas)
    print(f"a brain's view: {sessions} sessions on {replicas} replicas, {blocks} indexed blocks "
          f"(built in {time.monotonic() - t0:.1f} s)")
    with tempfile.TemporaryDirectory() as d, RedisServer(Path(d)) as redis:
        cfg = SharedStateConfig(redis_url=redis.url, brain_id="writer")
        clock = time.monotonic
        view_now = now  # the writer's view was built on the simulated clock: its snapshot's ages are read on it

        def writer_clock() -> float:
            return view_now

        async def go():
            import redis.asyncio as aredis

            w = SharedState(cfg, a, writer_clock)
            await w.warm_start()
            t = time.monotonic()
            size = await w.write_snapshot()
            wrote = time.monotonic() - t
            c = aredis.Redis.from_url(redis.url)
            mem = (await c.info("memory"))["used_memory"]
            base = 1_000_000  # an empty Redis's own
            await c.aclose()
            await w.close()
            b, _ = live_router(replicas)
            reader = SharedState(SharedStateConfig(redis_url=redis.url, brain_id="reader"), b, clock)
            t = time.monotonic()
            ok = await reader.warm_start()
            took = time.monotonic() - t
            await reader.close()
            return size, wrote, mem, base, ok, took, b

        size, wrote, mem, base, ok, took, b = asyncio.run(go())
    same = sum(1 for sid in range(0, sessions, max(1, sessions // 1000))
               if (p := b.policy.session_pins.peek(hash_key("session", None, str(sid)))) is not None
               and p.replica.name == a.policy.session_pins.peek(hash_key("session", None, str(sid))).replica.name)
    import zlib

    import orjson

    state = export_state(a, now)
    pins_b = len(zlib.compress(orjson.dumps(state["pins"]), 1))
    index_b = len(zlib.compress(orjson.dumps(state["index"]), 1))
    print(f"snapshot: {size / 1e6:.1f} MB compressed, written in {wrote:.2f} s (off the request path): "
          f"{pins_b / sessions:.0f} B per session, {index_b / blocks:.1f} B per indexed block; Redis used_memory "
          f"{mem / 1e6:.1f} MB with it (the index is bounded by the replicas' caches, the pins by pins.max_pins)")
    print(f"warm start of a new brain: {took:.2f} s ({'ok' if ok else 'FAILED'}); sessions found at the same home "
          f"(1 in {max(1, sessions // 1000)} checked): {same}/{len(range(0, sessions, max(1, sessions // 1000)))}")


# ------------------------------------------------------------------------------------------------------ overhead


def overhead(rounds: int, per_round: int) -> None:
    """Decisions/s of one brain with sharing off and on, interleaved rounds; the apply cost on another brain."""
    import orjson

    rng = random.Random(1)
    results: dict[str, list[float]] = {"off": [], "on": []}
    apply_s: list[float] = []
    wire: list[float] = []
    for k in range(rounds):
        for mode in (("off", "on") if k % 2 == 0 else ("on", "off")):
            r, now = live_router(8)
            other, _ = live_router(8)
            if mode == "on":
                r.share()
            held, wire_bytes = [], 0
            # a session's next turn extends the same chain list, as the brain's ChainCache hands it out
            chains: dict[int, tuple[RequestProfile, int]] = {}
            profiles = []  # (the session's profile, the blocks its turn adds), extended in the timed loop
            for _ in range(per_round):
                sid = rng.randrange(400)
                p, n = chains.get(sid, (None, 0))
                if p is None or n > 400:
                    p = _profile(sid, 0, sid % 20)
                    profiles.append((p, []))
                    n = len(p.blocks)
                else:
                    profiles.append((p, [chain_seed(str(sid), "t", str(n + j)) for j in range(8)]))
                    n += 8
                chains[sid] = (p, n)
            # timed: the decisions and what the flusher does with their events (take, write out); untimed: the other
            # brain applying them, as it would in its own process
            took = applying = 0.0
            t = time.perf_counter()
            for i, (p, more) in enumerate(profiles):
                if i % 500 == 0:
                    _scrape(r, now)
                p.blocks.extend(more)
                d = r.select(RequestProfile(p.session_key, None, len(p.blocks) * 16, "ok", None, p.blocks), now)
                held.append(d.reservation)
                if len(held) > 32:
                    r.release(held.pop(0), now)
                if i % 8 == 0 and r.outbox is not None:  # the flusher takes and writes them out every few ms
                    events = r.outbox.take()
                    wire_bytes += len(orjson.dumps(events, default=_hex))
                    t1 = time.perf_counter()
                    took += t1 - t
                    other.apply("x", events, 0.0, now)
                    t = time.perf_counter()
                    applying += t - t1
                now += 0.002
            took += time.perf_counter() - t
            results[mode].append(per_round / took)
            if mode == "on":
                apply_s.append(applying / per_round)
                wire.append(wire_bytes / per_round)
    off, on = statistics.median(results["off"]), statistics.median(results["on"])
    print(f"decisions/s, 8 replicas, median of {rounds} interleaved rounds: sharing off {off:,.0f}, on {on:,.0f} "
          f"(a decision costs {off / on:.3f}x with sharing on)")
    print(f"applying another brain's events: {statistics.median(apply_s) * 1e6:.1f} us per decision it made; "
          f"{statistics.median(wire):.0f} B of stream per decision (the stream is trimmed to "
          f"shared_state.stream_max_entries entries of one flush each)")


# ---------------------------------------------------------------------------------------------------------- live


def _hex(x):
    if isinstance(x, bytes):
        return x.hex()
    raise TypeError(type(x).__name__)


def _hits(requests, lo: float, hi: float) -> float:
    ok = [r for r in requests if r.error is None and r.ttft is not None and lo <= r.arrival < hi]
    prompt = sum(r.prompt_tokens for r in ok)
    return sum(r.cached_tokens for r in ok) / prompt if prompt else float("nan")


def _run(brains: int, shared: bool, args, fault: str | None = None):
    sp = args.speedup
    w = bench_workload(args.minutes, args.sessions_per_min, args.oneshots_per_min, args.projects)
    with BrainsStack(args.replicas, brains, config=scaled_warmroute_config(sp), mock_args=["--speedup", str(sp)],
                     shared=shared) as b:
        b.wait_all_live(60)
        at = args.minutes * 60 * 0.6  # workload seconds
        done = threading.Event()

        def inject():
            if done.wait(at / sp):
                return
            if fault == "brain":
                b.stacks[1].brain.kill()
            elif fault == "redis":
                b.redis.kill()
                if not done.wait(10 / sp):
                    b.redis.start()

        t = threading.Thread(target=inject, daemon=True)
        t.start()
        urls = b.urls if brains > 1 else b.urls * 2
        res = asyncio.run(replay(urls, w, seed=args.seed, speedup=sp, timeout=max(60.0, args.minutes * 60 / sp)))
        done.set()
        t.join(5)
    nums = window_numbers(res.requests, args.minutes, args.warmup_min, scale=sp)
    nums["errors"] = sum(res.errors.values())
    if fault == "brain":
        nums["before"], nums["after"] = _hits(res.requests, at - 30, at), _hits(res.requests, at, at + 30)
    elif fault == "redis":
        back = at + 10
        nums["before"], nums["after"] = _hits(res.requests, at - 30, at), _hits(res.requests, back, back + 30)
    return nums


def live(args) -> None:
    print(f"{args.replicas} mock replicas at {args.speedup:g}x, {args.minutes:g} workload minutes, seed {args.seed}; "
          "clients alternate between the Envoys request by request")
    rows = [("one brain", _run(1, False, args)), ("two brains, sharing", _run(2, True, args)),
            ("two brains, sharing off", _run(2, False, args))]
    one = rows[0][1]
    print(f"{'':26}{'hits':>8}{'TTFT p50':>10}{'p99':>8}{'errors':>8}   vs one brain: hits, p50, p99")
    for name, n in rows:
        print(f"{name:26}{n['hits']:8.1%}{n['ttft_p50']:10.2f}{n['ttft_p99']:8.2f}{n['errors']:8d}   "
              f"{100 * (n['hits'] - one['hits']):+5.1f} pt {n['ttft_p50'] / one['ttft_p50']:.2f}x "
              f"{n['ttft_p99'] / one['ttft_p99']:.2f}x")
    for fault, what in (("brain", "one of two brains killed"), ("redis", "Redis killed for 10 s and back")):
        n = _run(2, True, args, fault)
        returned = " it returned" if fault == "redis" else ""
        print(f"{what}: {n['errors']} client errors; hits {n['before']:.1%} in the 30 s before, {n['after']:.1%} in "
              f"the 30 s after{returned} ({100 * (n['after'] - n['before']):+.1f} pt)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="overhead,warm,live")
    ap.add_argument("--sessions", type=int, default=100_000)
    ap.add_argument("--replicas", type=int, default=4)
    workload_arguments(ap)
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    if "overhead" in parts:
        overhead(15, 2000)
    if "warm" in parts:
        warm(args.sessions, 8)
    if "live" in parts:
        live(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
