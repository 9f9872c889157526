"""``warmroute sim``: N engine models, a routing policy, a workload and faults, in virtual time.

Scrapes happen every 3 s of virtual time, so between scrapes the router
sees stale load exactly as in production. The same seed gives the same
result. Requests sent to a dead replica fail at once (connection refused)
and are retried once on another replica, as Envoy's retry policy does;
requests running on a replica when it dies are lost to the client.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from dataclasses import dataclass, field

from extproc.core import LoadSample, RouterConfig, UpstreamOutcome, imbalance_index, upstream_failed, upstream_verdicts
from extproc.tools.engine.model import DECODE_HORIZON_S, Engine, EngineConfig, EngineRequest
from extproc.tools.sim.brains import make as make_policy
from extproc.tools.sim.policy_base import HOLD, REFUSED, RETRY_AFTER_S, Policy
from extproc.tools.workload.generate import Request, Workload, WorkloadConfig
from extproc.tools.workload.measure import pct, per_class

FLOW_TICK_S = 0.05  # while requests are held, the router looks again this often (besides at every release)

@dataclass(frozen=True, slots=True)
class Fault:
    """Replica ``replica`` is down from ``start`` for ``duration`` s; with ``every`` > 0 it repeats (a flap)."""

    replica: int
    start: float
    duration: float
    every: float = 0.0
    until: float = float("inf")


@dataclass
class SimResult:
    policy: str
    requests: list[Request]
    minutes: float
    n: int
    share_per_minute: list[list[int]]  # [minute][replica] dispatches
    routable_per_minute: list[list[int]]
    prefix_queries: int
    prefix_hits: int
    preemptions: int
    output_tokens: int
    transitions: list = field(default_factory=list)
    to_ejected: int = 0  # requests the policy sent to a replica its own health machine had EJECTED
    pins_on_non_live: int = 0
    fastest: EngineConfig = field(default_factory=EngineConfig)  # the fastest replica's engine (for the floor)
    lora_loads: int = 0  # LoRA adapters brought into a GPU slot, over every engine
    restored: int = 0  # prompt tokens restored from an offloaded tier (hits past the GPU's), over every engine

    def summary(self, warmup_min: float = 2.0) -> dict:
        ok = [r for r in self.requests if r.error is None and r.ttft is not None and r.arrival >= warmup_min * 60]
        # a request with no first token when the run ends (held, refused and sent again, queued at an engine) waited
        # at least until then: counted so, or a router that refuses its slowest requests again and again would have
        # its tail left out (four replicas 1,1,0.5,0.5 at load 1.5: 25 of a seed's requests, p99 130 s -> 177)
        end = self.minutes * 60
        waiting = [end - r.arrival for r in self.requests
                   if r.error is None and r.ttft is None and r.arrival >= warmup_min * 60]
        ttft = [r.ttft for r in ok] + waiting
        e2e = [r.e2e for r in ok if r.e2e is not None]
        # inter-token latency: each request's mean gap between its output tokens after the first
        itl = [(r.e2e - r.ttft) / (r.max_tokens - 1) for r in ok if r.e2e is not None and r.max_tokens > 1]
        floor = ttft_floor(self.requests, self.fastest)
        idx, idx_floor = [], []
        per_session: list[Counter] = [Counter() for _ in self.share_per_minute]
        for r in self.requests:
            per_session[min(int(r.arrival // 60), len(per_session) - 1)][r.sid] += 1
        for m, (row, routable) in enumerate(zip(self.share_per_minute, self.routable_per_minute)):
            if m < warmup_min or not sum(row):
                continue
            idx.append(imbalance_index({str(i): c for i, c in enumerate(row)}, [str(i) for i in routable]))
            # a policy that keeps a session on one replica within the minute puts its busiest session's turns on
            # one replica: the index cannot go below that session's share times the routable replicas
            busiest, total = max(per_session[m].values(), default=0), sum(per_session[m].values())
            idx_floor.append(max(1.0, busiest * len(routable) / total) if total else 1.0)
        tot = [sum(row[i] for row in self.share_per_minute) for i in range(self.n)]
        return {
            "policy": self.policy,
            "requests": len(self.requests),
            "errors": sum(1 for r in self.requests if r.error),
            "ttft_p50": pct(ttft, 0.5),
            "ttft_p90": pct(ttft, 0.9),
            "ttft_p99": pct(ttft, 0.99),
            "ttft_floor_p50": pct([floor[r.rid] for r in ok], 0.5),
            "ttft_floor_p99": pct([floor[r.rid] for r in ok], 0.99),
            "e2e_p50": pct(e2e, 0.5),
            "e2e_p99": pct(e2e, 0.99),
            "itl_p50": pct(itl, 0.5),
            "itl_p99": pct(itl, 0.99),
            "disaggregated": sum(1 for r in ok if "prefill_replica" in r.extra),
            "output_tok_s": self.output_tokens / (self.minutes * 60),
            "prefix_hit_rate": self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0,
            # hits by tier: the GPU's above, what an offloaded CPU tier restored here
            "restore_hit_rate": self.restored / self.prefix_queries if self.prefix_queries else 0.0,
            "imbalance_mean": sum(idx) / len(idx) if idx else 1.0,
            "imbalance_max": max(idx) if idx else 1.0,
            "imbalance_floor_mean": sum(idx_floor) / len(idx_floor) if idx_floor else 1.0,
            "imbalance_floor_max": max(idx_floor) if idx_floor else 1.0,
            "max_share": max(tot) / sum(tot) if sum(tot) else 0.0,
            "preemptions": self.preemptions,
            "to_ejected": self.to_ejected,
            "refused": sum(r.extra.get("refused", 0) for r in self.requests),
            "unfinished": len(waiting),
        } | per_class(self.requests, warmup_min * 60, self.minutes * 60) | self._prediction_error(ok)

    def _prediction_error(self, ok: list[Request]) -> dict:
        pairs = [(p, max(r.ttft - held, 1e-3)) for r in ok if "predicted_ttft" in r.extra
                 for p, held in (r.extra["predicted_ttft"],)]
        if not pairs:
            return {}
        # as the brain reports them per replica (extproc/brain/outcomes.py), over the whole run
        return {"ttft_pred_err_p50": pct([abs(p - o) for p, o in pairs], 0.5),
                "ttft_pred_mape": sum(abs(p - o) / o for p, o in pairs) / len(pairs),
                "ttft_pred_bias": sum(p for p, _ in pairs) / sum(o for _, o in pairs) - 1.0}


def ttft_floor(requests: list[Request], engine: EngineConfig) -> dict[int, float]:
    """Each request's time to first token alone on an idle replica holding the most it could hold: its session's
    previous prompt (answers are not cached blocks), else its project's system prompt. No router beats it; the
    percentiles of these floors say how far any router's percentiles can come down on this workload."""
    previous: dict[int, int] = {}
    out = {}
    for r in sorted(requests, key=lambda x: x.arrival):
        best = r.system_tokens if r.oneshot else previous.get(r.sid, r.system_tokens)
        uncached = max(1, r.prompt_tokens - min(best, r.prompt_tokens - 1))
        steps = -(-uncached // engine.max_num_batched_tokens)
        out[r.rid] = steps * (engine.step_base_s + engine.step_per_seq_s) + uncached * engine.prefill_s_per_token
        previous[r.sid] = r.prompt_tokens
    return out


class Simulation:
    def __init__(
        self,
        policy: str | Policy = "warmroute",
        replicas: int = 4,
        workload: WorkloadConfig | None = None,
        seed: int = 1,
        faults: tuple[Fault, ...] = (),
        engine: EngineConfig | None = None,
        router_cfg: RouterConfig | None = None,
        scrape_interval_s: float | None = None,
        bursts: tuple[tuple[float, int], ...] = (),
        replica_speeds: tuple[float, ...] | None = None,
        trace: tuple[Request, ...] = (),
        pools: tuple[str, ...] | None = None,
        assign=None,
        prefill_replicas: int = 0,
        transfer_tokens_per_s: float = 100_000.0,
    ):
        self.n = replicas
        # several models: replica i serves model pools[i]; assign(request) -> (its pool, its LoRA adapter or None)
        self.pools, self.assign = pools, assign
        self.wcfg = workload or WorkloadConfig()
        self.seed = seed
        self.policy = policy if isinstance(policy, Policy) else make_policy(policy, replicas, seed, router_cfg)
        base = engine or EngineConfig()
        self.speeds = tuple(replica_speeds) if replica_speeds else (1.0,) * replicas
        if len(self.speeds) != replicas:
            raise ValueError(f"{len(self.speeds)} replica speeds for {replicas} replicas")
        self.engine_cfgs = [base.scaled(sp) if sp != 1.0 else base for sp in self.speeds]
        self.engines = [Engine(c) for c in self.engine_cfgs]
        self.policy.attach(self)
        self.alive = [True] * replicas
        self.faults = faults
        # the brain's scrape cadence, unless a test asks for another
        self.scrape_interval = scrape_interval_s or (router_cfg or RouterConfig()).health.scrape_interval_s
        self.bursts = bursts  # (t, k): k one-shot requests arrive at the same instant t
        self.trace = trace  # fixed requests at their own arrival times, beside the workload (engine comparisons)
        self.workload = Workload(self.wcfg, seed)
        self._events: list = []
        self._seq = itertools.count()
        self._stepping = [False] * replicas
        self._step_gen = [0] * replicas  # a step_end of an older generation (cut, or the replica died) is void
        self._inflight: list[dict[int, tuple[Request, EngineRequest]]] = [dict() for _ in range(replicas)]
        self.requests: list[Request] = []
        minutes = int(self.wcfg.minutes) + 1
        self.share = [[0] * replicas for _ in range(minutes)]
        self.routable = [list(range(replicas)) for _ in range(minutes)]
        self.to_ejected = 0
        self.pins_on_non_live = 0
        # prefix queries, hits, preemptions, restored of engines replaced on revive
        self._retired_counters = [0, 0, 0, 0]
        self._retired_lora_loads = 0
        self._flow_ticking = False  # a "flow" event is due (requests held by flow control)
        # prefill/decode disaggregation: replicas 0..k-1 of role prefill (a policy that is ``aggregated`` sees every
        # replica as a whole one: the same replicas without disaggregation), KV moved at transfer_tokens_per_s
        k = 0 if self.policy.aggregated else prefill_replicas
        self.prefill_set = frozenset(range(k))
        self.transfer_tokens_per_s = transfer_tokens_per_s
        self._legs: list[dict[int, tuple[Request, int]]] = [dict() for _ in range(replicas)]  # prefill legs running
        if self.prefill_set:
            self.policy.roles(self.prefill_set)

    def _sample(self, i: int) -> LoadSample:
        """What a scrape of replica i's /metrics shows: vLLM's gauges and counters, its KV size."""
        e = self.engines[i]
        lora = {}
        if e.cfg.max_loras:  # vllm:lora_requests_info
            lora = {"lora_running": frozenset(e.lora_running), "lora_waiting": frozenset(e.lora_waiting),
                    "max_lora": e.cfg.max_loras}
        if e.cfg.cpu_tier_tokens:
            # an offloading connector's restores (vllm:kv_offload_load_time), and the tokens computed apart from them
            # (prompt_tokens_by_source{local_compute}): prefix_cache_hits counts the GPU's hits only, so without it a
            # restore would read as computed and the prefill rate 1.4x too fast
            lora |= {"restored_tokens": e.restored_tokens_total, "restore_seconds": e.restore_seconds_total,
                     "computed_tokens": e.true_prefill_tokens}
        return LoadSample(e.num_running, e.num_waiting, e.kv_usage, e.prompt_tokens_total, e.prefix_hits,
                          e.prefill_seconds_total, e.generation_tokens_total, e.decode_seconds_total, e.finished,
                          e.cfg.kv_tokens, prompt_requests=e.prompt_requests_total,
                          first_tokens=e.prompt_requests_total, **lora)

    def _at(self, t: float, kind: str, *args) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, args))

    # ---------------------------------------------------------------- dispatch

    def _dispatch(self, req: Request, now: float, exclude: frozenset[int] = frozenset()) -> None:
        barred = exclude | self.prefill_set  # a prefill replica takes prefill legs only
        if self.pools is not None:
            if req.pool is None:
                req.pool, req.adapter = self.assign(req)
            # each model's own pool (what a body-based router in front of the peers, or warmroute's catalog, does)
            barred = exclude | frozenset(k for k, p in enumerate(self.pools) if p != req.pool)
        i = self.policy.retry_target(req, now, barred) if exclude else self.policy.choose(req, now, barred)
        if i == HOLD:
            self._holding(now)
            return  # flow control holds it: it comes back from take_ready
        self._send(req, i, now, exclude)

    def _holding(self, now: float) -> None:
        """A request is held: look again every FLOW_TICK_S while any is (releases and scrapes look too)."""
        if not self._flow_ticking:
            self._flow_ticking = True
            self._at(now + FLOW_TICK_S, "flow")

    def _let_go(self, now: float) -> None:
        for req, i in self.policy.take_ready(now):
            self._send(req, i, now, frozenset())

    def _send(self, req: Request, i: int | None, now: float, exclude: frozenset[int]) -> None:
        if i == REFUSED:  # 429 + Retry-After: the client sends it again then (its latency counts from the first)
            req.extra["refused"] = req.extra.get("refused", 0) + 1
            self._at(now + RETRY_AFTER_S, "retry", req)
            return
        if i is None:
            req.error = "no_healthy_instances"
            self._finish_session_turn(req, now)
            return
        req.replica = i
        self.policy.start(req, i, now)
        if self.policy.ejected(i) and req.extra.get("reason") != "fallback":
            self.to_ejected += 1
        m = min(int(now // 60), len(self.share) - 1)
        self.share[m][i] += 1
        if not self.alive[i]:
            # connection refused: Envoy retries once on another replica
            self.policy.done(req, now)
            self._outcome(i, None, UpstreamOutcome(connect_failure=True), now)
            if req.retries == 0:
                req.retries = 1
                req.replica = None
                self._dispatch(req, now, exclude | {i})
            else:
                req.error = "connect_failure"
                self._finish_session_turn(req, now)
            return
        p = self.policy.prefill_for(req, i, now, [k for k in self.prefill_set if self.alive[k]]) \
            if self.prefill_set else None
        if p is not None:  # the prefill leg first (one token, no stream); the decode leg when it has ended
            leg = EngineRequest(-req.rid - 1, req.blocks(), req.prompt_tokens, 1, now, lora=req.adapter)
            self._legs[p][leg.rid] = (req, i)
            req.extra["prefill_replica"] = p
            self._submit(p, leg, now)
            return
        self._decode(req, i, now)

    def _decode(self, req: Request, i: int, now: float, external: int = 0) -> None:
        """The request on its replica; ``external``: prompt tokens whose KV a prefill leg computed and it loads."""
        if not self.alive[i]:  # it died while the prefill leg ran: Envoy retries the decode leg elsewhere, once
            self.policy.done(req, now)
            self._outcome(i, None, UpstreamOutcome(connect_failure=True), now)
            j = self.policy.retry_target(req, now, frozenset({i}) | self.prefill_set) if req.retries == 0 else None
            if j is None or j < 0:
                req.error = "connect_failure"
                self._finish_session_turn(req, now)
                return
            req.retries, req.replica = 1, j
            self.policy.start(req, j, now)
            i = j
        er = EngineRequest(req.rid, req.blocks(), req.prompt_tokens, req.max_tokens, now, lora=req.adapter,
                           external=external)
        eng = self.engines[i]
        # what the engine was doing when it got the request (waiting, running, KV usage): beside each prediction
        req.extra["engine_at_send"] = (eng.num_waiting, eng.num_running, eng.kv_usage)
        self._inflight[i][req.rid] = (req, er)
        self._submit(i, er, now)

    def _submit(self, i: int, er: EngineRequest, now: float) -> None:
        self.engines[i].add(er)
        if not self._stepping[i]:
            self._step(i, now)
        else:
            end = self.engines[i].cut_run(now)
            if end is not None:
                self._step_gen[i] += 1
                self._at(end, "step_end", i, [], [], self._step_gen[i])

    def _leg_done(self, p: int, req: Request, i: int, now: float, ok: bool) -> None:
        """A prefill leg ended on ``p``: its KV moves to ``i`` (what i's cache lacks, at the transfer rate), then the
        decode leg starts there; a failed leg (its replica died) leaves ``i`` to compute the prompt."""
        self.policy.prefill_done(req, now)
        if not ok:
            req.extra["prefill_failed"] = True
            self._decode(req, i, now)
            return
        have = self.engines[i].hit_tokens(req.blocks(), req.prompt_tokens)
        moved = max(0, req.prompt_tokens - have)
        self._at(now + moved / self.transfer_tokens_per_s, "decode_leg", req, i, req.prompt_tokens)

    def _step(self, i: int, now: float) -> None:
        eng = self.engines[i]
        if not eng.busy or not self.alive[i]:
            self._stepping[i] = False
            return
        dur, first, done = eng.step(now, DECODE_HORIZON_S)
        if dur <= 0:
            self._stepping[i] = False
            return
        self._stepping[i] = True
        self._step_gen[i] += 1
        self._at(now + dur, "step_end", i, first, done, self._step_gen[i])

    def _step_end(self, i: int, now: float, first, done, gen: int) -> None:
        if not self.alive[i] or gen != self._step_gen[i]:
            return  # the replica died mid-step (its requests were already failed), or the step was cut
        for er in first:
            item = self._inflight[i].get(er.rid)
            if item:
                item[0].ttft = now - item[0].arrival
                self.policy.first_token(item[0], now)
                known = self.policy.first_token_known_at(item[0], now)
                if known is not None:
                    self._at(known, "first_token_known", item[0])
        for er in done:
            leg = self._legs[i].pop(er.rid, None)
            if leg is not None:
                self._leg_done(i, leg[0], leg[1], now, True)
                continue
            item = self._inflight[i].pop(er.rid, None)
            if not item:
                continue
            req = item[0]
            req.e2e = now - req.arrival
            req.cached_tokens = er.cached_tokens
            self.policy.done(req, now)
            self._outcome(i, i, UpstreamOutcome(code=200, via_upstream=True), now)
            self._finish_session_turn(req, now)
        self._step(i, now)
        if done and self.policy.holds():
            self._let_go(now)

    def _outcome(self, chosen: int, served_by: int | None, o: UpstreamOutcome, now: float) -> None:
        """Passive health from a request's end, by the same rule the brain applies to Envoy's access log."""
        for i, ok in upstream_verdicts(chosen, served_by, 1, upstream_failed(o)):
            self.policy.on_upstream(i, ok, now)

    def _finish_session_turn(self, req: Request, now: float) -> None:
        s = req.session
        if s is None:
            return
        think = self.workload.after_answer(s, req)
        self._at(now + think, "turn", s)

    # ------------------------------------------------------------------ faults

    def _kill(self, i: int, now: float) -> None:
        if not self.alive[i]:
            return
        self.alive[i] = False
        self._stepping[i] = False
        self._step_gen[i] += 1
        self.engines[i].abort_all()
        for req, _er in list(self._inflight[i].values()):
            req.error = "replica_died"
            self.policy.done(req, now)
            self._outcome(i, i, UpstreamOutcome(remote_reset=True), now)
            self._finish_session_turn(req, now)
        self._inflight[i].clear()
        legs, self._legs[i] = self._legs[i], {}
        for req, d in legs.values():
            self._leg_done(i, req, d, now, False)

    def _revive(self, i: int, now: float) -> None:
        self.alive[i] = True
        old = self.engines[i]
        self._retired_counters[0] += old.prefix_queries
        self._retired_counters[1] += old.prefix_hits
        self._retired_counters[2] += old.preemptions
        self._retired_counters[3] += old.restored_tokens_total
        self._retired_lora_loads += old.lora_loads
        self.engines[i] = Engine(old.cfg)  # a restarted vLLM has a cold cache (and counters from 0)

    # --------------------------------------------------------------------- run

    def run(self) -> SimResult:
        end = self.wcfg.minutes * 60
        for t, kind in self.workload.arrivals():
            x = self.workload.start(kind, t)
            self._at(t, "oneshot" if isinstance(x, Request) else "start_session", x)
        t = 0.0
        while t < end:
            self._at(t, "scrape")
            t += self.scrape_interval
        if self.policy.load_refresh_s:
            t = self.policy.load_refresh_s
            while t < end:
                self._at(t, "load")
                t += self.policy.load_refresh_s
        for r in self.trace:
            self._at(r.arrival, "oneshot", r)
        for bt, k in self.bursts:
            for _ in range(k):
                self._at(bt, "oneshot")
        for f in self.faults:
            t = f.start
            while t < min(end, f.until):
                self._at(t, "kill", f.replica)
                self._at(t + f.duration, "revive", f.replica)
                if f.every <= 0:
                    break
                t += f.every
        while self._events:
            now, _, kind, args = heapq.heappop(self._events)
            if now > end:
                break
            if kind == "step_end":
                self._step_end(args[0], now, args[1], args[2], args[3])
            elif kind == "turn" or kind == "start_session":
                req = self.workload.next_turn(args[0], now)
                if req is not None:
                    self.requests.append(req)
                    self._dispatch(req, now)
            elif kind == "oneshot":
                req = args[0] if args else self.workload.oneshot(now)
                self.requests.append(req)
                self._dispatch(req, now)
            elif kind == "scrape":
                self.policy.tick(now)
                if self.policy.holds():
                    self._let_go(now)
                m = min(int(now // 60), len(self.share) - 1)
                self.routable[m] = [k for k in range(self.n) if self.alive[k] and self.policy.routable(k)]
                for i in range(self.n):
                    if self.alive[i]:
                        self.policy.on_scrape(i, True, now, self._sample(i))
                    else:
                        self.policy.on_scrape(i, False, now)
            elif kind == "load":
                for i in range(self.n):
                    if self.alive[i]:
                        self.policy.on_load(i, self._sample(i), now)
                if self.policy.holds():  # a load refresh can end saturation (late binding at that moment)
                    self._let_go(now)
            elif kind == "retry":
                self._dispatch(args[0], now)
            elif kind == "flow":
                self._let_go(now)
                self._flow_ticking = False
                if self.policy.holds():
                    self._holding(now)
            elif kind == "first_token_known":
                self.policy.first_token_known(args[0], now)
            elif kind == "decode_leg":
                self._decode(args[0], args[1], now, args[2])
            elif kind == "kill":
                self._kill(args[0], now)
            elif kind == "revive":
                self._revive(args[0], now)
        transitions = self.policy.health_transitions()
        return SimResult(
            policy=self.policy.name,
            requests=self.requests,
            minutes=self.wcfg.minutes,
            n=self.n,
            share_per_minute=self.share,
            routable_per_minute=self.routable,
            prefix_queries=self._retired_counters[0] + sum(e.prefix_queries for e in self.engines),
            prefix_hits=self._retired_counters[1] + sum(e.prefix_hits for e in self.engines),
            preemptions=self._retired_counters[2] + sum(e.preemptions for e in self.engines),
            lora_loads=self._retired_lora_loads + sum(e.lora_loads for e in self.engines),
            restored=self._retired_counters[3] + sum(e.restored_tokens_total for e in self.engines),
            output_tokens=sum(r.max_tokens for r in self.requests if r.e2e is not None and r.error is None),
            transitions=transitions,
            to_ejected=self.to_ejected,
            pins_on_non_live=self.policy.pins_on_non_live,
            fastest=min(self.engine_cfgs, key=lambda c: c.prefill_s_per_token),
        )
