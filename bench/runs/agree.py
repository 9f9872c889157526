"""``make bench-agree``: the live benchmark and the simulator on one workload, side by side, at several compressions.

For each time compression (``--speedups``) and each contender that exists
both live and in the simulator, the same seeded workload is replayed over
HTTP against a fresh fleet of mock replicas and simulated in virtual time.
Both sides are measured by one rule (``measure.window_numbers``): TTFT percentiles of the
requests that arrived after the warm-up, prefix hits as cached over prompt
tokens of those requests, tokens per second of the requests that finished
inside the window. Each contender is shown as its ratio to bounded ring
hash of the same side, so what the table compares is the story each
instrument tells, not absolute times.

Beside them: the request streams (same sessions, same turns: any session
whose turns are not a prefix of the other side's is a failure), the engine
check (one fixed trace through the mock and the simulator's engine), and
for every live request the part of its TTFT that was not the engine's
(the client, Envoy, the brain, the routers, the mock's HTTP and event
loop), in workload time: at 20x compression a 2 ms wall round trip is
40 ms of workload time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from bench.contenders import RUNS, WARMROUTE
from bench.harness import bench_workload, brain_decision_mean, invocation, samples, start
from bench.runs.engine_agree import agreement, engine_trace, replay_trace, simulate_trace
from extproc.tools.sim.simulator import Simulation
from extproc.tools.stack.local import Stack, http_get
from extproc.tools.workload.generate import Request, WorkloadConfig
from extproc.tools.workload.http_replay import replay
from extproc.tools.workload.measure import window_numbers

BASELINE = "envoy_ring_hash_bounded_150"
# live contender -> the simulator's model of the same router (PEERS.md); live-only routers have none
SIMULATED_AS = {
    "envoy_round_robin": "envoy_round_robin",
    "envoy_least_request": "envoy_least_request",
    "envoy_ring_hash": "envoy_ring_hash",
    BASELINE: BASELINE,
    "warmroute": "warmroute",
    "warmroute_seed": "warmroute_seed",
    "sglang_router_cache_aware": "sglang_cache_aware",
}
DEFAULT_CONTENDERS = RUNS["agree"]


# ------------------------------------------------------------------------------ one rule for both sides


def stream(requests: list[Request]) -> dict[tuple[str, int], list[tuple[int, int]]]:
    """Each session's (or one-shot's) requests as (prompt tokens, output tokens), in the order it sent them."""
    out: dict[tuple[str, int], list[tuple[int, int]]] = defaultdict(list)
    for r in sorted(requests, key=lambda r: (r.sid, r.prompt_tokens)):
        out[("oneshot" if r.oneshot else "session", r.sid)].append((r.prompt_tokens, r.max_tokens))
    return out


@dataclass
class StreamDiff:
    sessions: tuple[int, int]  # (simulated, live) sessions that sent at least one request
    oneshots: tuple[int, int]
    requests: tuple[int, int]
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    mismatched: list = field(default_factory=list)  # sessions whose turns differ beyond where one side stopped
    only_sim: int = 0  # turns one side sent after the other had stopped (closed loop: its answers came sooner)
    only_live: int = 0

    def line(self) -> str:
        a, b = self.requests
        return (f"requests sim {a} / live {b}, sessions {self.sessions[0]} / {self.sessions[1]}, one-shots "
                f"{self.oneshots[0]} / {self.oneshots[1]}, prompt tokens {self.prompt_tokens[0]:,} / "
                f"{self.prompt_tokens[1]:,}, output tokens {self.output_tokens[0]:,} / {self.output_tokens[1]:,}; "
                f"{len(self.mismatched)} sessions differ; turns only simulated {self.only_sim}, only live "
                f"{self.only_live} "
                f"(sessions answered sooner fit more turns before the end)")


def compare_streams(sim: list[Request], live: list[Request]) -> StreamDiff:
    """Same seed, same workload: the same sessions and one-shots, and each session's turns the same as far as both
    sides got (a closed-loop session whose answers came later sends its later turns later, so one side may stop
    earlier: counted, not a mismatch)."""
    a, b = stream(sim), stream(live)
    d = StreamDiff(*[(x, y) for x, y in (
        (sum(k[0] == "session" for k in a), sum(k[0] == "session" for k in b)),
        (sum(k[0] == "oneshot" for k in a), sum(k[0] == "oneshot" for k in b)),
        (len(sim), len(live)),
        (sum(r.prompt_tokens for r in sim), sum(r.prompt_tokens for r in live)),
        (sum(r.max_tokens for r in sim), sum(r.max_tokens for r in live)))])
    for key in a.keys() | b.keys():
        x, y = a.get(key, []), b.get(key, [])
        n = min(len(x), len(y))
        if x[:n] != y[:n]:
            d.mismatched.append(key)
        d.only_sim += len(x) - n
        d.only_live += len(y) - n
    return d


# ------------------------------------------------------------------------------------------ the runs


def simulated(policy: str, wl: WorkloadConfig, seed: int, replicas: int) -> list[Request]:
    return Simulation(policy, replicas=replicas, workload=wl, seed=seed).run().requests


def live(contender: str, wl: WorkloadConfig, seed: int, replicas: int, speedup: float) -> tuple[list[Request], dict]:
    """The requests of one live run, and what the brain (if any) said about its own time."""
    run = start(contender, replicas, ["--speedup", str(speedup)], speedup)
    extra: dict = {}
    try:
        duration = wl.minutes * 60 / speedup
        res = asyncio.run(replay(run.url, wl, seed=seed, speedup=speedup, timeout=max(60.0, duration)))
        if contender in WARMROUTE:
            extra["decision_s"] = brain_decision_mean(http_get(run.stack.brain_metrics).decode())
        extra["lost"], extra["errors"] = res.lost, sum(res.errors.values())
        extra["mock_lag_p50"], extra["mock_lag_p99"] = mock_lag([r.url for r in run.stack.replicas])
    finally:
        run.stop()
    return res.requests, extra


def mock_lag(urls: list[str]) -> tuple[float, float]:
    """The mocks' first-token lag percentiles (wall seconds), from their histograms' buckets summed."""
    buckets: dict[float, float] = defaultdict(float)
    for u in urls:
        try:
            text = http_get(u + "/metrics", timeout=2).decode()
        except OSError:
            continue
        for name, labels, v in samples(text):
            if name == "mock:first_token_lag_seconds_bucket":
                buckets[float(labels["le"])] += v
    if not buckets:
        return float("nan"), float("nan")
    edges = sorted(buckets)
    total = buckets[edges[-1]]
    q = lambda p: next((e for e in edges if buckets[e] >= p * total), edges[-1])  # noqa: E731
    return q(0.5), q(0.99)


def engine_check(speedup: float, seed: int = 1) -> str:
    trace = engine_trace(seed)
    sim = simulate_trace(trace)
    s = Stack(0)
    try:
        r = s.start_replica("agree0", extra=["--speedup", str(speedup)])
        got = asyncio.run(replay_trace(r.url, trace, speedup))
        r.proc.stop()
    finally:
        s.stop()
    return agreement(sim, got).line()


# --------------------------------------------------------------------------------------------- report


def ratio(row: dict, base: dict, key: str) -> float:
    return row[key] / base[key] if base.get(key) else float("nan")


def agree_table(results: dict, speedups: list[float], contenders: list[str]) -> str:
    head = ("| speed-up | contender | p50 ratio sim / live | p99 ratio sim / live | hits − baseline, points, sim / "
            "live | "
            "tok/s ratio sim / live | live TTFT p50 s (engine's) | not-engine p50 s | brain decision, workload ms |\n"
            "|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for sp in speedups:
        base_s, base_l = results.get((sp, BASELINE, "sim")), results.get((sp, BASELINE, "live"))
        if base_s is None or base_l is None:
            lines.append(f"| {sp:g}x | (the baseline did not run: no ratios) |||||||| ")
            continue
        for c in contenders:
            s, v = results.get((sp, c, "sim")), results.get((sp, c, "live"))
            if v is None:
                continue
            dec = v.get("decision_s")
            cells = [f"{sp:g}x", c]
            if s is None:
                cells += ["— / " + f"{ratio(v, base_l, 'ttft_p50'):.2f}",
                          "— / " + f"{ratio(v, base_l, 'ttft_p99'):.2f}",
                          "— / " + f"{(v['hits'] - base_l['hits']) * 100:+.1f}",
                          "— / " + f"{ratio(v, base_l, 'tok_s'):.3f}"]
            else:
                cells += [f"{ratio(s, base_s, 'ttft_p50'):.2f} / {ratio(v, base_l, 'ttft_p50'):.2f}",
                          f"{ratio(s, base_s, 'ttft_p99'):.2f} / {ratio(v, base_l, 'ttft_p99'):.2f}",
                          f"{(s['hits'] - base_s['hits']) * 100:+.1f} / {(v['hits'] - base_l['hits']) * 100:+.1f}",
                          f"{ratio(s, base_s, 'tok_s'):.3f} / {ratio(v, base_l, 'tok_s'):.3f}"]
            cells += [f"{v['ttft_p50']:.3f} ({v.get('engine_ttft_p50', float('nan')):.3f})",
                      f"{v.get('overhead_p50', float('nan')):.3f}",
                      f"{dec * 1000 * sp:.1f}" if dec else "—"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def absolute_table(results: dict, speedups: list[float], contenders: list[str]) -> str:
    lines = ["| speed-up | contender | side | requests | TTFT p50 s | TTFT p99 s | hits | tok/s |",
             "|---|---|---|---|---|---|---|---|"]
    for sp in speedups:
        for c in contenders:
            for side in ("sim", "live"):
                r = results.get((sp, c, side))
                if r is not None:
                    lines.append(f"| {sp:g}x | {c} | {side} | {r['requests']} | {r['ttft_p50']:.3f} | "
                                 f"{r['ttft_p99']:.2f} | "
                                 f"{r['hits']:.1%} | {r['tok_s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speedups", type=float, nargs="+", default=[20.0, 10.0, 5.0])
    ap.add_argument("--minutes", type=float, default=6.0, help="workload minutes per run")
    ap.add_argument("--warmup-min", type=float, default=2.0, help="requests before this are not measured (cold caches)")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--contenders", nargs="+", default=DEFAULT_CONTENDERS, choices=[*SIMULATED_AS,
                    "vllm_router_cache_aware", "vllm_router_consistent_hash", "vllm_router_power_of_two"])
    ap.add_argument("--out", default="docs", help="where bench-agree.md and bench-agree.json go")
    args = ap.parse_args(argv)
    contenders = [BASELINE] + [c for c in args.contenders if c != BASELINE]
    wl = bench_workload(args.minutes)
    t0 = time.monotonic()
    results: dict = {}
    sims = {c: simulated(SIMULATED_AS[c], wl, args.seed, args.replicas) for c in contenders if c in SIMULATED_AS}
    notes = []
    engine_lines = {}
    for sp in args.speedups:
        engine_lines[sp] = engine_check(sp)
        print(f"engine check at {sp:g}x: {engine_lines[sp]}", flush=True)
        for c in contenders:
            t = time.monotonic()
            try:
                reqs, extra = live(c, wl, args.seed, args.replicas, sp)
            except Exception as e:  # a contender that cannot start is a line that says why, not a lost run
                notes.append(f"{sp:g}x {c}: did not run: {str(e)[:160]}")
                print(f"{sp:4g}x {c:<28} did not run: {str(e)[:160]}", flush=True)
                continue
            results[(sp, c, "live")] = window_numbers(reqs, args.minutes, args.warmup_min, scale=sp) | extra
            if c in sims:
                results[(sp, c, "sim")] = window_numbers(sims[c], args.minutes, args.warmup_min)
                d = compare_streams(sims[c], reqs)
                notes.append(f"{sp:g}x {c}: {d.line()}")
                if d.mismatched:
                    print(f"FAIL: {c} at {sp:g}x: sessions {sorted(d.mismatched)[:5]} sent different turns live and "
                          "simulated", file=sys.stderr)
            v = results[(sp, c, "live")]
            print(f"{sp:4g}x {c:<28} {time.monotonic() - t:5.1f}s live p50 {v['ttft_p50']:.3f} p99 {v['ttft_p99']:.2f} "
                  f"hits {v['hits']:.1%} tok/s {v['tok_s']:.0f} not-engine p50 "
                  f"{v.get('overhead_p50', float('nan')):.3f}"
                  + (f" | sim p50 {results[(sp, c, 'sim')]['ttft_p50']:.3f} p99 "
                     f"{results[(sp, c, 'sim')]['ttft_p99']:.2f} "
                     f"hits {results[(sp, c, 'sim')]['hits']:.1%} tok/s {results[(sp, c, 'sim')]['tok_s']:.0f}"
                     if c in sims else ""), flush=True)
    wall = time.monotonic() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = (f"# Live and simulated, side by side\n\nCommand: `{invocation(argv)}` (bench/scenarios/agree.yaml), "
          f"{wall:.0f} s wall on this machine.\n\n"
          f"Workload: {args.minutes:g} minutes, {wl.sessions_per_min:g} agent sessions/min over {wl.projects} "
          f"projects, "
          f"{wl.oneshots_per_min:g} one-shots/min, seed {args.seed}, {args.replicas} replicas; measured after "
          f"{args.warmup_min:g} warm-up minutes. Ratios are to `{BASELINE}` of the same side.\n\n"
          + agree_table(results, args.speedups, contenders) + "\n\n## Absolute numbers\n\n"
          + absolute_table(results, args.speedups, contenders) + "\n\n## Same engine (one trace, one replica)\n\n"
          + "\n".join(f"- {sp:g}x: {line}" for sp, line in engine_lines.items()) + "\n\n## Same workload\n\n"
          + "\n".join(f"- {n}" for n in notes) + "\n")
    (out / "bench-agree.md").write_text(md)
    (out / "bench-agree.json").write_text(json.dumps({f"{k[0]:g}|{k[1]}|{k[2]}": v for k, v in results.items()},
                                                     indent=1))
    print("\n" + agree_table(results, args.speedups, contenders))
    print(f"\nwrote {out / 'bench-agree.md'} in {wall:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
