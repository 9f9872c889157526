"""``make bench-real``: warmroute against its peers on real vLLM 0.32 engines, in real time (no compression).

Three real replicas of the tiny model (``make engines``; ~2 GB each, sharing this machine's two cores; LoRA off:
no request of this workload names an adapter; KV events on, as ``warmroute up --engine vllm`` starts them, so that
warmroute runs in exact mode as it ships) are started once. For each seed and each router, the replicas'
prefix caches are emptied (``POST /reset_prefix_cache``, vLLM's dev mode), the router is started in front of
them, and the same multi-turn workload is replayed through it: coding-agent sessions over three projects with
shared system prompts, sized to the tiny model (contexts up to ~6.5K of its 8K tokens; more sessions under way
than the three caches hold, so where a turn goes decides what it prefills again) and to what two cores carry
(~5 requests a second, 300+ a run). Printed per run: TTFT p50/p99 as the client saw it, the prefix-hit share
**the engines reported** (each answer's ``cached_tokens`` over its ``prompt_tokens``: not the router's
prediction), output tokens/s, and for warmroute the brain's mean decision time as a share of the mean TTFT;
each with a bootstrap 95% interval over the run's requests, and each router's ratio to the best peer's with
its interval (the two runs resampled independently). Then the same over the three seeds pooled. Before the first
run, a run's worth of another seed goes straight to the engines (``warm_up``), and each seed starts with the next
router in turn: no router is measured on cold engines or always in the same place.

A run that measured this machine rather than the engines is refused (``pace``; kept out of every ratio): the
client's own event-loop lag reached 10% of the TTFT p50, or the part of the mean TTFT that the engines did not
see (``vllm:time_to_first_token_seconds`` is timed inside vLLM: client, router, Envoy and HTTP are the rest)
reached 25% of it (flow control's holds in the brain are the router's own doing, not this machine's: they count
as the router's time).

Routers: Envoy + warmroute; Envoy's RING_HASH on the session header with ``hash_balance_factor: 150`` and
LEAST_REQUEST (as ``make bench`` configures them); SGLang's router and vLLM's router (``cache_aware``, the real
binaries from PyPI). llm-d's picker cannot run here (it needs a Kubernetes API server): it stays simulated.

``--burst`` (``make bench-real-burst``): flow control's burst in real time (issue 34): every arrival rate 2x for
2 minutes of a 4-minute run, each request carrying its class and tenant and each 429 sent again after its
Retry-After; warmroute with flow control (``warmroute_flow``) and without, beside bounded ring hash; per class.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.report import Measured
from bench.contenders import RUNS, WARMROUTE, overlaid
from bench.harness import (
    NOT_ENGINE_SHARE,
    brain_decision_mean,
    class_headers,
    engine_counters,
    histogram_sums,
    invocation,
    metric_total,
    pace_check,
    Running,
    front,
    reset_caches,
)
from extproc.tools.stack import real_vllm
from extproc.tools.stack.local import Replica, Stack, http_get
from extproc.tools.workload.generate import WorkloadConfig
from extproc.tools.workload.http_replay import replay
from extproc.tools.workload.measure import per_class

CONTENDERS = RUNS["real"]
# warmroute's rows: as `warmroute up --engine vllm` ships it (exact mode), the same counting by estimate (no KV events
# read, no tokenizer), and flow control's burst pair
WARMROUTE_ROWS = ("warmroute", "warmroute_estimate", "warmroute_flow", "warmroute_no_flow")
BURST_CONTENDERS = RUNS["real.burst"]
BURST = (1.0, 2.0, 2.0)  # from minute 1, for 2 minutes, twice the arrival rates (of a 4-minute run)
# what the tiny model reads (8K tokens; the workload counts 4 characters a token, the model's tokenizer ~3: a
# 5,000-token context is ~6,500 of its tokens) and what two shared cores carry: ~56 sessions a minute of ~10 turns,
# 2 s of thought between them, ~20 under way at once, their contexts (~3-6K tokens each) more than the three
# 32K-token caches hold
WORKLOAD = WorkloadConfig(minutes=1.1, projects=3, system_tokens=(800, 1600), sessions_per_min=56.0,
                          turns_median=10.0, turns_max=30, user_tokens_median=300.0, output_tokens_median=16.0,
                          output_tokens_max=48, think_s_mean=2.0, long_share=0.0, max_context=5000,
                          oneshots_per_min=20.0)
WARM_UP_SEED = 10_000  # the warm-up's workload: none of the measured seeds'
# the burst's (issue 34, make bench-real-burst): the pace it was measured at, doubled for 2 minutes
BURST_WORKLOAD = WorkloadConfig(minutes=4.0, projects=3, system_tokens=(800, 1600), sessions_per_min=8.0,
                                turns_median=8.0, turns_max=20, user_tokens_median=150.0, output_tokens_median=24.0,
                                output_tokens_max=64, think_s_mean=3.0, long_share=0.0, max_context=5000,
                                oneshots_per_min=4.0)
BOOTSTRAP = 2000  # resamples behind each interval


@dataclass
class Row(Measured):
    contender: str
    seed: int
    hit: float = float("nan")
    out_tok_s: float = dataclasses.field(default=float("nan"), kw_only=True)
    brain_share: float | None = None
    max_share: float = float("nan")  # the busiest replica's share of the requests over a fair share
    # warmroute: per replica, the brain's learned prefill tokens/s and decode s/token at the end of the run against
    # the engine's own histograms over the run: (learned prefill, true prefill, learned decode, true decode, the
    # run's mean batch, the learned prefill and decode at that batch)
    rates: list[tuple[float, ...]] = dataclasses.field(default_factory=list)
    hits: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # each answer's (cached, prompt) tokens
    not_engine: float = float("nan")  # of the mean TTFT, the share the engines did not see
    served: dict[str, int] = dataclasses.field(default_factory=dict)  # replica -> requests its engine received
    header_share: float | None = None  # warmroute: the share of its decisions taken at the headers (issue 61)
    engine_ttft_mean: float = float("nan")  # the engines' own mean TTFT over the run
    brain_cpu: float | None = None  # warmroute: the brain's CPU seconds per second of the run (cores it used)
    # cores the router took over the run (every process it started: warmroute's brain, its tokenizer worker and Envoy;
    # a peer's binary), and the engines (API servers and engine cores): on cores the engines share with the router, what
    # one takes the other does not get
    router_cpu: float = float("nan")
    engines_cpu: float = float("nan")
    # of the machine's CPU time over the run, what stayed idle and what the hypervisor took for other guests (steal;
    # at most ~2% here, while the probe below moves ~2x: the host slows this guest without counting it as steal)
    idle_share: float = float("nan")
    steal_share: float = float("nan")
    # seconds a fixed single-threaded CPU job took just before and just after the run, the engines idle: what the
    # hypervisor's steal does not show (the host's clock, its other guests' load on memory and caches)
    probe_s: tuple[float, float] = (float("nan"), float("nan"))
    held_s: float = 0.0  # warmroute: seconds flow control held requests in the brain, summed over the run
    moved: dict[str, int] = dataclasses.field(default_factory=dict)  # warmroute: sessions moved off a home, by cause
    ejected: dict[str, int] = dataclasses.field(default_factory=dict)  # warmroute: replicas ejected, by reason
    # warmroute: its health scrapes that failed, and why (the brain logs a reason when it changes)
    scrapes_failed: int = 0
    scrape_errors: set[str] = dataclasses.field(default_factory=set)
    # warmroute: each streamed request's predicted time to first token against Envoy's observed one, joined by the
    # brain (GET /decisions): (predicted, observed) seconds, and per replica its (bias, MAPE) at the end of the run
    predictions: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    joined: list[dict] = dataclasses.field(default_factory=list)  # those decisions whole (what the error is read from)
    # each answered request as the client saw it (session number, sent at, tokens, first token): every router's, to
    # compare them turn by turn (first turns, turns under way) where the pooled quantiles differ
    sent_requests: list[dict] = dataclasses.field(default_factory=list)


def start_router(contender: str, replicas: list[Replica], model: str) -> Running:
    """The router in front of the running replicas, answering (``harness.front``); stopping it stops what it
    started, not the engines."""
    # as `warmroute up --engine vllm` ships it: the engines publish KV events and the brain has the model's tokenizer
    # (exact mode); the header path on (envoy.header_path, the default); scraped at the default interval (3 s: stale
    # after 9 s). Scraped every second, the stale window was 3 s, and a CPU-starved API server that answered neither a
    # scrape nor a user for that long was ejected twice in one run of three, its sessions moved. Only the PROBING
    # window is shorter, so that the replicas are LIVE sooner before a run is measured
    config: dict = {"health": {"probing_clean_window_s": 2.0},
                    "exact_cache": {"tokenizers": {model: str(real_vllm.model_dir())}}}
    s = Stack(0, config=overlaid(config, contender) if contender in WARMROUTE else config)
    s.replicas = list(replicas)
    try:
        return front(contender, s, model=model, answer_timeout_s=90)
    except BaseException:
        s.stop()
        raise


def measure(contender: str, replicas: list[Replica], seed: int, w: WorkloadConfig, model: str,
            logs: Path | None = None) -> Row:
    """One router's run; ``logs``: where warmroute's brain log is kept (``brain-<seed>-<router>.log``)."""
    row = Row(contender, seed)
    reset_caches([r.url for r in replicas])
    try:
        run = start_router(contender, replicas, model)
        url, s = run.url, run.stack
    except Exception as e:  # a router that cannot start is a row that says why
        row.note = f"did not start: {e}"[:160]
        return row
    try:
        urls = [r.url for r in replicas]
        h0 = [histogram_sums(http_get(u + "/metrics", 5).decode()) for u in urls]
        c0, e0 = engine_counters(urls), _engine_ttft(urls)
        brain_cpu0 = _cpu_s(s.brain.popen.pid) if getattr(s, "brain", None) is not None else None
        router = [p.popen.pid for p in (s.brain, s.envoy, *run.procs) if p is not None]
        engines = [r.proc.popen.pid for r in replicas]
        logged0 = [r.proc.log_path.stat().st_size for r in replicas]
        probe0 = machine_probe_s()
        cpu0, machine0 = (sessions_cpu_s(router), sessions_cpu_s(engines)), machine_times()
        t0 = time.monotonic()
        res = asyncio.run(replay(url, w, seed=seed, speedup=1.0, model=model, timeout=120.0,
                                 extra_headers=class_headers, retry_429=True))
        elapsed = time.monotonic() - t0
        row.router_cpu = (sessions_cpu_s(router) - cpu0[0]) / elapsed
        row.engines_cpu = (sessions_cpu_s(engines) - cpu0[1]) / elapsed
        total, idle, steal = (b - a for a, b in zip(machine0, machine_times()))
        row.idle_share, row.steal_share = (idle / total, steal / total) if total else (float("nan"),) * 2
        row.probe_s = (probe0, machine_probe_s())
        c = engine_counters(urls) - c0
        e1 = _engine_ttft(urls)
        engine_ttft = (e1[0] - e0[0]) / (e1[1] - e0[1]) if e1[1] > e0[1] else float("nan")
        row.engine_ttft_mean = engine_ttft
        decision, held = None, 0.0
        if contender in WARMROUTE_ROWS:
            brain = http_get(s.brain_metrics).decode()
            decision = brain_decision_mean(brain)
            # seconds flow control held requests in the brain: the router's choice, not this machine's slowness
            held = metric_total(brain, "warmroute_flow_wait_seconds_total")
            row.held_s = held
            # where a session left the home that held its context (ring hash moves one only past its bound)
            row.moved = {c: int(metric_total(brain, "warmroute_rebinds_total", kind="session", cause=c))
                         for c in ("cost", "spills", "force", "dead")}
            # a dead home is what moves sessions by "dead": which rule ejected it (the last 20 transitions), and
            # what the failed scrapes said (the brain's log)
            for t in s.state()["recent_transitions"]:
                if t["new"] == "EJECTED":
                    row.ejected[t["reason"]] = row.ejected.get(t["reason"], 0) + 1
            log = s.brain.log_tail(20_000_000)
            if logs is not None:
                logs.mkdir(parents=True, exist_ok=True)
                path, n = logs / f"brain-{seed}-{contender}.log", 1
                while path.exists():  # the same seed run again (--seeds 1,1): each run its own log
                    n += 1
                    path = logs / f"brain-{seed}-{contender}-{n}.log"
                path.write_text(log)
            for line in log.splitlines():
                if '"event":"scrape_failed"' in line:
                    why = str(json.loads(line).get("reason", "?"))
                    row.scrape_errors.add(why)
            row.scrapes_failed = int(metric_total(brain, "warmroute_scrapes_total", result="failed"))
            by_path = {p: metric_total(brain, "warmroute_decisions_by_path_total", path=p) for p in ("headers", "body")}
            row.header_share = by_path["headers"] / max(1.0, sum(by_path.values()))
            if brain_cpu0 is not None:  # of this machine's cores, what the brain took from the engines
                row.brain_cpu = (_cpu_s(s.brain.popen.pid) - brain_cpu0) / elapsed
            learned = {r["name"]: r.get("learned") or {} for r in s.state()["replicas"]}
            decisions = json.loads(s.admin_get("/decisions?last=2000"))["decisions"]
            row.predictions = joined_predictions(decisions)
            row.joined = [d for d in decisions if d.get("observed_ttft_s") is not None]
            for rep, before in zip(replicas, h0):
                d = {k: v - before[k] for k, v in histogram_sums(http_get(rep.url + "/metrics", 5).decode()).items()}
                row.rates.append(learned_rates(learned.get(rep.name, {}), d, elapsed))
    finally:
        run.stop()
    ok = [r.ttft for r in res.requests if r.error is None and r.ttft is not None]
    row.ttfts = ok
    served = served_by(replicas, logged0)
    for name in served.values():
        row.served[name] = row.served.get(name, 0) + 1
    row.sent_requests = [{"sid": r.sid, "oneshot": r.oneshot, "arrival": round(r.arrival, 3),
                          "prompt_tokens": r.extra.get("prompt_tokens"), "cached_tokens": r.cached_tokens,
                          "ttft_s": round(r.ttft, 4), "replica": served.get(r.extra.get("response_id", ""))}
                         for r in res.requests if r.error is None and r.ttft is not None]
    row.hits = [(r.cached_tokens or 0, r.extra["prompt_tokens"]) for r in res.requests
                if r.error is None and r.extra.get("prompt_tokens")]
    row.sent, row.errors, row.refused = res.sent, sum(res.errors.values()) + res.lost, res.refused
    row.classes = per_class(res.requests, 0.0, w.minutes * 60)
    if ok:
        q = statistics.quantiles(ok, n=100, method="inclusive")
        row.ttft_p50, row.ttft_p99 = statistics.median(ok), q[98]
        if decision is not None:
            row.brain_share = decision / statistics.mean(ok)
    row.max_share = c.busiest_share
    row.hit = _hit(row.hits) if row.hits else c.hit_rate if c.prompt else float("nan")
    row.out_tok_s = c.generated / elapsed
    row.client_lag_ms = res.client_lag_p99 * 1000
    if ok:
        # of the TTFTs' sum, what neither the engines nor flow control's holds account for
        row.not_engine = max(0.0, 1.0 - (engine_ttft * len(ok) + held) / sum(ok))
    row.pace = pace_check(row.ttft_p50, res.client_lag_p99, None, 1.0) or ""
    if not row.pace and row.not_engine >= NOT_ENGINE_SHARE:
        row.pace = (f"{row.not_engine:.0%} of the mean TTFT was not the engines' (client, router, Envoy, HTTP): "
                    f"the run measured the machine")
    return row


def served_by(replicas: list[Replica], logged0: list[int]) -> dict[str, str]:
    """Each answer's id -> the replica whose engine logged receiving it since the run began (byte ``logged0`` of its
    log): which replica served, for every router (SGLang's and Envoy's say nothing of it)."""
    out: dict[str, str] = {}
    for r, start in zip(replicas, logged0):
        with open(r.proc.log_path, "rb") as f:
            f.seek(start)
            out.update((i, r.name) for i in real_vllm.served_ids(f.read()))
    return out


def learned_rates(mine: dict, d: dict[str, float], elapsed: float) -> tuple[float, ...]:
    """One replica's learned rates beside the engine's own over a run (``d``: its histograms' deltas). The brain
    learns a line in the batch (``core.load.BatchFit``: the rate beside no other request, and a slowdown per request
    running beside it); the engine's means are over the batches the run had. So the line is also read at the run's
    mean batch: the requests the engine ran at once on average, its prefill and decode seconds over the run's
    (Little's law; time-weighted, so a little below the batch an average token saw)."""
    nan = float("nan")
    prefill, decode = mine.get("prefill_tokens_per_second", nan), mine.get("decode_seconds_per_token", nan)
    batch = (d["prefill_seconds"] + d["decode_seconds"]) / elapsed if elapsed > 0 else nan
    return (prefill, d["prefill_tokens"] / d["prefill_seconds"] if d["prefill_seconds"] else nan,
            decode, d["decode_seconds"] / d["decode_tokens"] if d["decode_tokens"] else nan, batch,
            prefill / (1.0 + mine.get("prefill_slowdown_per_running_request", 0.0) * batch),
            decode * (1.0 + mine.get("decode_slowdown_per_running_request", 0.0) * batch))


def joined_predictions(decisions: list[dict]) -> list[tuple[float, float]]:
    """(predicted, observed) time to first token of each decision whose request Envoy's entry joined."""
    return [(d["predicted_ttft_s"], d["observed_ttft_s"]) for d in decisions
            if d.get("predicted_ttft_s") is not None and d.get("observed_ttft_s") is not None]


def prediction_error(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """(MAPE, bias) as the brain reports them per replica (extproc/brain/outcomes.py), over ``pairs``."""
    pairs = [(p, max(o, 1e-3)) for p, o in pairs]
    return (sum(abs(p - o) / o for p, o in pairs) / len(pairs),
            sum(p for p, _ in pairs) / sum(o for _, o in pairs) - 1.0)


def queue_floor(joined: list[dict]) -> tuple[float, float, float, float] | None:
    """What a predictor that knew which requests were still ahead of each on its replica gets: each request's time to
    first token as ``c + (tokens ahead + its own uncached tokens) / R`` (every request decided on the replica before it
    whose first byte Envoy had not yet seen, by the brain's count of their uncached tokens), with the ``R`` and ``c``
    of each replica that fit best, fitted on the very requests it then predicts (so a floor, not a predictor).
    (MAPE at the best fits, its bias, the best MAPE with each replica's |bias| <= 5%, its bias); None without joined
    requests."""
    by: dict[str, list[dict]] = {}
    for d in joined:
        if d.get("observed_ttft_s") and d.get("predicted_prompt_tokens") is not None:
            by.setdefault(d["replica"], []).append(d)
    if not by:
        return None
    best_all: list[tuple[float, float]] = []
    within_all: list[tuple[float, float]] = []
    for reqs in by.values():
        reqs.sort(key=lambda d: d["at"])
        own = [max(0, d["predicted_prompt_tokens"] - (d.get("predicted_cached_tokens") or 0)) for d in reqs]
        pts = []  # (tokens to compute before this request's first token, observed seconds)
        for i, d in enumerate(reqs):
            ahead = sum(u for e, u in zip(reqs[:i], own[:i]) if e["at"] + e["observed_ttft_s"] > d["at"])
            pts.append((ahead + own[i], max(d["observed_ttft_s"], 1e-3)))
        best = within = None
        for k in range(140):  # R from 50 to ~1.3M tokens/s, 7.5% apart
            rate = 50 * 1.075 ** k
            for c in (0.0, 0.025, 0.05, 0.1, 0.2, 0.4):
                pairs = [(c + t / rate, o) for t, o in pts]
                mape, bias = prediction_error(pairs)
                if best is None or mape < best[0]:
                    best = (mape, pairs)
                if abs(bias) <= 0.05 and (within is None or mape < within[0]):
                    within = (mape, pairs)
        assert best is not None
        best_all += best[1]
        within_all += (within or best)[1]
    return (*prediction_error(best_all), *prediction_error(within_all))


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sessions_cpu_s(sids: list[int]) -> float:
    """CPU seconds of every process in the sessions ``sids`` (each process the stack starts leads its own session:
    its children, e.g. vLLM's engine core or the brain's tokenizer worker, are in it), waited-for children included."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # ended while read
            continue
        if int(fields[3]) in sids:
            total += sum(int(f) for f in fields[11:15])
    return total / os.sysconf("SC_CLK_TCK")


def machine_probe_s() -> float:
    """Seconds a fixed pure-Python job takes on one core now (the best of three): the machine's pace."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        sum(i * i for i in range(400_000))
        best = min(best, time.perf_counter() - t0)
    return best


def machine_times() -> tuple[int, int, int]:
    """(all, idle, steal) CPU ticks of the whole machine since boot (/proc/stat's first line)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(ticks), ticks[3] + ticks[4], ticks[7]  # idle and iowait; steal


def _engine_ttft(urls: list[str]) -> tuple[float, float]:
    """(sum, count) of the engines' own vllm:time_to_first_token_seconds, timed inside vLLM."""
    texts = [http_get(u + "/metrics", 5).decode() for u in urls]
    return (sum(metric_total(t, "vllm:time_to_first_token_seconds_sum") for t in texts),
            sum(metric_total(t, "vllm:time_to_first_token_seconds_count") for t in texts))


def _hit(pairs) -> float:
    prompt = sum(p for _, p in pairs)
    return sum(c for c, _ in pairs) / prompt if prompt else float("nan")


def _q(values, q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


STATS = {"p50": lambda r: r.ttfts and _q(r.ttfts, 0.5), "p99": lambda r: r.ttfts and _q(r.ttfts, 0.99),
         "hit": lambda r: r.hits and _hit(r.hits)}


def _resampled(rows: list[Row], stat: str, rng: random.Random) -> list[float]:
    """``BOOTSTRAP`` values of one statistic over the requests of ``rows`` pooled, each drawn with replacement."""
    if stat == "hit":
        pairs = [h for r in rows for h in r.hits]
        return [_hit(rng.choices(pairs, k=len(pairs))) for _ in range(BOOTSTRAP)] if pairs else []
    values = [t for r in rows for t in r.ttfts]
    q = 0.5 if stat == "p50" else 0.99
    return [_q(rng.choices(values, k=len(values)), q) for _ in range(BOOTSTRAP)] if values else []


def _interval(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return xs[int(0.025 * (len(xs) - 1))], xs[int(0.975 * (len(xs) - 1))]


def compare(rows: list[Row], seed: int | None = None) -> dict[str, dict[str, tuple]]:
    """Per router (the rows of one seed, or of every seed pooled): each statistic with its interval, and for warmroute
    its ratio to the best peer's (hit: the difference) with the interval of the ratio, both sides resampled."""
    rng = random.Random(seed or 0)
    mine = [r for r in rows if (seed is None or r.seed == seed) and not r.note and not r.pace and r.ttfts]
    by: dict[str, list[Row]] = {}
    for r in mine:
        by.setdefault(r.contender, []).append(r)
    out: dict[str, dict[str, tuple]] = {}
    draws = {c: {k: _resampled(rs, k, rng) for k in STATS} for c, rs in by.items()}
    for c, rs in by.items():
        pooled = Row(c, seed or 0, ttfts=[t for r in rs for t in r.ttfts], hits=[h for r in rs for h in r.hits])
        out[c] = {k: (f(pooled), *(_interval(draws[c][k]) if draws[c][k] else (float("nan"),) * 2))
                  for k, f in STATS.items()}
    peers = [c for c in by if not c.startswith("warmroute")]
    for c in by:
        if not c.startswith("warmroute") or not peers:
            continue
        for k in STATS:
            best = max(peers, key=lambda p: out[p][k][0]) if k == "hit" else min(peers, key=lambda p: out[p][k][0])
            mine_k, theirs_k, a, b = _paired(by[c], by[best], k, rng)
            if mine_k is None:
                mine_k, theirs_k, a, b = out[c][k][0], out[best][k][0], draws[c][k], draws[best][k]
            if k == "hit":
                diffs = [x - y for x, y in zip(a, b)]
                out[c]["vs_" + k] = (mine_k - theirs_k, *_interval(diffs), best)
            else:
                ratios = [x / y for x, y in zip(a, b) if y > 0]
                out[c]["vs_" + k] = (mine_k / theirs_k, *_interval(ratios), best)
    return out


def _paired(mine: list[Row], theirs: list[Row], k: str, rng: random.Random) -> tuple:
    """Two routers' statistic over the seeds both ran (a run refused for the machine's pace leaves its seed out of
    the comparison, on both sides: pooled with the others' seeds, a slow spell's seed counted for one router only),
    with its resampled values; (None, ...) when both ran the same seeds."""
    common = {r.seed for r in mine} & {r.seed for r in theirs}
    if common == {r.seed for r in mine} == {r.seed for r in theirs} or not common:
        return None, None, None, None
    pair = [[r for r in rows if r.seed in common] for rows in (mine, theirs)]
    pooled = [Row(rows[0].contender, 0, ttfts=[t for r in rows for t in r.ttfts],
                  hits=[h for r in rows for h in r.hits]) for rows in pair]
    return (STATS[k](pooled[0]), STATS[k](pooled[1]), _resampled(pair[0], k, rng), _resampled(pair[1], k, rng))


def _ms(x: tuple) -> str:
    return f"{x[0] * 1000:.0f} [{x[1] * 1000:.0f}, {x[2] * 1000:.0f}]"


def _vs(x: tuple | None, kind: str) -> str:
    if x is None:
        return ""
    if kind == "hit":
        return f"{x[0]:+.1%} [{x[1]:+.1%}, {x[2]:+.1%}]"
    return f"{x[0]:.2f}x [{x[1]:.2f}, {x[2]:.2f}]"


def table(rows: list[Row]) -> str:
    """Per seed, then the seeds pooled: each router's TTFT p50 and p99 and engine-reported hit share with their
    bootstrap 95% intervals, and warmroute's against the best peer's (ratio, or difference of hit shares)."""
    lines = ["| seed | router | sent | errors | TTFT p50 ms [95% CI] | TTFT p99 ms [95% CI] | engine prefix-hit [95% "
             "CI] | "
             "output tok/s | busiest / fair share | brain's share of TTFT | not the engines' | "
             "vs best peer: hit | p50 | p99 |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    seeds = sorted({r.seed for r in rows})
    for seed in [*seeds, None]:
        stats = compare(rows, seed)
        for r in ([x for x in rows if x.seed == seed] if seed is not None else []):
            if r.note:
                lines.append(f"| {seed} | {r.contender} | | | | | | | | | | {r.note} | | |")
                continue
            st = stats.get(r.contender)
            share = f"{r.brain_share:.1%}" if r.brain_share is not None else "-"
            pace = f" (refused: {r.pace})" if r.pace else ""
            if st is None:
                lines.append(f"| {seed} | {r.contender} | {r.sent} | {r.errors} | | | | | | | {r.not_engine:.0%}{pace} "
                             f"| | | |")
                continue
            lines.append(f"| {seed} | {r.contender} | {r.sent} | {r.errors} | {_ms(st['p50'])} | {_ms(st['p99'])} | "
                         f"{st['hit'][0]:.1%} [{st['hit'][1]:.1%}, {st['hit'][2]:.1%}] | {r.out_tok_s:.0f} | "
                         f"{r.max_share:.2f}x | {share} | {r.not_engine:.0%}{pace} | {_vs(st.get('vs_hit'), 'hit')} | "
                         f"{_vs(st.get('vs_p50'), 't')} | {_vs(st.get('vs_p99'), 't')} |")
        if seed is None:
            for c, st in stats.items():
                n = sum(len(r.ttfts) for r in rows if r.contender == c and not r.note and not r.pace)
                lines.append(f"| all | {c} | {n} answered | | {_ms(st['p50'])} | {_ms(st['p99'])} | "
                             f"{st['hit'][0]:.1%} [{st['hit'][1]:.1%}, {st['hit'][2]:.1%}] | | | | | "
                             f"{_vs(st.get('vs_hit'), 'hit')} | {_vs(st.get('vs_p50'), 't')} | "
                             f"{_vs(st.get('vs_p99'), 't')} |")
    predicted = [r for r in rows if r.predictions]
    if predicted:
        lines += ["", "warmroute's predicted time to first token against Envoy's (from the request's last byte sent to "
                  "the replica to the response's first body byte), every streamed request joined by the brain:", "",
                  "| seed | router | joined | MAPE | bias | predicted p50 ms | observed p50 ms |",
                  "|---|---|---|---|---|---|---|"]
        for r in predicted:
            mape, bias = prediction_error(r.predictions)
            lines.append(f"| {r.seed} | {r.contender} | {len(r.predictions)} | {mape:.2f} | {bias:+.0%} | "
                         f"{statistics.median(p for p, _ in r.predictions) * 1000:.0f} | "
                         f"{statistics.median(o for _, o in r.predictions) * 1000:.0f} |")
        pooled = [x for r in predicted for x in r.predictions]
        mape, bias = prediction_error(pooled)
        lines.append(f"| all | | {len(pooled)} | {mape:.2f} | {bias:+.0%} | | |")
        floors = [(r, queue_floor(r.joined)) for r in predicted]
        lines += ["", "Against what a predictor that knew which requests were still ahead of each could get "
                  "(`queue_floor`: their uncached tokens and its own over one throughput and one constant per "
                  "replica, fitted on the run itself):", "",
                  "| seed | router | warmroute's MAPE | floor MAPE (bias) | floor MAPE within 5% bias |",
                  "|---|---|---|---|---|"]
        for r, f in floors:
            if f is not None:
                lines.append(f"| {r.seed} | {r.contender} | {prediction_error(r.predictions)[0]:.2f} | "
                             f"{f[0]:.2f} ({f[1]:+.0%}) | {f[2]:.2f} ({f[3]:+.0%}) |")
    learned = [r for r in rows if r.rates]
    if learned:
        lines += ["", "warmroute's learned rates at the end of each run against the engines' own histograms over the "
                  "run (prefill tokens/s, decode ms/token; learned / engine), per replica: the learned line read at "
                  "the run's mean batch (the requests each engine ran at once on average), then beside no other "
                  "request:", "",
                  "| seed | " + " | ".join(f"r{i}" for i in range(len(learned[0].rates))) + " |",
                  "|---|" + "---|" * len(learned[0].rates)]
        for r in learned:
            cells = [f"prefill {bp:.0f} / {tp:.0f}, decode {bd * 1000:.1f} / {td * 1000:.1f} at batch {b:.1f} "
                     f"(none: {lp:.0f}, {ld * 1000:.1f})" for lp, tp, ld, td, b, bp, bd in r.rates]
            lines.append(f"| {r.seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=None,
                    help="default: as many as this machine has cores, at most 3 (each on a core of its own)")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=None,
                    help="each replica's processes on a core of its own (replica i on core i), as replicas with "
                         "accelerators of their own; the default wherever there are as many cores as replicas. "
                         "Unpinned, engines that outnumber the cores share them, and a router that leaves a replica "
                         "idle runs fewer engines on the same cores (SGLang's left one of three idle: its whole "
                         "distribution lower)")
    ap.add_argument("--minutes", type=float, default=WORKLOAD.minutes, help="workload minutes per run (real time)")
    ap.add_argument("--contenders", default=None, help=f"default {','.join(CONTENDERS)}; with --burst "
                    f"{','.join(BURST_CONTENDERS)}")
    ap.add_argument("--burst", action="store_true", help="flow control's burst: 2x arrivals for 2 of 4 minutes")
    ap.add_argument("--out", default="docs", help="where bench-real.md goes (the table, the command, the date)")
    ap.add_argument("--logs", default=None,
                    help="a directory to keep warmroute's brain logs in (hashes and names only)")
    ap.add_argument("--floor", default=None, metavar="PREDICTIONS_JSON",
                    help="only print queue_floor's line for each run of a bench-real-predictions.json written before")
    args = ap.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    args.replicas = args.replicas or max(2, min(3, cores))
    if args.pin is None:
        args.pin = args.replicas <= cores
    if not args.burst and not args.floor:  # the modes that write DIR
        try:  # before the engines start: a path that cannot be written says so now, not after the runs
            Path(args.out).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            print(f"bench-real: --out {args.out}: {e.strerror or e}", file=sys.stderr)
            return 2
    if args.floor:
        runs: dict[tuple, list[dict]] = {}
        for d in json.loads(Path(args.floor).read_text()):
            runs.setdefault((d["seed"], d["router"]), []).append(d)
        for (seed, router), ds in sorted(runs.items()):
            f = queue_floor(ds)
            mape, bias = prediction_error(joined_predictions(ds))
            print(f"seed {seed} {router}: {len(ds)} joined, warmroute's MAPE {mape:.2f} ({bias:+.0%})" + (
                f", floor {f[0]:.2f} ({f[1]:+.0%}), within 5% bias {f[2]:.2f} ({f[3]:+.0%})" if f else ""))
        return 0
    base = BURST_WORKLOAD if args.burst else WORKLOAD
    if args.burst and args.minutes == WORKLOAD.minutes:
        args.minutes = BURST_WORKLOAD.minutes
    args.contenders = args.contenders or ",".join(BURST_CONTENDERS if args.burst else CONTENDERS)
    why = real_vllm.available()
    if why:
        print(f"bench-real: {why}", file=sys.stderr)
        return 1
    w = dataclasses.replace(base, minutes=args.minutes, burst=BURST if args.burst else None)
    model = real_vllm.model_info()["served_name"]
    print(f"bench-real: {args.replicas} real vLLM {real_vllm.VERSION} replicas (tiny model, CPU), real time, "
          f"{args.minutes:g} min a run, seeds {args.seeds}; routers: {args.contenders}", flush=True)
    if not args.pin:
        print(f"  not pinned: {args.replicas} engines share {cores} cores, and a router that leaves one idle runs the "
              f"others faster", flush=True)
    fleet = Stack(args.replicas, real_vllm=real_vllm.VllmOptions(dev_mode=True, lora=(), kv_events=True,
                                                                            log_requests=True))
    rows = []
    with fleet:
        if args.pin:
            pin_replicas(fleet.replicas)
        warm_up(fleet.replicas, dataclasses.replace(w, minutes=WORKLOAD.minutes, burst=None), model)
        names = args.contenders.split(",")
        for i, seed in enumerate(int(x) for x in args.seeds.split(",")):
            # each seed starts with another router: the engines drift over a run (a busy spell of this machine), and
            # no router should always take the same place in it
            for c in names[i % len(names):] + names[:i % len(names)]:
                row = measure(c, fleet.replicas, seed, w, model, Path(args.logs) if args.logs else None)
                rows.append(row)
                hdr = f", {row.header_share:.0%} decided at the headers" if row.header_share is not None else ""
                if row.brain_cpu is not None:
                    hdr += f", brain {row.brain_cpu:.2f} cores, held {row.held_s:.1f} s in all"
                    hdr += ", sessions moved " + " ".join(f"{n} by {c}" for c, n in row.moved.items() if n) \
                        if any(row.moved.values()) else ", no session moved"
                    hdr += "".join(f", ejected {n}x by {r}" for r, n in sorted(row.ejected.items()))
                    if row.scrapes_failed:
                        why = f" (health: {'; '.join(sorted(row.scrape_errors))})" if row.scrape_errors else ""
                        hdr += f", {row.scrapes_failed} scrapes failed{why}"  # load refreshes' failures included
                hdr += f", engines' own mean TTFT {row.engine_ttft_mean * 1000:.0f} ms"
                hdr += ", served " + " ".join(f"{r.name} {row.served.get(r.name, 0)}" for r in fleet.replicas)
                hdr += f", cores: router {row.router_cpu:.2f}, engines {row.engines_cpu:.2f}"
                hdr += f", machine idle {row.idle_share:.0%}, stolen {row.steal_share:.1%}"
                hdr += f", probe {row.probe_s[0] * 1000:.0f} -> {row.probe_s[1] * 1000:.0f} ms"
                if row.predictions:
                    mape, bias = prediction_error(row.predictions)
                    hdr += f", predicted TTFT: MAPE {mape:.2f} bias {bias:+.0%} over {len(row.predictions)} joined"
                print(f"  seed {seed} {c}: sent {row.sent}, errors {row.errors}, TTFT p50 {row.ttft_p50 * 1000:.0f} ms "
                      f"p99 {row.ttft_p99 * 1000:.0f} ms, engine hit {row.hit:.1%}{hdr} {row.note}", flush=True)
    t0 = time.monotonic()
    text = table(rows)
    print(text)
    if args.burst:
        print("\n" + class_table(rows))
    else:
        out = Path(args.out) / "bench-real.md"
        out.write_text(f"<!-- written by {invocation(argv)} on {datetime.date.today()} -->\n\n{text}\n")
        # each joined decision (hashes and replica names only: what /decisions shows), to study the prediction error
        (Path(args.out) / "bench-real-predictions.json").write_text(json.dumps(
            [{"seed": r.seed, "router": r.contender, **d} for r in rows for d in r.joined]))
        (Path(args.out) / "bench-real-requests.json").write_text(json.dumps(
            [{"seed": r.seed, "router": r.contender, **q} for r in rows for q in r.sent_requests]))
        print(f"\n{out} written ({time.monotonic() - t0:.0f} s of bootstrap)")
    return 0


def pin_replicas(replicas: list[Replica]) -> None:
    """Replica i's processes (API server, engine core, every thread) on core i alone."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < len(replicas):
        raise SystemExit(f"bench-real: --pin needs a core a replica: {len(cores)} cores, {len(replicas)} replicas")
    for core, r in zip(cores, replicas):
        sid = r.proc.popen.pid
        for task in Path("/proc").glob("[0-9]*/task/[0-9]*/stat"):
            try:
                if int(task.read_text().rpartition(")")[2].split()[3]) == sid:
                    os.sched_setaffinity(int(task.parent.name), {core})
            except (OSError, ValueError):  # a thread that ended while read
                continue
    print(f"  pinned: {', '.join(f'{r.name} on core {c}' for c, r in zip(cores, replicas))}", flush=True)


def warm_up(replicas: list[Replica], w: WorkloadConfig, model: str) -> None:
    """A run's worth of the workload (another seed) straight to the engines, round robin, before anything is
    measured; the caches are emptied again by each run. The first run after the engines start was the slowest
    of its seed whichever router had it (engines' own mean TTFT 113-125 ms against 84-119 for the runs after it,
    2026-12-06): on CPU each new batch shape builds its kernels once, and that was charged to the first router."""
    t0 = time.monotonic()
    res = asyncio.run(replay([r.url for r in replicas], w, seed=WARM_UP_SEED, speedup=1.0, model=model,
                             timeout=120.0))
    print(f"  warm-up: {res.sent} requests straight to the engines in {time.monotonic() - t0:.0f} s, not measured",
          flush=True)


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
        ms = lambda k, c=c: f"{c[k] * 1000:.0f}" if k in c else "—"  # noqa: E731
        vs = f"{c['standard_ttft_p99'] / ring.classes['standard_ttft_p99']:.2f}x" \
            if ring is not None and "standard_ttft_p99" in c else ""
        lines.append(f"| {r.seed} | {r.contender} | {ms('standard_ttft_p50')} | {ms('standard_ttft_p99')} | "
                     f"{ms('sheddable_ttft_p99')} | {c.get('goodput', 0.0):.1f} | {r.refused} | {r.errors} | {vs} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
