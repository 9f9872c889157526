"""``warmroute sim``: one policy, ``--compare`` the default against its peers, ``--capacity`` per policy."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import os
import pickle
import statistics
import sys
import time
from pathlib import Path

from extproc.tools.sim.policies import AGGREGATED, ALIASES, COMPARE, FLOW_PEERS, NO_FLOW, PD_PEERS, PEERS, POLICIES
from extproc.tools.sim.report import share_plot, table
from extproc.tools.engine.model import EngineConfig
from extproc.tools.sim.simulator import Fault, Simulation
from extproc.tools.workload.generate import WorkloadConfig

CAPACITY_TTFT_P90_S = 2.0
WARM_UP_S = 120.0  # as the simulator's summaries  # the latency target a fleet owner buys hardware by


def _fault(spec: str, flap: bool) -> Fault:
    """--kill R:START:DURATION  /  --flap R:START:DOWN:EVERY:UNTIL (seconds)."""
    parts = [float(x) for x in spec.split(":")]
    if flap:
        r, start, down, every, until = parts
        return Fault(int(r), start, down, every, until)
    r, start, dur = parts
    return Fault(int(r), start, dur)


def parse_speeds(text: str | None) -> tuple[float, ...] | None:
    if not text:
        return None
    return tuple(float(x) for x in text.split(","))


def speed_list(text: str) -> str:
    """--replica-speeds' check: positive numbers, comma-separated (kept as given: the peers cache keys on it)."""
    try:
        ok = all(0 < float(x) < float("inf") for x in text.split(","))
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"replica speeds: {text!r} is not like 1,1,0.5,0.5 (positive numbers)")
    return text


def policy_list(text: str) -> str:
    """--policies' check: names the simulator knows, comma-separated (one line naming the first it does not); a
    peer's former name is read as its name now."""
    names = [ALIASES.get(p, p) for p in text.split(",")]
    unknown = [p for p in names if p not in POLICIES]
    if unknown:
        raise argparse.ArgumentTypeError(f"no policy named {unknown[0]!r}; known: {', '.join(POLICIES)}")
    return ",".join(names)


def tenant_cap(text: str) -> str:
    """--tenant-cap's check: ``TOKENS`` or ``TENANT:TOKENS``, tokens a whole number >= 1 (one line if not)."""
    _, _, rate = text.rpartition(":")
    if not (rate.isascii() and rate.isdigit() and int(rate) > 0):
        raise argparse.ArgumentTypeError(f"expected TOKENS or TENANT:TOKENS (tokens a minute, a whole number >= 1), "
                                         f"got {text[:40]!r}")
    return text


def add_arguments(ap: argparse.ArgumentParser) -> None:
    w = WorkloadConfig()  # one place per default: the workload's own
    ap.add_argument("--policy", default="warmroute", choices=[*POLICIES, *ALIASES])
    ap.add_argument("--compare", action="store_true",
                    help="the default policy, the other one, every peer and the oracle")
    ap.add_argument("--policies", type=policy_list, default=None, help="comma-separated list instead of --compare's")
    ap.add_argument("--minutes", type=float, default=w.minutes)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--replica-speeds", type=speed_list, default=None, metavar="1,1,0.5,0.5",
                    help="per replica prefill and decode speed (a mixed fleet); overrides --replicas")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--seeds", type=seed_list, default=None, metavar="1-5",
                    help="run every seed of a range or list (1-5, 7,18) and print the median")
    ap.add_argument("--load", type=float, default=1.0, help="scales every arrival rate (1 = the default workload)")
    ap.add_argument("--sessions-per-min", type=float, default=w.sessions_per_min)
    ap.add_argument("--oneshots-per-min", type=float, default=w.oneshots_per_min)
    ap.add_argument("--projects", type=int, default=w.projects)
    ap.add_argument("--noisy-tenant", type=float, default=0.0, metavar="X",
                    help="one more tenant whose sessions arrive at X times an average project's rate (flow control's "
                         "fairness; the other tenants' workload stays the same)")
    ap.add_argument("--estimate-error", default=None, metavar="1.2:1.9",
                    help="what estimating costs (issue 45): each text's engine tokens per estimated token drawn from "
                         "this range (1.2:1.9 on the tiny model's real tokenizer); warmroute_exact and llmd_precise "
                         "count the engine's own tokens")
    ap.add_argument("--burst", default=None, metavar="START:MINUTES:FACTOR",
                    help="every arrival rate times FACTOR for MINUTES from minute START (e.g. 6:2:2, flow control's "
                         "burst); the rest of the workload stays the same")
    ap.add_argument("--kill", action="append", default=[], metavar="R:START:DURATION")
    ap.add_argument("--flap", action="append", default=[], metavar="R:START:DOWN:EVERY:UNTIL")
    ap.add_argument("--capacity", action="store_true",
                    help=f"per policy, the highest --load with TTFT p90 <= {CAPACITY_TTFT_P90_S:g} s (median over "
                    f"--seeds)")
    ap.add_argument("--versus-peers", default=None, metavar="0.25,0.5,1",
                    help="at these loads, warmroute / warmroute_seed / oracle against the best peer on each number, "
                         "per seed and the median (issue 10's targets)")
    ap.add_argument("--peers-cache", default=None, metavar="FILE",
                    help="--versus-peers: keep the peers' results in FILE and reuse them (they do not change when only "
                         "warmroute's policy does; a FILE made by another version of the simulator, engine, workload "
                         "or peers is not reused)")
    ap.add_argument("--mine", default="warmroute,warmroute_seed,oracle",
                    help="--versus-peers: the rows compared with the peers (e.g. just warmroute while iterating)")
    ap.add_argument("--flow-versus", default=None, metavar="1,1.5,2",
                    help="at these loads, warmroute_flow and warmroute against the best peer and llm-d's flow control "
                         "on issue 34's numbers: standard TTFT p99, goodput, tokens/s, per seed and the median")
    ap.add_argument("--tenant-cap", default=None, type=tenant_cap, metavar="[TENANT:]TOKENS",
                    help="--noisy-versus: one more row, warmroute with every tenant capped at this many engine tokens "
                         "a minute (flow_control.tenant_tokens_per_minute), or only the one named (noisy:30000: "
                         "flow_control.tenant_caps)")
    ap.add_argument("--noisy-versus", type=float, default=None, metavar="X",
                    help="per policy (warmroute_flow, warmroute, the peers and llm-d's flow control), the other "
                         "tenants' TTFT p99 with a noisy tenant at X times an average project's rate over theirs "
                         "without it (issue 34's fairness target: <= 1.25x), per seed and the median")
    ap.add_argument("--cpu-tier", action="store_true",
                    help="engines with an offloaded tier (issue 63): a GPU cache a tenth of the default's over a CPU "
                         "tier of the default's size; blocks evicted from the GPU go down, a hit there is restored "
                         "~10x faster than computed; a session ends when its context would not fit the GPU. Compare "
                         "warmroute_exact, warmroute_exact_tierblind, llmd_precise")
    ap.add_argument("--prefill-replicas", type=int, default=0, metavar="K",
                    help="prefill/decode disaggregation: replicas 0..K-1 of role prefill, the rest of role decode")
    ap.add_argument("--transfer-tokens-per-s", type=float, default=100_000.0,
                    help="with --prefill-replicas: KV moved between replicas at this many prompt tokens a second")
    ap.add_argument("--long-share", type=float, default=None,
                    help="share of sessions that start with 60-120K tokens of context (default: the workload's 0.1)")
    ap.add_argument("--pd-versus", default=None, metavar="0.5,1,1.5",
                    help="issue 48's measure at these loads (with --prefill-replicas): warmroute against the P/D peers "
                         "(llm-d, Dynamo) and against the same replicas aggregated")
    ap.add_argument("--jobs", type=int, default=1, help="simulations run in parallel processes")
    ap.add_argument("--png", default=None, help="write traffic share over time per policy to this PNG")
    ap.add_argument("--transitions", action="store_true", help="print every health state change (warmroute)")
    ap.add_argument("--brains", default=None, metavar="1,2,4,8",
                    help="several brains, each fed 1/K of the requests at random (issue 33): one row per K and delay")
    ap.add_argument("--sync-delay-ms", default="1,100,1000,off", metavar="1,100,off",
                    help="with --brains: how late the others apply a brain's state changes (off: no sharing)")


def brain_rows(policy: str, brains: str, delays: str) -> list[str]:
    """One brain, then each K > 1 at each delay, then llm-d's pickers active-active without sharing (the peer)."""
    ks = [int(k) for k in brains.split(",") if k.strip()]
    ds = [d.strip() for d in delays.split(",") if d.strip()]
    rows = [policy, "llmd_epp_2025"] if 1 in ks else []
    for k in (k for k in ks if k > 1):
        rows += [f"{policy}:{k}:{d}" for d in ds] + [f"llmd_epp_2025:{k}:off"]
    return rows


def geometric_mean(values: list[float]) -> float:
    """Of positive values (a p99 of 0 counts as 1 ms: no request waited)."""
    return math.exp(sum(math.log(max(v, 1e-3)) for v in values) / len(values))


def seed_list(text: str) -> list[int]:
    """``1-5``, ``7,18`` or ``1-3,9``: the seeds in the order given."""
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.strip().partition("-")
        if not a.isdigit() or (b and not b.isdigit()):
            raise argparse.ArgumentTypeError(f"seeds: {text!r} is not like 1-5, 7,18 or 1-3,9")
        out += range(int(a), int(b or a) + 1)
    return out


def seeds_text(seeds: list[int]) -> str:
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}"
    return ",".join(map(str, seeds))


def _seeds(args) -> list[int]:
    return args.seeds or [args.seed]


def workload(args, load: float | None = None) -> WorkloadConfig:
    load = args.load if load is None else load
    return WorkloadConfig(minutes=args.minutes, sessions_per_min=args.sessions_per_min,
                          oneshots_per_min=args.oneshots_per_min, projects=args.projects,
                          noisy_tenant_x=getattr(args, "noisy_tenant", 0.0),
                          burst=_burst(getattr(args, "burst", None)),
                          token_scale=_span(getattr(args, "estimate_error", None)),
                          **({"long_share": args.long_share} if getattr(args, "long_share", None) is not None
                             else {})).at_load(load)


def _span(text: str | None) -> tuple[float, float] | None:
    if not text:
        return None
    try:
        lo, hi = (float(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(
            f"--estimate-error: expected LOW:HIGH engine tokens per estimated token, got {text!r}") from None
    if not 0 < lo <= hi:
        raise SystemExit(f"--estimate-error: expected 0 < LOW <= HIGH, got {text!r}")
    return lo, hi


def _burst(text: str | None) -> tuple[float, float, float] | None:
    """--burst START:MINUTES:FACTOR (minutes, minutes, times the arrival rates)."""
    if not text:
        return None
    start, minutes, factor = (float(x) for x in text.split(":"))
    return start, minutes, factor


def simulate(policy: str, args, seed: int, load: float | None = None, faults=()):
    speeds = parse_speeds(args.replica_speeds)
    n = len(speeds) if speeds else args.replicas
    engine, wl = None, workload(args, load)
    if getattr(args, "cpu_tier", False):
        d = EngineConfig()
        engine = EngineConfig(kv_tokens=d.kv_tokens // 10, cpu_tier_tokens=d.kv_tokens)
        # vLLM serves no request longer than its GPU cache (its max_model_len must fit there): a session ends when its
        # next turn and answer would not, as it does at max_context (long-context sessions cannot start)
        wl = dataclasses.replace(wl, max_context=engine.kv_tokens - wl.output_tokens_max)
    return Simulation(policy, replicas=n, workload=wl, seed=seed, faults=faults, engine=engine,
                      replica_speeds=speeds, prefill_replicas=getattr(args, "prefill_replicas", 0),
                      transfer_tokens_per_s=getattr(args, "transfer_tokens_per_s", 100_000.0)).run()


def capacity(policy: str, args, seed: int, lo: float = 0.05, hi: float = 4.0, steps: int = 7) -> float:
    """Highest load with TTFT p90 <= the target (bisection on a log scale; 0 if even ``lo`` misses)."""
    ok = lambda load: simulate(policy, args, seed, load).summary()["ttft_p90"] <= CAPACITY_TTFT_P90_S  # noqa: E731
    if not ok(lo):
        return 0.0
    if ok(hi):
        return hi
    for _ in range(steps):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def run(args: argparse.Namespace) -> int:
    faults = tuple([_fault(s, False) for s in args.kill] + [_fault(s, True) for s in args.flap])
    policies = args.policies.split(",") if args.policies else (COMPARE if args.compare or args.capacity
                                                               else [args.policy])
    if args.brains:
        policies = brain_rows(args.policy, args.brains, args.sync_delay_ms)
    seeds = _seeds(args)
    speeds = parse_speeds(args.replica_speeds)
    fleet = f"replicas at speeds {args.replica_speeds}" if speeds else f"{args.replicas} replicas"
    print(f"{args.minutes:g} simulated minutes, {fleet}, load {args.load:g} ({args.sessions_per_min * args.load:g} "
          f"agent "
          f"sessions/min over {args.projects} projects, {args.oneshots_per_min * args.load:g} one-shots/min), "
          f"seed{'s' if len(seeds) > 1 else ''} {seeds_text(seeds)}" + (f", faults {faults}" if faults else ""))
    if args.versus_peers:
        return versus_peers(args, [float(x) for x in args.versus_peers.split(",")], seeds)
    if args.flow_versus:
        return flow_versus(args, [float(x) for x in args.flow_versus.split(",")], seeds)
    if args.pd_versus:
        return pd_versus(args, [float(x) for x in args.pd_versus.split(",")], seeds)
    if args.noisy_versus:
        return noisy_versus(args, args.noisy_versus, seeds)
    if args.capacity:
        print(f"capacity = highest load with TTFT p90 <= {CAPACITY_TTFT_P90_S:g} s, per seed")
        jobs = [(p, args, s) for p in policies for s in seeds]
        if args.jobs > 1:
            from multiprocessing import Pool

            with Pool(args.jobs) as pool:
                caps = pool.starmap(capacity, jobs)
        else:
            caps = [capacity(*j) for j in jobs]
        for k, p in enumerate(policies):
            mine = caps[k * len(seeds):(k + 1) * len(seeds)]
            print(f"  {p:<30} " + " ".join(f"{c:5.2f}" for c in mine) + f"   median {statistics.median(mine):.2f}")
        return 0
    per_seed: dict[int, list] = {}
    if args.jobs > 1 and not args.transitions:
        from multiprocessing import Pool

        with Pool(args.jobs) as pool:
            flat = pool.starmap(_summary_of, [(p, args, seed, faults) for seed in seeds for p in policies])
        for k, seed in enumerate(seeds):
            per_seed[seed] = flat[k * len(policies):(k + 1) * len(policies)]
            print()
            print(table(per_seed[seed], title=f"seed {seed}"))
    for seed in seeds if not per_seed else []:
        results = []
        for p in policies:
            t0 = time.monotonic()
            r = simulate(p, args, seed, faults=faults)
            results.append(r)
            print(f"  seed {seed} {p}: {len(r.requests)} requests in {time.monotonic() - t0:.1f} s wall", flush=True)
            if args.transitions:
                for t in r.transitions:
                    extra = f" cooldown {t.cooldown_s:.0f}s" if t.new.value == "EJECTED" else ""
                    print(f"    t={t.at:8.1f}s {t.replica}: {t.old.value} -> {t.new.value} ({t.reason}){extra}")
        per_seed[seed] = results
        print()
        print(table(results, title=f"seed {seed}"))
    if len(seeds) > 1:
        print()
        print(table([_median(policies, [per_seed[s][k] for s in seeds]) for k in range(len(policies))],
                    title=f"median over seeds {seeds_text(seeds)}"))
        # one seed's p99 is its few slowest requests, and a median of ten of them moves 10-30% with the seed set
        # (docs/routing.md, issue 49): the geometric mean over the seeds uses every seed's
        print(f"\nTTFT p99, geometric mean over seeds {seeds_text(seeds)}: " + ", ".join(
            f"{p} {geometric_mean([per_seed[s][k].summary()['ttft_p99'] for s in seeds]):.2f} s"
            for k, p in enumerate(policies)))
    if args.brains:
        med = {p: _median(policies, [per_seed[s][k] for s in seeds]).summary() for k, p in enumerate(policies)}
        one = med[policies[0]]
        print(f"\nbeside one brain ({policies[0]}), medians over seeds: hits in points, TTFT p50 and p99 as ratios")
        for p in policies[1:]:
            m = med[p]
            print(f"  {p:<24} hits {100 * (m['prefix_hit_rate'] - one['prefix_hit_rate']):+5.1f}  "
                  f"p50 {m['ttft_p50'] / one['ttft_p50']:5.2f}x  p99 {m['ttft_p99'] / one['ttft_p99']:5.2f}x  "
                  f"errors {m['errors']:g}")
    if args.png:
        if not hasattr(per_seed[seeds[0]][0], "share_per_minute"):
            per_seed[seeds[0]] = [simulate(p, args, seeds[0], faults=faults) for p in policies]
        share_plot(per_seed[seeds[0]], args.png)
        print(f"\nwrote {args.png}")
    return 0


def _summary_at(policy: str, args, seed: int, load: float) -> dict:
    return simulate(policy, args, seed, load).summary()


def simulator_fingerprint() -> str:
    """What the peers' results depend on: the engine model, the simulator, the workload, the peers' models and the
    parts of the core they use (prefix index, key hash, outcome verdicts, imbalance index). A peers cache made from
    other sources is not reused; the warm and seed policies are not among them, so iterating on those keeps it."""
    from extproc.core import outcome, prefix_index, profile, stats
    from extproc.tools.engine import model as engine
    from extproc.tools.sim import policies, simulator
    from extproc.tools.workload import generate as workload

    h = hashlib.sha256()
    for mod in (engine, simulator, workload, policies, prefix_index, profile, stats, outcome):
        h.update(Path(mod.__file__).read_bytes())
    return h.hexdigest()[:16]


def _load_peers_cache(path: str, fingerprint: str) -> dict:
    try:
        with open(path, "rb") as f:
            doc = pickle.load(f)
    except FileNotFoundError:
        return {}
    except Exception as e:  # a truncated or foreign file is recomputed, not a crash
        print(f"--peers-cache {path}: unreadable ({type(e).__name__}); simulating the peers again", file=sys.stderr)
        return {}
    if not isinstance(doc, dict) or doc.get("fingerprint") != fingerprint:
        print(f"--peers-cache {path}: made by another version of the simulator or the peers; simulating them again",
              file=sys.stderr)
        return {}
    return doc["runs"]


def _runs(args, loads: list[float], seeds: list[int], mine: list[str], peers) -> dict:
    """Every (policy, load, seed)'s summary; the peers' from --peers-cache where it holds them."""
    shape = (args.minutes, args.replicas, args.replica_speeds, args.sessions_per_min, args.oneshots_per_min,
             args.projects, getattr(args, "noisy_tenant", 0.0), getattr(args, "burst", None),
             getattr(args, "prefill_replicas", 0), getattr(args, "transfer_tokens_per_s", 100_000.0),
             getattr(args, "long_share", None))
    fingerprint = simulator_fingerprint()
    cached: dict = _load_peers_cache(args.peers_cache, fingerprint) if args.peers_cache else {}
    jobs = [(p, args, s, L) for L in loads for s in seeds for p in [*mine, *peers]
            if p not in peers or (shape, p, L, s) not in cached]
    if args.jobs > 1:
        from multiprocessing import Pool

        with Pool(args.jobs) as pool:
            flat = pool.starmap(_summary_at, jobs)
    else:
        flat = [_summary_at(*j) for j in jobs]
    got = {(p, L, s): r for (shape_, p, L, s), r in cached.items() if shape_ == shape}
    got.update({(j[0], j[3], j[2]): r for j, r in zip(jobs, flat)})
    if args.peers_cache:
        cached.update({(shape, p, L, s): r for (p, L, s), r in got.items() if p in peers})
        tmp = f"{args.peers_cache}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump({"fingerprint": fingerprint, "runs": cached}, f)
        os.replace(tmp, args.peers_cache)  # an interrupted run leaves the old cache whole
    return got


def versus_peers(args, loads: list[float], seeds: list[int]) -> int:
    """Ratios to the best peer on each number separately (the best p50 and the best p99 may be two peers)."""
    mine = [p for p in args.mine.split(",") if p]
    got = _runs(args, loads, seeds, mine, PEERS)
    print("ratios to the best peer on each number: TTFT p50, TTFT p99, prefix hits (points), output tok/s; "
          f"peers: {', '.join(PEERS)}")
    for L in loads:
        print(f"L={L:g}")
        for p in mine:
            rows = []
            for s in seeds:
                m, pe = got[(p, L, s)], [got[(q, L, s)] for q in PEERS]
                rows.append((m["ttft_p50"] / min(x["ttft_p50"] for x in pe),
                             m["ttft_p99"] / min(x["ttft_p99"] for x in pe),
                             100 * (m["prefix_hit_rate"] - max(x["prefix_hit_rate"] for x in pe)),
                             m["output_tok_s"] / max(x["output_tok_s"] for x in pe), m["imbalance_mean"],
                             m["imbalance_max"]))
            med = [statistics.median(r[i] for r in rows) for i in range(6)]
            print(f"  {p:<16} median p50 {med[0]:.2f} p99 {med[1]:.2f} hits {med[2]:+.1f} tok/s {med[3]:.3f} "
                  f"imbalance {med[4]:.2f}/{med[5]:.2f} | per seed: "
                  + " ".join(f"[{r[0]:.2f} {r[1]:.2f} {r[2]:+.1f} {r[3]:.3f}]" for r in rows))
        # what no router can beat: each request alone on an idle replica with the best cache it could have
        floors = [(got[(mine[0], L, s)]["ttft_floor_p50"] / min(got[(q, L, s)]["ttft_p50"] for q in PEERS),
                   got[(mine[0], L, s)]["ttft_floor_p99"] / min(got[(q, L,
                                                                     s)]["ttft_p99"] for q in PEERS)) for s in seeds]
        own = [got[(mine[0], L, s)] for s in seeds]
        print(f"  {'floor':<16} median p50 {statistics.median(f[0] for f in floors):.2f} "
              f"p99 {statistics.median(f[1] for f in floors):.2f} imbalance "
              f"{statistics.median(o['imbalance_floor_mean'] for o in own):.2f}/"
              f"{statistics.median(o['imbalance_floor_max'] for o in own):.2f} (no router below these; imbalance: none "
              "that keeps a session on one replica within a minute) | per seed: "
              + " ".join(f"[{a:.2f} {b:.2f}]" for a, b in floors))
    return 0


def pd_versus(args, loads: list[float], seeds: list[int]) -> int:
    """Issue 48's targets on a disaggregated fleet (--prefill-replicas K of role prefill): warmroute's TTFT p99 and
    inter-token latency p99 against the best P/D peer's, goodput against the best, and TTFT p50 against warmroute on
    the same replicas aggregated (none of role prefill)."""
    mine = ["warmroute", AGGREGATED]
    peers = list(PD_PEERS)
    got = _runs(args, loads, seeds, mine, peers)
    print(f"{args.prefill_replicas} of {args.replicas} replicas of role prefill, KV moved at "
          f"{args.transfer_tokens_per_s:g} tokens/s; P/D peers: {', '.join(peers)}; ratios per seed, then the median")
    print("  ttft p99 / best peer's, itl p99 / best peer's, goodput / best peer's, ttft p50 / aggregated's; "
          "disaggregated requests")
    for L in loads:
        print(f"L={L:g}")
        for p in [*mine, *peers]:
            rows = []
            for s in seeds:
                m, pe, agg = got[(p, L, s)], [got[(q, L, s)] for q in peers], got[(AGGREGATED, L, s)]
                rows.append((m["ttft_p99"] / min(x["ttft_p99"] for x in pe),
                             m["itl_p99"] / min(x["itl_p99"] for x in pe),
                             m["goodput"] / max(x["goodput"] for x in pe),
                             m["ttft_p50"] / agg["ttft_p50"], m["disaggregated"], m["ttft_p50"], m["ttft_p99"],
                             m["itl_p99"], m["output_tok_s"]))
            med = [statistics.median(r[i] for r in rows) for i in range(len(rows[0]))]
            print(f"  {p:<21} median p99 {med[0]:.2f} itl {med[1]:.2f} goodput {med[2]:.2f} p50/agg {med[3]:.2f} "
                  f"| p50 {med[5]:.2f} s p99 {med[6]:.2f} s itl p99 {med[7] * 1000:.0f} ms tok/s {med[8]:.0f} "
                  f"disaggregated {med[4]:.0f} | per seed [p99 itl goodput p50/agg]: "
                  + " ".join(f"[{r[0]:.2f} {r[1]:.2f} {r[2]:.2f} {r[3]:.2f}]" for r in rows))
    return 0


def flow_versus(args, loads: list[float], seeds: list[int]) -> int:
    """Issue 34's targets: standard TTFT p99 against the best peer's (as shipped: no flow control) and against
    llm-d's flow control, goodput and output tokens/s against the best of them; refused requests (429s, each sent
    again after Retry-After) beside."""
    mine = ["warmroute", NO_FLOW]
    peers = [*PEERS, *FLOW_PEERS]
    got = _runs(args, loads, seeds, mine, peers)
    fc = next(iter(FLOW_PEERS))
    print("standard TTFT p99 / the best peer's (p99 best) and / llm-d flow control's (p99 fc); goodput (requests that "
          "met their class's TTFT deadline: 1 s critical, 2 s standard, 10 s sheddable) and output tok/s / the best "
          f"of the peers and {fc}; peers: {', '.join(PEERS)}")
    for L in loads:
        print(f"L={L:g}")
        for p in [*mine, fc]:
            rows = []
            for s in seeds:
                m, pe = got[(p, L, s)], [got[(q, L, s)] for q in PEERS]
                allp = pe + [got[(fc, L, s)]]
                rows.append((m["standard_ttft_p99"] / min(x["standard_ttft_p99"] for x in pe),
                             m["standard_ttft_p99"] / got[(fc, L, s)]["standard_ttft_p99"],
                             m["goodput"] / max(x["goodput"] for x in allp),
                             m["output_tok_s"] / max(x["output_tok_s"] for x in allp),
                             m["standard_ttft_p99"], m["refused"]))
            med = [statistics.median(r[i] for r in rows) for i in range(6)]
            print(f"  {p:<21} median p99 best {med[0]:.2f} fc {med[1]:.2f} goodput {med[2]:.2f} tok/s {med[3]:.3f} "
                  f"p99 {med[4]:.1f} s refused {med[5]:g} | per seed [p99/best goodput tok/s]: "
                  + " ".join(f"[{r[0]:.2f} {r[2]:.2f} {r[3]:.2f}]" for r in rows))
    return 0


CAPPED = "warmroute_tenant_capped"  # warmroute with every tenant capped at --tenant-cap tokens a minute


def _others_p99(policy: str, args, seed: int, noisy_x: float) -> float:
    """The TTFT p99 (from the first attempt) of the requests of every tenant but the noisy one, after the
    warm-up."""
    from extproc.core.caps import TenantCaps
    from extproc.tools.sim.brains import make as make_policy
    from extproc.tools.workload.measure import pct

    w = dataclasses.replace(workload(args), noisy_tenant_x=noisy_x)
    speeds = parse_speeds(args.replica_speeds)
    n = len(speeds) if speeds else args.replicas
    pol: object = policy
    if policy == CAPPED:
        from extproc.core.flow import tenant_key

        pol = make_policy("warmroute", n, seed)
        name, _, rate = str(args.tenant_cap).rpartition(":")
        # "N": every tenant at N tokens a minute; "tenant:N": that tenant alone (the others uncapped)
        pol.router.caps = TenantCaps(0.0, {tenant_key(name): float(rate)}) if name \
            else TenantCaps(float(rate))  # type: ignore[attr-defined]
    res = Simulation(pol, replicas=n, workload=w, seed=seed, replica_speeds=speeds).run()
    return pct([r.ttft for r in res.requests if r.tenant != "noisy" and r.arrival >= WARM_UP_S
                and r.error is None and r.ttft is not None], 0.99)


def noisy_versus(args, x: float, seeds: list[int]) -> int:
    """Issue 34's fairness target: a noisy tenant must not hurt the others (their p99 within 1.25x of theirs
    without it). The others' workload is the same in both runs (the noisy tenant draws from its own stream)."""
    policies = (args.policies.split(",") if args.policies else ["warmroute", NO_FLOW, *PEERS, *FLOW_PEERS]) \
        + ([CAPPED] if args.tenant_cap else [])
    jobs = [(p, args, s, nx) for p in policies for s in seeds for nx in (0.0, x)]
    if args.jobs > 1:
        from multiprocessing import Pool

        with Pool(args.jobs) as pool:
            flat = pool.starmap(_others_p99, jobs)
    else:
        flat = [_others_p99(*j) for j in jobs]
    got = {(p, s, nx): v for (p, _, s, nx), v in zip(jobs, flat)}
    print(f"the other tenants' TTFT p99 with a noisy tenant at {x:g}x an average project's rate / theirs without it "
          f"(target <= 1.25x)")
    for p in policies:
        ratios = [got[(p, s, x)] / got[(p, s, 0.0)] for s in seeds]
        print(f"  {p:<28} median {statistics.median(ratios):.2f}x | per seed: "
              + " ".join(f"{r:.2f} ({got[(p, s, x)]:.1f}/{got[(p, s, 0.0)]:.1f} s)" for r, s in zip(ratios, seeds)))
    return 0


def _summary_of(policy: str, args, seed: int, faults) -> "_Median":
    """A simulation's summary only (what crosses a process boundary cheaply)."""
    s = simulate(policy, args, seed, faults=faults).summary()
    return _Median(s["policy"], s)


@dataclasses.dataclass
class _Median:
    policy: str
    values: dict

    def summary(self) -> dict:
        return self.values


def _median(policies, results) -> _Median:
    sums = [r.summary() for r in results]
    out = {"policy": sums[0]["policy"]}
    for k in sums[0]:
        if k != "policy" and all(k in s for s in sums):
            out[k] = statistics.median(s[k] for s in sums)
    return _Median(out["policy"], out)
