"""``warmroute sim``: run the simulator for one policy or compare them all on one workload."""

from __future__ import annotations

import argparse
import time

from .policies import POLICIES
from .report import share_plot, table
from .simulator import Fault, Simulation
from .workload import WorkloadConfig


def _fault(spec: str, flap: bool) -> Fault:
    """--kill R:START:DURATION  /  --flap R:START:DOWN:EVERY:UNTIL (seconds)."""
    parts = [float(x) for x in spec.split(":")]
    if flap:
        r, start, down, every, until = parts
        return Fault(int(r), start, down, every, until)
    r, start, dur = parts
    return Fault(int(r), start, dur)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--policy", default="warmroute", choices=POLICIES + ["warmroute_no_ttl_no_spill"])
    ap.add_argument("--compare", action="store_true", help="every policy on the same workload and seed")
    w = WorkloadConfig()  # one place per default: the workload's own
    ap.add_argument("--minutes", type=float, default=w.minutes)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--sessions-per-min", type=float, default=w.sessions_per_min)
    ap.add_argument("--oneshots-per-min", type=float, default=w.oneshots_per_min)
    ap.add_argument("--projects", type=int, default=w.projects)
    ap.add_argument("--kill", action="append", default=[], metavar="R:START:DURATION")
    ap.add_argument("--flap", action="append", default=[], metavar="R:START:DOWN:EVERY:UNTIL")
    ap.add_argument("--png", default=None, help="write traffic share over time per policy to this PNG")
    ap.add_argument("--transitions", action="store_true", help="print every health state change (warmroute)")


def run(args: argparse.Namespace) -> int:
    w = WorkloadConfig(minutes=args.minutes, sessions_per_min=args.sessions_per_min,
                       oneshots_per_min=args.oneshots_per_min, projects=args.projects)
    faults = tuple([_fault(s, False) for s in args.kill] + [_fault(s, True) for s in args.flap])
    policies = POLICIES if args.compare else [args.policy]
    print(f"{args.minutes:g} simulated minutes, {args.replicas} replicas, {args.sessions_per_min:g} agent sessions/min "
          f"over {args.projects} projects, {args.oneshots_per_min:g} one-shots/min, seed {args.seed}"
          + (f", faults {faults}" if faults else ""))
    results = []
    for p in policies:
        t0 = time.monotonic()
        r = Simulation(p, replicas=args.replicas, workload=w, seed=args.seed, faults=faults).run()
        results.append(r)
        print(f"  {p}: {len(r.requests)} requests in {time.monotonic() - t0:.1f} s wall", flush=True)
        if args.transitions:
            for t in r.transitions:
                extra = f" cooldown {t.cooldown_s:.0f}s" if t.new.value == "EJECTED" else ""
                print(f"    t={t.at:8.1f}s {t.replica}: {t.old.value} -> {t.new.value} ({t.reason}){extra}")
    print()
    print(table(results))
    if args.png:
        share_plot(results, args.png)
        print(f"\nwrote {args.png}")
    return 0
