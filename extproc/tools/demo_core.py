"""``warmroute demo`` before Envoy: a scripted burst of agent traffic through the real core.

Four toy replicas (a request occupies its replica for a time that grows
with its prompt) are scraped every 3 s of virtual time, so the router sees
stale load between scrapes exactly as in production. The script walks
through start-up, session and prefix stickiness, a burst between two
scrapes, a replica dying and coming back through the health machine, and
a drain. Every decision and the replica table are printed.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from typing import Callable, TextIO

from extproc.core import ChainCache, Router, RouterConfig, Transition, build_profile


@dataclass
class ToyReplica:
    name: str
    alive: bool = True
    running: list[float] = field(default_factory=list)  # finish times

    def load(self, now: float) -> int:
        self.running = [t for t in self.running if t > now]
        return len(self.running)


PROJECTS = {
    "billing": "You are a coding agent working on the billing service. " * 60,
    "search": "You are a coding agent working on the search indexer. " * 60,
    "mobile": "You are a coding agent working on the mobile app. " * 60,
}


def _body(project: str, turn: int) -> bytes:
    import orjson

    history = [{"role": "user", "content": f"step {i}: " + "x" * 400} for i in range(turn)]
    return orjson.dumps(
        {
            "model": "demo",
            "messages": [{"role": "system", "content": PROJECTS[project]}, *history],
        }
    )


def run(out: TextIO, seed: int = 7, quiet: bool = False, policy: str | None = None) -> Router:
    rng = random.Random(seed)
    cfg = RouterConfig(seed=seed, **({"policy": policy} if policy else {}))
    names = ["r0", "r1", "r2", "r3"]
    replicas = {n: ToyReplica(n) for n in names}
    router = Router(cfg, names, now=0.0)
    chains = ChainCache() if router.needs_blocks else None
    say: Callable[[str], None] = (lambda s: None) if quiet else (lambda s: print(s, file=out))

    def on_transition(t: Transition) -> None:
        extra = f" cooldown={t.cooldown_s:.0f}s streak={t.streak}" if t.new.value == "EJECTED" else ""
        say(f"  t={t.at:6.1f}s  health  {t.replica}: {t.old.value} -> {t.new.value} ({t.reason}){extra}")

    router.listeners.append(on_transition)

    events: list[tuple[float, int, str, tuple]] = []
    seq = 0

    def at(t: float, kind: str, *args) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, args))
        seq += 1

    for k in range(0, 80):
        at(k * 3.0, "scrape")
    # 12 agent sessions over 3 projects, each a chain of turns with think time.
    sessions = [(f"sess-{i:02d}", list(PROJECTS)[i % 3]) for i in range(12)]
    for i, (sid, proj) in enumerate(sessions):
        at(20.0 + i * 1.5, "turn", sid, proj, 0)
    at(45.0, "banner", "A burst of 8 one-shot requests between two scrapes (the WLC blind spot)")
    for j in range(8):
        at(45.0 + j * 0.01, "oneshot", j)
    at(70.0, "banner", "r2 dies: scrapes fail")
    at(70.0, "kill", "r2")
    at(100.0, "banner", "r2 is back: it must earn 2 good scrapes after its cooldown, then 15 s PROBING")
    at(100.0, "revive", "r2")
    at(150.0, "banner", "operator drains r1: no new traffic or pins, in-flight work finishes")
    at(150.0, "drain", "r1")
    at(200.0, "table")
    at(200.0, "stop")

    say(f"warmroute core demo ({router.policy.name} policy): 4 toy replicas, scraped every 3 s of virtual time\n")
    say("  start-up: every replica starts EJECTED and must earn 2 good scrapes + a 15 s clean window")
    shown_table_at = -1.0
    while events:
        now, _, kind, args = heapq.heappop(events)
        if kind == "stop":
            break
        if kind == "scrape":
            for n, rep in replicas.items():
                if rep.alive:
                    router.on_scrape(n, True, now, running=rep.load(now), waiting=0)
                else:
                    router.on_scrape(n, False, now)
            if now - shown_table_at >= 30.0 and now >= 18.0:
                shown_table_at = now
                _table(router, now, say)
            continue
        if kind == "banner":
            say(f"\n  --- {args[0]}")
            continue
        if kind == "kill":
            replicas[args[0]].alive = False
            replicas[args[0]].running.clear()
            continue
        if kind == "revive":
            replicas[args[0]].alive = True
            continue
        if kind == "drain":
            router.drain(args[0])
            continue
        if kind == "table":
            _table(router, now, say)
            continue
        if kind == "done":
            router.release(args[0], now)
            continue
        if kind == "turn":
            sid, proj, turn = args
            body = _body(proj, turn)
            headers = {"x-session-id": sid}
            label = f"{sid} ({proj}) turn {turn}"
        else:
            body = _body("search", 0)
            headers = {}
            label = f"one-shot #{args[0]}"
        prof = build_profile(headers, body, router.profile_cfg, chains)
        d = router.select(prof, now)
        ev = " ".join(f"{e.action}:{e.kind}" + (f"({e.cause})" if e.cause and e.cause != "new" else "") for e
                      in d.events)
        est = f" cached {d.cached_tokens:>5} ttft~{d.predicted_ttft_s:.2f}s" if d.predicted_ttft_s is not None else ""
        say(f"  t={now:6.1f}s  {label:<28} -> {d.replica_name or '-':<3} {d.reason:<9}{est} {ev}")
        if d.replica is None:
            continue
        rep = replicas[d.replica_name]
        service = 1.0 + prof.tokens / 4000
        if rep.alive:
            rep.running.append(now + service)
            at(now + service, "done", d.reservation)
        else:
            at(now + 0.05, "done", d.reservation)
        if kind == "turn" and turn < 12:
            at(now + service + rng.uniform(2.0, 6.0), "turn", sid, proj, turn + 1)
        continue
    # finish every request still in flight
    while events:
        now, _, kind, args = heapq.heappop(events)
        if kind == "done":
            router.release(args[0], now)
    return router


def _table(router: Router, now: float, say: Callable[[str], None]) -> None:
    say(f"\n  replica table at t={now:.1f}s")
    say(f"  "
        f"{'replica':<8}{'state':<9}{'drained':<9}{'eff_run':>8}{'eff_wait':>9}{'in_flight':>10}{'sess_pins':>10}{'pfx_pins':>9}{'cooldown':>9}")
    for r in router.snapshot():
        say(
            f"  {r['name']:<8}{r['state']:<9}{str(r['drained']):<9}{r['effective_running']:>8.1f}"
            f"{r['effective_waiting']:>9.1f}{r['wlc_in_flight']:>10.1f}{r['session_pins']:>10}"
            f"{r['prefix_pins']:>9}{r['cooldown_s']:>8.0f}s"
        )
    say("")
