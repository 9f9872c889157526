"""TTFT by kind of request (first turn of a session, later turns, one-shots), per policy, over seeds.

``python -m extproc.tools.sim.anatomy --load 0.25`` shows where a policy wins or loses its median:
e.g. whether it is the prefix placement of new sessions or the step time of their later turns.
``--moves`` instead prints, per 2 minutes of one seed, the sessions moved to another replica, the context
they carried and the fleet's uncached prefill: how a surge turns into a cascade of re-prefills.
``--predictions`` lists the worst predicted times to first token of one seed (warmroute's rows) beside what the
engine was doing when it got each request: which part of a prediction was wrong (the queue ahead, the prefill, the
replica's first-token overhead) and whether the engine was in fact busy.
``--tail`` sorts the slowest 2% of session turns by what made them: a session's first turn, a turn moved to
another replica than its last, a turn whose context its own replica had lost (evicted), or one that kept its
cache (it only waited): whether a queue in the router could shorten the tail, or only fewer re-prefills can.
With ``--replica-speeds`` (a mixed fleet) it also says, per replica speed, the share of the turns served there and
the share of the tail, and what the tail's turns there were: where a slow replica's work is the wrong work.
"""

from __future__ import annotations

import argparse

from extproc.tools.sim.cli import parse_speeds, policy_list, seed_list, speed_list
from extproc.tools.sim.simulator import Simulation
from extproc.tools.workload.generate import WorkloadConfig

POLICIES = ["warmroute", "envoy_ring_hash_bounded_150", "llmd_epp_2025", "oracle"]
WARM_UP_S = 120.0  # as the simulator's summaries


def _q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[int(p * (len(xs) - 1))] if xs else float("nan")


def _workload(load: float, minutes: float | None = None) -> WorkloadConfig:
    return (WorkloadConfig(minutes=minutes) if minutes else WorkloadConfig()).at_load(load)


def anatomy(policy: str, load: float, seeds: list[int], replicas: int) -> dict[str, list[float]]:
    kinds: dict[str, list[float]] = {"all": [], "first": [], "later": [], "oneshot": [], "later_uncached": []}
    w = _workload(load)
    for seed in seeds:
        seen: set[int] = set()
        for r in sorted(Simulation(policy, replicas=replicas, workload=w, seed=seed).run().requests,
                        key=lambda x: x.arrival):
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


def moves(policy: str, load: float, seed: int, replicas: int, every_s: float = 120.0,
          minutes: float | None = None) -> list[tuple[float, int, int, int, int]]:
    """(minute, requests, sessions moved, their context tokens, uncached prompt tokens) per ``every_s``."""
    w = _workload(load, minutes)
    last: dict[int, int] = {}
    rows: dict[int, list[int]] = {}
    for r in sorted(Simulation(policy, replicas=replicas, workload=w, seed=seed).run().requests,
                    key=lambda x: x.arrival):
        row = rows.setdefault(int(r.arrival // every_s), [0, 0, 0, 0])
        row[0] += 1
        if r.replica is None:
            continue
        if not r.oneshot and last.get(r.sid, r.replica) != r.replica:
            row[1] += 1
            row[2] += r.prompt_tokens
        last[r.sid] = r.replica
        row[3] += r.prompt_tokens - r.cached_tokens
    return [(k * every_s / 60, *rows[k]) for k in sorted(rows)]


TAIL_KINDS = ("first", "moved", "lost_at_home", "cached")


def worst_predictions(requests, n: int = 20) -> list[dict]:
    """The ``n`` requests answered after the warm-up whose predicted time to first token was furthest from what it
    took (relative error), worst first: the prediction's parts (wait: what it put ahead of the request), what it took
    from its decision, and the engine's waiting and running requests and KV usage when it got it."""
    rows = []
    for r in requests:
        if r.ttft is None or r.arrival < WARM_UP_S or "predicted_ttft" not in r.extra:
            continue
        predicted, held = r.extra["predicted_ttft"]
        observed = max(r.ttft - held, 1e-3)  # from its decision, as the brain joins it
        prefill, overhead = r.extra.get("predicted_parts", (0.0, 0.0))
        waiting, running, kv = r.extra.get("engine_at_send", (None, None, None))
        rows.append({"at": r.arrival, "replica": r.replica, "predicted": predicted, "observed": observed,
                     "error": abs(predicted - observed) / observed, "wait": max(0.0, predicted - prefill - overhead),
                     "prefill": prefill, "overhead": overhead, "cached": r.cached_tokens, "prompt": r.prompt_tokens,
                     "waiting": waiting, "running": running, "kv_usage": kv})
    rows.sort(key=lambda x: -x["error"])
    return rows[:n]


def _turns(requests) -> list[tuple[float, int, str, int]]:
    """Session turns answered after the warm-up, slowest first: (TTFT, uncached prompt tokens, kind, replica).
    Kinds (``TAIL_KINDS``): the session's first request; moved (another replica than its previous turn's);
    lost_at_home (same replica, but more than half its prompt prefilled again: evicted there); cached."""
    last: dict[int, int] = {}
    turns = []
    for r in sorted(requests, key=lambda x: x.arrival):
        if r.oneshot or r.replica is None:
            continue
        prev = last.get(r.sid)
        last[r.sid] = r.replica
        if r.ttft is None or r.arrival < WARM_UP_S:
            continue
        uncached = r.prompt_tokens - r.cached_tokens
        kind = ("first" if prev is None else "moved" if prev != r.replica
                else "lost_at_home" if uncached > r.prompt_tokens / 2 else "cached")
        turns.append((r.ttft, uncached, kind, r.replica))
    turns.sort(key=lambda t: -t[0])
    return turns


def tail_kinds(requests, share: float = 0.02) -> dict[str, list[tuple[float, int]]]:
    """The slowest ``share`` of session turns answered after the warm-up, by kind (``_turns``): (TTFT, uncached
    prompt tokens) each."""
    turns = _turns(requests)
    out: dict[str, list[tuple[float, int]]] = {k: [] for k in TAIL_KINDS}
    for ttft, uncached, kind, _ in turns[:max(1, round(len(turns) * share))] if turns else ():
        out[kind].append((ttft, uncached))
    return out


def tail_by_speed(requests, speeds: tuple[float, ...], share: float = 0.02,
                  into: dict[float, dict] | None = None) -> dict[float, dict]:
    """Per replica speed: the session turns served there after the warm-up (``turns``), how many of the slowest
    ``share`` of them ran there (``tail``) and those tail turns by kind (``kinds``, as ``tail_kinds``); added to
    ``into`` (a previous seed's) when given."""
    out = into if into is not None else {}
    for speed in set(speeds):
        out.setdefault(speed, {"turns": 0, "tail": 0, "kinds": {k: 0 for k in TAIL_KINDS}})
    turns = _turns(requests)
    for *_, replica in turns:
        out[speeds[replica]]["turns"] += 1
    for _, _, kind, replica in turns[:max(1, round(len(turns) * share))] if turns else ():
        out[speeds[replica]]["tail"] += 1
        out[speeds[replica]]["kinds"][kind] += 1
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m extproc.tools.sim.anatomy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--load", type=float, default=0.25)
    ap.add_argument("--seeds", default="1-10")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--policies", type=policy_list, default=",".join(POLICIES))
    ap.add_argument("--moves", action="store_true", help="sessions moved between replicas over time (first seed)")
    ap.add_argument("--tail", action="store_true", help="what the slowest 2%% of session turns are made of")
    ap.add_argument("--predictions", type=int, default=0, metavar="N",
                    help="the N worst predicted times to first token of the first seed, beside the engine's state")
    ap.add_argument("--minutes", type=float, default=None)
    ap.add_argument("--replica-speeds", type=speed_list, default=None, metavar="1,1,0.5,0.5",
                    help="a mixed fleet (overrides --replicas); --tail adds where the tail ran, per speed")
    args = ap.parse_args(argv)
    speeds = parse_speeds(args.replica_speeds)
    if speeds:
        args.replicas = len(speeds)
    seeds = seed_list(args.seeds)
    if args.predictions:
        w = _workload(args.load, args.minutes)
        for p in args.policies.split(","):
            sim = Simulation(p, replicas=args.replicas, workload=w, seed=seeds[0], replica_speeds=speeds)
            rows = worst_predictions(sim.run().requests, args.predictions)
            if not rows:
                continue  # a policy that predicts nothing
            print(f"{p}, load {args.load:g}, seed {seeds[0]}: the {len(rows)} worst predicted first tokens (seconds "
                  "from the decision; the engine when it got the request)")
            for x in rows:
                print(f"  t {x['at']:7.1f} r{x['replica']} predicted {x['predicted']:6.2f} (wait {x['wait']:5.2f} "
                      f"prefill {x['prefill']:5.2f} overhead {x['overhead']:4.2f}) took {x['observed']:6.2f}  cached "
                      f"{x['cached']}/{x['prompt']}  engine: {x['waiting']} waiting, {x['running']} running, KV "
                      f"{x['kv_usage']:.0%}")
        return 0
    if args.tail:
        print(f"the slowest 2% of session turns (each seed's), load {args.load:g}, {args.replicas} replicas, seeds "
              f"{args.seeds}: share of the tail, median TTFT and uncached prompt tokens, by kind")
        w = _workload(args.load, args.minutes)
        for p in args.policies.split(","):
            kinds: dict[str, list[tuple[float, int]]] = {k: [] for k in TAIL_KINDS}
            per_speed: dict[float, dict] = {}
            for seed in seeds:
                reqs = Simulation(p, replicas=args.replicas, workload=w, seed=seed,
                                  replica_speeds=speeds).run().requests
                for k, v in tail_kinds(reqs).items():
                    kinds[k] += v
                if speeds:
                    tail_by_speed(reqs, speeds, into=per_speed)
            n = sum(len(v) for v in kinds.values()) or 1
            print(f"{p:<30} " + " | ".join(
                f"{k} {100 * len(v) / n:3.0f}% ({_q([t for t, _ in v], .5):5.1f} s, "
                f"{_q([u for _, u in v], .5) / 1e3:5.1f}K)"
                for k, v in kinds.items()))
            all_turns, all_tail = sum(r["turns"] for r in per_speed.values()) or 1, sum(r["tail"] for r
                                                                                        in per_speed.values()) or 1
            for speed, row in sorted(per_speed.items()):
                print(f"{'':<4}speed {speed:g}: {100 * row['turns'] / all_turns:4.1f}% of the turns, "
                      f"{100 * row['tail'] / all_tail:4.1f}% of the tail (" + ", ".join(
                          f"{k} {c}" for k, c in row["kinds"].items() if c) + ")")
        return 0
    if args.moves:
        print(f"per 2 minutes, load {args.load:g}, {args.replicas} replicas, seed {seeds[0]}: requests, sessions moved "
              f"to "
              "another replica than their last turn's, the context they carried, uncached prompt tokens of the fleet")
        for p in args.policies.split(","):
            print(p)
            for minute, n, moved, carried, uncached in moves(p, args.load, seeds[0], args.replicas):
                print(f"  {minute:4.0f} min  requests {n:4d}  moved {moved:3d}  carrying {carried / 1e3:6.0f}K  "
                      f"uncached {uncached / 1e3:6.0f}K")
        return 0
    print(f"TTFT p50 by kind of request, load {args.load:g}, {args.replicas} replicas, seeds {args.seeds} (after "
          f"{WARM_UP_S:g} s)")
    for p in args.policies.split(","):
        k = anatomy(p, args.load, seeds, args.replicas)
        print(f"{p:<30} all {_q(k['all'], .5):.3f} | first turns {_q(k['first'], .5):.3f} (n {len(k['first'])}) | "
              f"later turns "
              f"{_q(k['later'], .5):.3f} (n {len(k['later'])}, uncached median {_q(k['later_uncached'], .5):.0f} "
              f"tokens) | "
              f"one-shots {_q(k['oneshot'], .5):.3f} (n {len(k['oneshot'])})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
