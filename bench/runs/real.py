"""``make bench-real``: warmroute against its peers on real vLLM 0.32 engines, in real time (no compression).

Three real replicas of the tiny model (``make engines``; ~2 GB each, sharing this machine's two cores) are
started once. For each seed and each router, the replicas' prefix caches are emptied (``POST
/reset_prefix_cache``, vLLM's dev mode), the router is started in front of them, and the same multi-turn
workload is replayed through it: coding-agent sessions over three projects with shared system prompts, scaled
to what the tiny model reads (8K tokens) and two cores carry. Printed per run: TTFT p50/p99 as the client saw
it, the prefix-hit rate **the engines reported** (their ``prompt_tokens_cached`` over ``prompt_tokens``: not the
router's prediction), output tokens/s, and for warmroute the brain's mean decision time as a share of the mean
TTFT. Then each router's ratio to the best peer's, per seed: absolute times on two shared cores move between
runs, ratios in one run much less.

Routers: Envoy + warmroute; Envoy's RING_HASH on the session header with ``hash_balance_factor: 150`` and
LEAST_REQUEST (as ``make bench`` configures them); SGLang's router (``cache_aware``, from PyPI).

``--burst`` (``make bench-real-burst``): flow control's burst in real time (issue 34): every arrival rate 2x for
2 minutes of a 4-minute run, each request carrying its class and tenant and each 429 sent again after its
Retry-After; warmroute with flow control (``warmroute_flow``) and without, beside bounded ring hash; per class.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass

from bench.harness import (
    brain_decision_mean,
    class_headers,
    engine_counters,
    histogram_sums,
    pace_check,
    reset_caches,
    start_peer,
    wait_answering,
)
from extproc.tools.stack import real_vllm
from extproc.tools.stack.local import Replica, Stack, http_get
from extproc.tools.workload.generate import WorkloadConfig
from extproc.tools.workload.http_replay import replay
from extproc.tools.workload.measure import per_class

CONTENDERS = ["warmroute", "envoy_ring_hash_bounded_150", "envoy_least_request", "sglang_router_cache_aware"]
BURST_CONTENDERS = ["warmroute_flow", "warmroute_no_flow", "envoy_ring_hash_bounded_150"]
BURST = (1.0, 2.0, 2.0)  # from minute 1, for 2 minutes, twice the arrival rates (of a 4-minute run)
# what the tiny model reads (8K tokens; the workload counts 4 characters a token, the model's tokenizer ~3) and two
# shared cores decode (~30 tokens/s a stream)
WORKLOAD = WorkloadConfig(minutes=1.0, projects=3, system_tokens=(800, 1600), sessions_per_min=8.0,
                          turns_median=8.0, turns_max=20, user_tokens_median=150.0, output_tokens_median=24.0,
                          output_tokens_max=64, think_s_mean=3.0, long_share=0.0, max_context=5000,
                          oneshots_per_min=4.0)


@dataclass
class Row:
    contender: str
    seed: int
    sent: int = 0
    errors: int = 0
    ttft_p50: float = float("nan")
    ttft_p99: float = float("nan")
    hit: float = float("nan")
    out_tok_s: float = float("nan")
    brain_share: float | None = None
    max_share: float = float("nan")  # the busiest replica's share of the requests over a fair share
    client_lag_ms: float = float("nan")  # the client's own event-loop lag, p99
    pace: str = ""  # why this run measured the machine (bench_harness.pace_check)
    # warmroute: per replica, the brain's learned prefill tokens/s and decode s/token at the end of the run against
    # the engine's own histograms over the run: (learned prefill, true prefill, learned decode, true decode)
    rates: list[tuple[float, float, float, float]] = dataclasses.field(default_factory=list)
    refused: int = 0  # 429s with Retry-After, each sent again (flow control)
    classes: dict = dataclasses.field(default_factory=dict)  # sim.measure.per_class over the run
    note: str = ""


def start_router(contender: str, replicas: list[Replica], model: str) -> tuple[str, Stack]:
    """The router in front of the running replicas: its URL, and a stack that stops what it started."""
    config: dict = {"health": {"scrape_interval_s": 1.0, "probing_clean_window_s": 2.0}}
    if contender == "warmroute_flow":  # the bench's clients set their class and tenant (a trusted network)
        config.update({"flow_control": {"enabled": True, "trust_downstream_priority_header": True},
                       "envoy": {"trust_downstream_tenant_header": True}})
    elif contender == "warmroute_no_flow":  # flow control is on by default
        config["flow_control"] = {"enabled": False}
    s = Stack(0, config=config)
    try:
        proc = None
        if contender in ("warmroute", "warmroute_flow", "warmroute_no_flow"):
            s.replicas = list(replicas)
            s.write_config()
            s.start_brain()
            s.start_envoy()
            s.wait_all_live(60)
            url = s.url
        else:
            url, proc = start_peer(contender, [r.url for r in replicas], s.dir)
            s._started.append(proc)
        wait_answering(url, model, contender, proc, 90)
        return url, s
    except BaseException:
        s.stop()
        raise


def measure(contender: str, replicas: list[Replica], seed: int, w: WorkloadConfig, model: str) -> Row:
    row = Row(contender, seed)
    reset_caches([r.url for r in replicas])
    try:
        url, s = start_router(contender, replicas, model)
    except Exception as e:  # a router that cannot start is a row that says why
        row.note = f"did not start: {e}"[:160]
        return row
    try:
        urls = [r.url for r in replicas]
        h0 = [histogram_sums(http_get(u + "/metrics", 5).decode()) for u in urls]
        c0 = engine_counters(urls)
        t0 = time.monotonic()
        res = asyncio.run(replay(url, w, seed=seed, speedup=1.0, model=model, timeout=120.0,
                                 extra_headers=class_headers, retry_429=True))
        elapsed = time.monotonic() - t0
        c = engine_counters(urls) - c0
        decision = None
        if contender in ("warmroute", "warmroute_flow", "warmroute_no_flow"):
            decision = brain_decision_mean(http_get(s.brain_metrics).decode())
            learned = {r["name"]: r.get("learned") or {} for r in s.state()["replicas"]}
            for rep, before in zip(replicas, h0):
                d = {k: v - before[k] for k, v in histogram_sums(http_get(rep.url + "/metrics", 5).decode()).items()}
                mine = learned.get(rep.name, {})
                row.rates.append((mine.get("prefill_tokens_per_second", float("nan")),
                                  d["prefill_tokens"] / d["prefill_seconds"] if d["prefill_seconds"] else float("nan"),
                                  mine.get("decode_seconds_per_token", float("nan")),
                                  d["decode_seconds"] / d["decode_tokens"] if d["decode_tokens"] else float("nan")))
    finally:
        s.stop()
    ok = [r.ttft for r in res.requests if r.error is None and r.ttft is not None]
    row.sent, row.errors, row.refused = res.sent, sum(res.errors.values()) + res.lost, res.refused
    row.classes = per_class(res.requests, 0.0, w.minutes * 60)
    if ok:
        q = statistics.quantiles(ok, n=100, method="inclusive")
        row.ttft_p50, row.ttft_p99 = statistics.median(ok), q[98]
        if decision is not None:
            row.brain_share = decision / statistics.mean(ok)
    row.max_share = c.busiest_share
    row.hit = c.hit_rate if c.prompt else float("nan")
    row.out_tok_s = c.generated / elapsed
    row.client_lag_ms = res.client_lag_p99 * 1000
    # real engines report no engine-only time per request: the client's lag is the check here
    row.pace = pace_check(row.ttft_p50, res.client_lag_p99, None, 1.0) or ""
    return row


def table(rows: list[Row]) -> str:
    lines = ["| seed | router | sent | errors | TTFT p50 ms | TTFT p99 ms | engine prefix-hit | output tok/s | "
             "busiest replica / fair share | brain's share of TTFT | client lag p99 ms | vs best peer: hit, p50, p99 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for seed in sorted({r.seed for r in rows}):
        mine = [r for r in rows if r.seed == seed]
        peers = [r for r in mine if not r.contender.startswith("warmroute") and not r.note]
        for r in mine:
            if r.note:
                lines.append(f"| {seed} | {r.contender} | | | | | | | | | | {r.note} |")
                continue
            vs = ""
            if peers and r.contender.startswith("warmroute"):
                vs = (f"{r.hit - max(p.hit for p in peers):+.1%}, {r.ttft_p50 / min(p.ttft_p50 for p in peers):.2f}x, "
                      f"{r.ttft_p99 / min(p.ttft_p99 for p in peers):.2f}x")
            share = f"{r.brain_share:.1%}" if r.brain_share is not None else "-"
            lines.append(f"| {seed} | {r.contender} | {r.sent} | {r.errors} | {r.ttft_p50 * 1000:.0f} | "
                         f"{r.ttft_p99 * 1000:.0f} | {r.hit:.1%} | {r.out_tok_s:.0f} | {r.max_share:.2f}x | {share} | "
                         f"{r.client_lag_ms:.0f}{' (measured the machine: ' + r.pace + ')' if r.pace else ''} | {vs} |")
    learned = [r for r in rows if r.rates]
    if learned:
        lines += ["", "warmroute's learned rates at the end of each run against the engines' own histograms over the "
                  "run (prefill tokens/s, decode ms/token; learned / engine), per replica:", "",
                  "| seed | " + " | ".join(f"r{i}" for i in range(len(learned[0].rates))) + " |",
                  "|---|" + "---|" * len(learned[0].rates)]
        for r in learned:
            cells = [f"prefill {lp:.0f} / {tp:.0f}, decode {ld * 1000:.1f} / {td * 1000:.1f}"
                     for lp, tp, ld, td in r.rates]
            lines.append(f"| {r.seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--minutes", type=float, default=WORKLOAD.minutes, help="workload minutes per run (real time)")
    ap.add_argument("--contenders", default=None, help=f"default {','.join(CONTENDERS)}; with --burst "
                    f"{','.join(BURST_CONTENDERS)}")
    ap.add_argument("--burst", action="store_true", help="flow control's burst: 2x arrivals for 2 of 4 minutes")
    args = ap.parse_args(argv)
    if args.burst and args.minutes == WORKLOAD.minutes:
        args.minutes = 4.0
    args.contenders = args.contenders or ",".join(BURST_CONTENDERS if args.burst else CONTENDERS)
    why = real_vllm.available()
    if why:
        print(f"bench-real: {why}", file=sys.stderr)
        return 1
    w = dataclasses.replace(WORKLOAD, minutes=args.minutes, burst=BURST if args.burst else None)
    model = real_vllm.model_info()["served_name"]
    print(f"bench-real: {args.replicas} real vLLM {real_vllm.VERSION} replicas (tiny model, CPU), real time, "
          f"{args.minutes:g} min a run, seeds {args.seeds}; routers: {args.contenders}", flush=True)
    fleet = Stack(args.replicas, real_vllm=real_vllm.VllmOptions(dev_mode=True))
    rows = []
    with fleet:
        for seed in (int(x) for x in args.seeds.split(",")):
            for c in args.contenders.split(","):
                row = measure(c, fleet.replicas, seed, w, model)
                rows.append(row)
                print(f"  seed {seed} {c}: sent {row.sent}, errors {row.errors}, TTFT p50 {row.ttft_p50 * 1000:.0f} ms "
                      f"p99 {row.ttft_p99 * 1000:.0f} ms, engine hit {row.hit:.1%} {row.note}", flush=True)
    print(table(rows))
    if args.burst:
        print("\n" + class_table(rows))
    return 0


def class_table(rows: list[Row]) -> str:
    """Per class, over the run (flow control's burst): TTFT from a request's first attempt, goodput (requests per
    minute that met their class's deadline), 429s; standard p99 over bounded ring hash's in the same seed."""
    lines = ["| seed | router | standard TTFT p50 ms | standard p99 ms | sheddable p99 ms | goodput /min | 429s | "
             "errors | standard p99 / ring hash's |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.note:
            continue
        c = r.classes
        ring = next((x for x in rows if x.seed == r.seed and x.contender == "envoy_ring_hash_bounded_150"
                     and "standard_ttft_p99" in x.classes), None)
        ms = lambda k: f"{c[k] * 1000:.0f}" if k in c else "—"  # noqa: E731
        vs = f"{c['standard_ttft_p99'] / ring.classes['standard_ttft_p99']:.2f}x" \
            if ring is not None and "standard_ttft_p99" in c else ""
        lines.append(f"| {r.seed} | {r.contender} | {ms('standard_ttft_p50')} | {ms('standard_ttft_p99')} | "
                     f"{ms('sheddable_ttft_p99')} | {c.get('goodput', 0.0):.1f} | {r.refused} | {r.errors} | {vs} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
