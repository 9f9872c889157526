"""``make bench``: warmroute against what users would deploy instead, on one workload, in one run.

For each contender a fresh fleet of mock vLLM replicas (same seed and
engine parameters) is started, the contender is pointed at it, and the
simulator's agent workload is replayed over HTTP (closed-loop sessions,
shared system prompts, long contexts). The mocks and the workload run
``speedup`` times faster than real time; warmroute's own time constants
(scrape interval, clean window, cooldowns, TTLs) are divided by the same
factor so that they keep their proportion to the traffic. Latencies are
reported in the workload's time (measured x speedup).

Contenders: Envoy ROUND_ROBIN, LEAST_REQUEST and RING_HASH on the session
header (with active /health checks, as one would deploy them), Envoy +
warmroute, vllm-router (cache_aware, consistent_hash, power_of_two) and
sglang-router (cache_aware) from PyPI (``pip install '.[bench]'``).
Scenarios: the plain workload, a replica that dies and returns mid-run, a
flapping replica; and, for flow control (issue 34), the plain workload with
a 2x burst for 2 minutes, and with a noisy tenant (one more tenant at 5x an
average project's rate), each request carrying its class and tenant and
each 429 sent again after its Retry-After.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

from bench.contenders import CONTENDERS, RUNS, WARMROUTE
from bench.harness import (
    Running,
    bench_workload,
    brain_decision_mean,
    class_headers,
    engine_counters,
    invocation,
    pace_check,
    start,
    workload_arguments,
)
from bench.report import FLOW_SCENARIOS, Row, flow_table, plots, table
from extproc.tools.sim.cli import speed_list
from extproc.core import imbalance_index
from extproc.tools.stack.local import http_get
from extproc.tools.workload.http_replay import ReplayResult, replay
from extproc.tools.workload.measure import pct, per_class, window_numbers

SCENARIOS = ["workload", "replica_dies_and_returns", "flapping_replica", "brain_killed", "burst", "noisy_tenant"]
# flow control's scenarios (issue 34), at the plain workload's pace, and who runs them: warmroute with and without
# flow control beside the peers that come closest under load; warmroute_flow runs these and the plain workload only
FLOW_CONTENDERS = RUNS["live.flow"]
BURST = (1.0, 2.0, 2.0)  # minutes after the warm-up it starts, minutes it lasts, times the arrival rates
NOISY_X = 5.0


# ---------------------------------------------------------------------------- measurement


def faults(scenario: str, run: "Running", speedup: float, duration: float,
           stop: threading.Event) -> threading.Thread | None:
    replicas = run.stack.replicas

    def die(rep, seconds):
        try:
            req = urllib.request.Request(rep.url + "/admin/fault", data=json.dumps({"die_for_s": seconds}).encode(),
                                         method="POST")
            urllib.request.urlopen(req, timeout=2).read()
        except OSError:
            pass

    if scenario == "replica_dies_and_returns":
        def run():
            if not stop.wait(duration / 3):
                die(replicas[1], 120.0 / speedup)  # down for 2 minutes of workload time
    elif scenario == "brain_killed":
        def run_():
            # SIGKILL the brain a third in: Envoy fails open to its bounded ring hash (SPEC C7) for the rest
            if not stop.wait(duration / 3) and run.stack.brain is not None:
                run.stack.brain.kill()
        t = threading.Thread(target=run_, daemon=True)
        t.start()
        return t
    elif scenario == "flapping_replica":
        def run():
            if stop.wait(duration / 6):
                return
            while not stop.is_set():
                die(replicas[2], 5.0 / speedup)  # down 5 s of every 20 s
                stop.wait(20.0 / speedup)
    else:
        return None
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def speedup_of(scenario: str, args) -> float:
    return args.speedup if scenario in ("workload", *FLOW_SCENARIOS) else args.fault_speedup


def runs(contender: str, scenario: str) -> bool:
    """Whether ``contender`` has a row in ``scenario``: flow control's scenarios are for FLOW_CONTENDERS, and
    warmroute_flow is measured there and on the plain workload; warmroute_ttft_only on the plain workload only."""
    if scenario in FLOW_SCENARIOS:
        return contender in FLOW_CONTENDERS
    return contender not in ("warmroute_flow", "warmroute_ttft_only") or scenario == "workload"



def measure_paced(contender: str, scenario: str, args) -> Row:
    """``measure`` at the scenario's pace; a plain-workload run that measured the machine (``pace_check``) is run
    again at half the pace, down to ``args.min_speedup``, and refused below it (its row says why)."""
    sp = speedup_of(scenario, args)
    tried = []
    while True:
        row = measure(contender, scenario, args, sp)
        if row.note or not row.pace:
            break
        if scenario != "workload":  # the other scenarios count errors and 429s: the row stays, flagged
            break
        tried.append(f"{sp:g}x: {row.pace}")
        if sp / 2 < getattr(args, "min_speedup", 1.0):
            row.note = f"refused, it measured the machine at {sp:g}x: {row.pace}"
            break
        sp /= 2
    row.paces = tried
    return row


def measure(contender: str, scenario: str, args, speedup: float | None = None) -> Row:
    if scenario == "brain_killed" and contender not in WARMROUTE:
        return Row(contender, scenario, note="n/a: no brain to kill")
    w = bench_workload(args.minutes, args.sessions_per_min, args.oneshots_per_min, args.projects)
    if scenario == "burst":
        w = dataclasses.replace(w, burst=(args.warmup_min + BURST[0], BURST[1], BURST[2]))
    elif scenario == "noisy_tenant":
        w = dataclasses.replace(w, noisy_tenant_x=NOISY_X)
    sp = speedup or speedup_of(scenario, args)
    mock_args = ["--speedup", str(sp)]
    replicas = args.replicas
    if getattr(args, "data_parallel", 1) > 1:  # the same engines, args.data_parallel behind each replica's front end
        mock_args += ["--data-parallel", str(args.data_parallel)]
        replicas = max(1, args.replicas // args.data_parallel)
    speeds = getattr(args, "replica_speeds", None)
    replica_args = {}
    if speeds:  # a mixed fleet (issue 49): replica i prefills and decodes at speeds[i] times the engine's speed
        replicas = len(speeds)
        replica_args = {f"r{i}": ["--speed", str(x)] for i, x in enumerate(speeds)}
    try:
        run = start(contender, replicas, mock_args, sp, replica_args)
    except Exception as e:  # a contender that cannot start is a row that says why (missing binary, no answer)
        return Row(contender, scenario, note=f"did not start: {e}"[:160])
    urls = [r.url for r in run.stack.replicas]
    stop = threading.Event()
    try:
        c0 = engine_counters(urls)
        duration = args.minutes * 60 / sp
        f = faults(scenario, run, sp, duration, stop)
        res: ReplayResult = asyncio.run(replay(run.url, w, seed=args.seed, speedup=sp, timeout=max(60.0, duration),
                                               extra_headers=class_headers, retry_429=True))
        stop.set()
        if f:
            f.join(5)
        fleet = engine_counters(urls) - c0
        decision = None
        if contender in WARMROUTE and run.stack.brain is not None and run.stack.brain.alive():
            decision = brain_decision_mean(http_get(run.stack.brain_metrics).decode())
    finally:
        stop.set()
        run.stop()
    s = sp
    # the simulator's rule (tools/workload/measure.py): after the warm-up, tokens of requests finished inside the window
    nums = window_numbers(res.requests, args.minutes, args.warmup_min, scale=s)
    ok = [r for r in res.requests if r.error is None and r.ttft is not None and r.arrival >= args.warmup_min * 60]
    row = Row(contender, scenario, speedup=sp)
    row.ttfts = sorted(r.ttft * s for r in ok)
    row.ttft_p50, row.ttft_p99 = nums["ttft_p50"], nums["ttft_p99"]
    e2e = [r.e2e * s for r in ok if r.e2e is not None]
    row.e2e_p50, row.e2e_p99 = pct(e2e, 0.5), pct(e2e, 0.99)
    row.out_tok_s = nums["tok_s"]
    row.prefix_hit = nums["hits"]
    row.fleet_hit = fleet.hit_rate
    row.not_engine_p50 = nums.get("overhead_p50", float("nan"))
    row.client_lag_ms = res.client_lag_p99 * 1000
    row.pace = pace_check(row.ttft_p50, res.client_lag_p99, row.not_engine_p50, sp) or ""
    row.brain_ms = decision * 1000 * sp if decision else float("nan")
    row.sent, row.lost, row.refused = res.sent, res.lost, res.refused
    row.classes = per_class(res.requests, args.warmup_min * 60, args.minutes * 60, scale=s)
    row.others_p99 = pct([r.ttft * s for r in ok if r.tenant != "noisy"], 0.99)
    row.errors = sum(res.errors.values())
    minutes = int(args.minutes) + 1
    per_min: list[Counter] = [Counter() for _ in range(minutes)]
    for t, rep in res.timeline:
        per_min[min(minutes - 1, int(t * s // 60))][rep] += 1
    names = [f"r{i}" for i in range(len(urls))]
    idx = [imbalance_index(c, names) for c in per_min[1:] if sum(c.values())]
    row.imbalance = statistics.mean(idx) if idx else float("nan")
    row.share = [[c[n] / sum(c.values()) if sum(c.values()) else 0.0 for n in names] for c in per_min]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workload_arguments(ap)
    ap.add_argument("--fault-speedup", type=float, default=20.0,
                    help="time compression of the fault scenarios (they count errors and lost requests)")
    ap.add_argument("--min-speedup", type=float, default=1.0,
                    help="a run that measured the machine (its client or the path lagging: harness.pace_check) "
                         "is run again at half the pace, down to this; below it the row is refused")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--replica-speeds", type=lambda v: [float(x) for x in speed_list(v).split(",")], default=None,
                    help="a mixed fleet: each replica's speed, e.g. 1,1,0.7,0.7,0.4,0.4 (overrides --replicas)")
    ap.add_argument("--data-parallel", type=int, default=1, help="engines behind each mock's front end (vLLM "
                    "--data-parallel-size): --replicas // this many replicas, as many engines in all")
    ap.add_argument("--contenders", nargs="+", default=CONTENDERS, choices=CONTENDERS)
    ap.add_argument("--scenarios", nargs="+", default=None, choices=SCENARIOS)
    ap.add_argument("--out", default="docs", help="where bench-results.md and the PNGs go")
    args = ap.parse_args(argv)
    args.scenarios = args.scenarios or SCENARIOS
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    rows = []
    for scenario in args.scenarios:
        for c in args.contenders:
            if not runs(c, scenario):
                continue
            t = time.monotonic()
            r = measure_paced(c, scenario, args)
            rows.append(r)
            print(f"{c:<28} {scenario:<26} {time.monotonic() - t:5.1f}s  "
                  + (r.note or f"TTFT p50 {r.ttft_p50:.2f}s p99 {r.ttft_p99:.1f}s, hit {r.prefix_hit:.0%}, "
                               f"imbalance {r.imbalance:.2f}, errors {r.errors}, lost {r.lost}"
                               + (f", standard p99 {r.classes.get('standard_ttft_p99', float('nan')):.1f}s, "
                                  f"goodput {r.classes.get('goodput', 0):.1f}/min, 429s {r.refused}"
                                  if scenario in FLOW_SCENARIOS else "")), flush=True)
    wall = time.monotonic() - t0
    md = table([r for r in rows if r.scenario not in FLOW_SCENARIOS])
    flow = flow_table(rows)
    if flow:
        md += ("\n\nUnder overload (flow control, issue 34): a 2x burst for 2 minutes from minute "
               f"{args.warmup_min + BURST[0]:g}, and a noisy tenant at {NOISY_X:g}x an average project's rate; "
               "every request carries its class and tenant, every 429 is sent again after its Retry-After and "
               "counts from its first attempt.\n\n" + flow)
    files = plots(rows, out)
    cpu = os.cpu_count()
    speeds = getattr(args, "replica_speeds", None)
    fleet = f"{len(speeds)} (speeds {','.join(f'{x:g}' for x in speeds)})" if speeds else str(args.replicas)
    header = (f"# warmroute benchmark\n\nCommand: `{invocation(argv)}`\n\n"
              f"Machine: {cpu} cores, loopback only. Each contender got a fresh fleet of {fleet} mock vLLM replicas "
              f"(engine model, same seed), the same workload ({args.minutes:g} workload minutes, "
              f"{args.sessions_per_min:g} agent "
              f"sessions/min over {args.projects} projects, {args.oneshots_per_min:g} one-shots/min, seed {args.seed}) "
              f"run "
              f"faster than real time (the pace column; the plain workload at {args.speedup:g}x, the faults at "
              f"{args.fault_speedup:g}x); times below are workload time, measured after {args.warmup_min:g} warm-up "
              f"minutes by the simulator's rule (`measure.window_numbers`). \"not-engine\" is the median part of a "
              f"TTFT that was not the replica engine's own (client, Envoy, brain or router, HTTP), in workload time; "
              f"\"brain\" the brain's mean decision time, in workload ms. A run whose client lagged or whose "
              f"not-engine part reached a set share of its TTFT measured the machine, not the replicas "
              f"(`harness.pace_check`): it is run again at half the pace, and refused below "
              f"{args.min_speedup:g}x. Wall time {wall:.0f} s.\n\n")
    (out / "bench-rows.json").write_text(json.dumps([dataclasses.asdict(r) for r in rows]))  # to redraw plots
    (out / "bench-results.md").write_text(header + md + "\n\n" + "\n".join(f"![{f}]({f})" for f in files) + "\n")
    print("\n" + md)
    print(f"\nwrote {out / 'bench-results.md'} and {', '.join(files)} in {wall:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
