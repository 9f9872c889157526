"""``make bench-fleet``: one fleet of several models and LoRA adapters, warmroute against the peers a fleet owner
could put in front of it instead, each set up as shipped.

The fleet: model ``coder`` on 6 replicas that also serve 8 LoRA adapters (vLLM ``--max-loras 2``; an adapter
brought into a slot costs ``--lora-load-s`` of engine time), model ``chat`` on 2. The workload is the bench's
(``harness.bench_workload``); each session (and one-shot) asks for one model for its whole life: a quarter
``chat``, the rest ``coder``, 60% of those through an adapter drawn with Zipf popularity.

What the peers know, from their sources: Envoy's load balancers and the SGLang / vLLM routers read no body, so
they cannot tell models apart; a fleet owner puts a body-based router in front (the Gateway API Inference
Extension's BBR sets ``X-Gateway-Model-Name`` from the body; an HTTPRoute sends each base model to its own
pool), which this bench does with a ``x-pool`` header the client sets and one Envoy cluster per model. None of
them prices adapters (llm-d's ``lora-affinity-scorer`` does: it cannot run here, see docs/benchmarks.md).
warmroute gets one brain over all 8 replicas and reads the model from the body.

Counted per contender: TTFT p50/p99 (workload time, after the warm-up), errors, adapter loads (the mocks' own
count), and requests that reached a replica not serving their model (the mocks' 404s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass

from bench.contenders import ENVOY_POLICIES, RUNS
from bench.harness import (
    bench_workload,
    envoy_builtin,
    envoy_proc,
    free_port,
    pace_check,
    scaled_warmroute_config,
    wait_answering,
    workload_arguments,
)
from extproc.tools.stack.local import Proc, Stack, http_get, wait_for
from extproc.tools.workload.http_replay import replay
from extproc.tools.workload.measure import window_numbers

MODELS = {"coder": 6, "chat": 2}
ADAPTERS = [f"coder-lora-{i}" for i in range(8)]
MAX_LORAS, LORA_LOAD_S = 2, 1.0
CONTENDERS = RUNS["fleet"]
# an ablation, not a peer: warmroute with adapter loads left unpriced (what the LoRA term buys)
ABLATIONS = ["warmroute_no_lora_price"]


def model_of(sid: int, seed: int) -> tuple[str, str]:
    """(the model a session asks for, its base model's pool), fixed per session."""
    rng = random.Random(sid * 7919 + seed)
    if rng.random() < 0.25:
        return "chat", "chat"
    if rng.random() < 0.6:
        weights = [1 / (k + 1) for k in range(len(ADAPTERS))]  # Zipf, s = 1
        return rng.choices(ADAPTERS, weights)[0], "coder"
    return "coder", "coder"


def replica_args() -> dict[str, list[str]]:
    out, i = {}, 0
    for model, n in MODELS.items():
        for _ in range(n):
            extra = ["--model", model]
            if model == "coder":
                extra += ["--lora-adapters", ",".join(ADAPTERS), "--max-loras", str(MAX_LORAS),
                          "--lora-load-s", str(LORA_LOAD_S)]
            out[f"r{i}"] = extra
            i += 1
    return out


def pooled_envoy(policy: str, pools: dict[str, list[int]], listen: int, speedup: float, hbf: int | None) -> dict:
    """The Envoy a fleet owner writes behind a body-based router: one cluster per model, chosen by header."""
    doc = envoy_builtin(policy, [], listen, speedup, hbf)
    template = doc["static_resources"]["clusters"][0]
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    vhost = hcm["route_config"]["virtual_hosts"][0]
    route = vhost["routes"][0]["route"]
    clusters, routes = [], []
    for pool, ports in pools.items():
        c = json.loads(json.dumps(template))
        c["name"] = c["load_assignment"]["cluster_name"] = f"pool_{pool}"
        c["load_assignment"]["endpoints"] = [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}} for p in ports]}]
        clusters.append(c)
        routes.append({"match": {"prefix": "/", "headers": [{"name": "x-pool", "string_match": {"exact": pool}}]},
                       "route": {**route, "cluster": f"pool_{pool}"}})
    doc["static_resources"]["clusters"] = clusters
    vhost["routes"] = routes
    return doc


@dataclass
class Result:
    contender: str
    ttft_p50: float = 0.0
    ttft_p99: float = 0.0
    hits: float = 0.0
    sent: int = 0
    errors: int = 0
    lost: int = 0
    lora_loads: float = 0.0
    wrong_model: float = 0.0
    not_engine_p50: float = float("nan")  # the median part of a TTFT that was not the engine's own (workload s)
    note: str = ""
    adapters_asked: int = 0  # distinct adapters the workload asked for: no router loads fewer (simulated runs)
    pace: str = ""  # why a live run measured the machine, not the replicas (harness.pace_check)


def _mock_totals(urls: list[str]) -> tuple[float, float]:
    """(adapter loads, requests refused for their model) over the mocks."""
    loads = refused = 0.0
    for u in urls:
        for line in http_get(u + "/metrics", timeout=5).decode().splitlines():
            if line.startswith("mock:engine_truth{") and 'quantity="lora_loads"' in line:
                loads += float(line.rsplit(" ", 1)[1])
            elif line.startswith("mock:model_not_found_total"):
                refused += float(line.rsplit(" ", 1)[1])
    return loads, refused


def run(contender: str, args) -> Result:
    sp = args.speedup
    w = bench_workload(args.minutes, args.sessions_per_min, args.oneshots_per_min, args.projects)
    extra = replica_args()
    procs: list[Proc] = []
    if contender.startswith("warmroute"):
        config = scaled_warmroute_config(sp)
        config["warm"]["lora_load_s"] = LORA_LOAD_S / sp if contender == "warmroute" else 1e-9
        s = Stack(len(extra), config=config, mock_args=["--speedup", str(sp)])
        s.replica_args = extra
        s.start()
        s.wait_all_live(90)
        wait_for(lambda: all(r.get("models") for r in s.state()["replicas"]), 30, "every replica's models read")
        url = s.url
    else:
        s = Stack(0, mock_args=["--speedup", str(sp)])
        s.replicas = [s.start_replica(name, extra=["--speedup", str(sp), *a]) for name, a in extra.items()]
        pools: dict[str, list[int]] = {}
        for r in s.replicas:
            pools.setdefault(extra[r.name][1], []).append(r.port)
        port = free_port()
        policy, hbf = ENVOY_POLICIES[contender]
        procs.append(envoy_proc(pooled_envoy(policy, pools, port, sp, hbf), s.dir))
        url = f"http://127.0.0.1:{port}"
        wait_answering(url, "chat", contender, procs[0], 60, headers={"x-pool": "chat"})
    urls = [r.url for r in s.replicas]
    try:
        l0, w0 = _mock_totals(urls)
        res = asyncio.run(replay(url, w, seed=args.seed, speedup=sp, timeout=max(60.0, args.minutes * 60 / sp),
                                 model=lambda req: model_of(req.sid, args.seed)[0],
                                 extra_headers=lambda req: {"x-pool": model_of(req.sid, args.seed)[1]}))
        l1, w1 = _mock_totals(urls)
    finally:
        for p in procs:
            p.stop()
        s.stop()
    nums = window_numbers(res.requests, args.minutes, args.warmup_min, scale=sp)
    not_engine = nums.get("overhead_p50", float("nan"))
    return Result(contender, nums["ttft_p50"], nums["ttft_p99"], nums["hits"], res.sent, sum(res.errors.values()),
                  res.lost, l1 - l0, w1 - w0, not_engine,
                  pace=pace_check(nums["ttft_p50"], res.client_lag_p99, not_engine, sp) or "")


SIM_CONTENDERS = RUNS["fleet.simulated"]


def simulate(contender: str, args) -> Result:
    """The same fleet and workload in the simulator (workload time, no HTTP): every peer of sim/policies.py, each in
    one pool per model as a body-based router would set it up; llm-d with its lora-affinity scorer too. With
    ``--seeds A-B``: the requests of every seed pooled (percentiles of a few hundred requests move by tens of per
    cent from seed to seed), loads and the adapters asked for summed."""
    requests, loads, asked = [], 0, 0
    for seed in args.seed_list:
        reqs, n = _simulate_seed(contender, args, seed)
        requests += reqs
        loads += n
        asked += len({r.adapter for r in reqs if r.adapter is not None})
    nums = window_numbers(requests, args.minutes, args.warmup_min)
    errors = sum(1 for r in requests if r.error is not None)
    return Result(contender, nums["ttft_p50"], nums["ttft_p99"], nums["hits"], len(requests), errors, 0, loads, 0,
                  adapters_asked=asked)


def _simulate_seed(contender: str, args, seed: int) -> tuple[list, int]:
    import dataclasses

    from extproc.core import RouterConfig, WarmConfig
    from extproc.tools.engine.model import EngineConfig
    from extproc.tools.sim.simulator import Simulation

    pools = tuple(p for p, n in MODELS.items() for _ in range(n))

    def assign(req):
        model, pool = model_of(req.sid, seed)
        return pool, (model if model in ADAPTERS else None)

    cfg = dataclasses.replace(RouterConfig(), warm=WarmConfig(lora_load_s=LORA_LOAD_S))
    sim = Simulation(contender, len(pools), bench_workload(args.minutes, args.sessions_per_min, args.oneshots_per_min,
                                                           args.projects),
                     seed=seed, engine=EngineConfig(max_loras=MAX_LORAS, lora_load_s=LORA_LOAD_S),
                     router_cfg=cfg, pools=pools, assign=assign)
    res = sim.run()
    return res.requests, res.lora_loads


def report(results: list[Result], args, wall: float) -> str:
    how = "simulated" if args.simulated else f"live at {args.speedup:g}x"
    seeds = f"seed {args.seed}" if len(args.seed_list) == 1 else \
        f"seeds {args.seed_list[0]}-{args.seed_list[-1]}, their requests pooled"
    out = [f"Fleet: coder on {MODELS['coder']} replicas with {len(ADAPTERS)} LoRA adapters (max_loras {MAX_LORAS}, "
           f"{LORA_LOAD_S:g} s a load), chat on {MODELS['chat']}; {args.minutes:g} workload minutes, {how}, "
           f"{seeds}; wall {wall:.0f} s.", "",
           "| contender | TTFT p50 s | TTFT p99 s | not-engine p50 s | prefix hit | adapter loads | "
           "to a replica without the model | sent | errors | lost |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        out.append(r.note and f"| {r.contender} | {r.note} ||||||||| " or
                   f"| {r.contender} | {r.ttft_p50:.3f} | {r.ttft_p99:.1f} | {r.not_engine_p50:.3f} | {r.hits:.1%} | "
                   f"{r.lora_loads:.0f} | "
                   f"{r.wrong_model:.0f} | {r.sent} | {r.errors} | {r.lost} |")
    flagged = [r for r in results if r.pace]
    if flagged:
        out += ["", "Measured the machine, not the replicas (rerun at a lower --speedup): "
                + "; ".join(f"{r.contender}: {r.pace}" for r in flagged)]
    asked = max((r.adapters_asked for r in results), default=0)
    if asked:
        out += ["", f"The workload asked for {asked} distinct adapters (summed over seeds): no router loads fewer."]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contenders", nargs="+", default=None, choices=[*CONTENDERS, *ABLATIONS, *SIM_CONTENDERS])
    ap.add_argument("--simulated", action="store_true",
                    help="the simulator instead of live mocks (every modelled peer)")
    workload_arguments(ap, minutes=5.0)
    ap.add_argument("--seeds", default=None, help="with --simulated: a range like 1-10, every seed's requests pooled")
    args = ap.parse_args(argv)
    args.seed_list = [args.seed]
    if args.seeds:
        lo, _, hi = args.seeds.partition("-")
        if not (lo.isdigit() and (hi or lo).isdigit()) or not args.simulated:
            ap.error("--seeds: expected a range like 1-10, with --simulated")
        args.seed_list = list(range(int(lo), int(hi or lo) + 1))
        args.seed = args.seed_list[0]
    args.contenders = args.contenders or (SIM_CONTENDERS if args.simulated else CONTENDERS)
    t0 = time.monotonic()
    results = []
    for c in args.contenders:
        t = time.monotonic()
        try:
            r = simulate(c, args) if args.simulated else run(c, args)
        except Exception as e:  # a contender that cannot start is a row that says why
            r = Result(c, note=f"did not run: {e}"[:160])
        results.append(r)
        print(f"{c:<30} {time.monotonic() - t:5.1f}s  {r}", flush=True, file=sys.stderr)
    print(report(results, args, time.monotonic() - t0))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
