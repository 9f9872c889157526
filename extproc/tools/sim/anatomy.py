"""TTFT by kind of request (first turn of a session, later turns, one-shots), per policy, over seeds.

``python -m extproc.tools.sim.anatomy --load 0.25`` shows where a policy wins or loses its median:
e.g. whether it is the prefix placement of new sessions or the step time of their later turns.
"""

from __future__ import annotations

import argparse

from .cli import seed_list
from .simulator import Simulation
from .workload import WorkloadConfig

POLICIES = ["warmroute", "envoy_ring_hash_bounded_150", "llmd_epp", "oracle"]
WARM_UP_S = 120.0  # as the simulator's summaries


def _q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[int(p * (len(xs) - 1))] if xs else float("nan")


def anatomy(policy: str, load: float, seeds: list[int], replicas: int) -> dict[str, list[float]]:
    kinds: dict[str, list[float]] = {"all": [], "first": [], "later": [], "oneshot": [], "later_uncached": []}
    defaults = WorkloadConfig()
    for seed in seeds:
        w = WorkloadConfig(sessions_per_min=defaults.sessions_per_min * load, oneshots_per_min=defaults.oneshots_per_min * load)
        seen: set[int] = set()
        for r in sorted(Simulation(policy, replicas=replicas, workload=w, seed=seed).run().requests, key=lambda x: x.arrival):
            if r.ttft is None or r.arrival < WARM_UP_S:
                seen.add(r.sid)
                continue
            kind = "oneshot" if r.oneshot else ("later" if r.sid in seen else "first")
            seen.add(r.sid)
            kinds[kind].append(r.ttft)
            kinds["all"].append(r.ttft)
            if kind == "later":
                kinds["later_uncached"].append(r.prompt_tokens - r.cached_tokens)
    return kinds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m extproc.tools.sim.anatomy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--load", type=float, default=0.25)
    ap.add_argument("--seeds", default="1-10")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--policies", default=",".join(POLICIES))
    args = ap.parse_args(argv)
    seeds = seed_list(args.seeds)
    print(f"TTFT p50 by kind of request, load {args.load:g}, {args.replicas} replicas, seeds {args.seeds} (after {WARM_UP_S:g} s)")
    for p in args.policies.split(","):
        k = anatomy(p, args.load, seeds, args.replicas)
        print(f"{p:<30} all {_q(k['all'], .5):.3f} | first turns {_q(k['first'], .5):.3f} (n {len(k['first'])}) | later turns "
              f"{_q(k['later'], .5):.3f} (n {len(k['later'])}, uncached median {_q(k['later_uncached'], .5):.0f} tokens) | "
              f"one-shots {_q(k['oneshot'], .5):.3f} (n {len(k['oneshot'])})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
