"""The cost-based policy (SPEC C): each request goes where its estimated time to first token is least.

What each term of the cost is, and why, is in ``cost``'s docstring (where the terms are written once); the evidence
is in docs/routing.md. The minimum cost wins; ties go to the session's pinned replica, the least in-flight work, then
round-robin. Each stage is a constructor switch, so the ablations are compositions (``make_policy("warm_no_guard")``).
"""

from __future__ import annotations

from collections.abc import Callable

from .config import RouterConfig
from .cost import Aggregates, Booking, Estimate, decode_penalty, guard, interference, lora_cost, queue_wait, recent
from .decision import Decision, FleetView, PinEvent, Reservation
from .disaggregation import PrefillPlan, TransferRate, eligible, plan
from .load import LoadSample, effective_rates
from .names import Hold, Reason
from .pins import SESSION, Pin, PinTable
from .policy_base import Policy
from .prefix_index import PrefixIndex
from .profile import RequestProfile
from .replica import Replica
from .room import TIE_S, away_from_returning, fit_rule, price_kv, restorable, restore_share, saturated
from .shortlist import SHORTLIST_FROM, Priced, Shortlist  # noqa: F401 (SHORTLIST_FROM: read from here)
from .warm_replica import WarmReplica, overhead_at, peer_scale
from .warm_states import OVERHEAD_HALF_LIFE_S, WarmStates  # noqa: F401 (OVERHEAD_HALF_LIFE_S: read from here)
from .working_set import Active, WorkingSet

_INF = float("inf")
_LONG_ANSWER_TOKENS = 8192  # another brain's request: its decode priced as at most this long an answer (x4 slack)
_REMOTE_SLACK = 4.0  # another brain's request: its prefill and decode priced at most this many times this brain's
_TIE_SHARE = 0.02  # cost differences below 2% are ties, as are those below a decode step (room.TIE_S)
_UNCACHED_EWMA = 0.2  # the weight of a request's uncached tokens in its replica's typical request
_LORA_SENT = 64  # adapters remembered per replica: far more than any replica's slots
PROMISE_SLACK_S = 2.0  # a block sent to an exact engine counts as held until its predicted prefill + this (llm-d: 2 s)


class WarmPolicy(Policy):
    transfer: TransferRate
    needs_blocks = True
    decides_at_headers = True
    parse_max_bytes = 256 * 1024  # larger bodies: headers, size and the raw block chain suffice (C2)

    def __init__(self, cfg: RouterConfig, name: str = "warm", *, index: bool = True, guard: bool = True,
                 decode: bool = True, kv_risk: bool = True, externality: bool = True, interference: bool = True):
        self.name = name
        self.use_index = index
        self.use_guard = guard
        self.use_decode = decode
        self.use_kv_risk = kv_risk
        self.use_externality = externality
        self.use_interference = interference
        self.session_pins = PinTable(SESSION, _INF)
        self.states = WarmStates(cfg, cfg.profile.block_chars / cfg.profile.chars_per_token)
        self.sessions = WorkingSet()  # where each active session's context lives (C3)
        # prefill/decode disaggregation: KV tokens a second between replicas, learned from decode legs
        self.transfer = TransferRate(cfg.disaggregation.transfer_tokens_per_s)
        self._rr = 0  # round-robin pointer for ties
        self._per = 1  # engines per replica in the last round-robin
        self.shortlist = Shortlist()
        self.observers: list[Callable[[Priced], None]] = []  # each select's pricing is shown to these
        self.cfg = cfg
        self.update_config(cfg)

    # ---------------------------------------------------------------- plumbing

    def update_config(self, cfg: RouterConfig) -> None:
        if cfg.warm.active_session_s != self.cfg.warm.active_session_s:
            # the operator's new word on how long sessions pause holds until the fleet shows its gaps again
            self.sessions.forget_gaps()
        self.cfg = self.states.cfg = cfg
        self.shortlist.stale()
        if not self.transfer.samples:
            self.transfer.value = cfg.disaggregation.transfer_tokens_per_s  # a new prior, while nothing is learned
        self.tokens_per_block = self.states.tokens_per_block = cfg.profile.block_chars / cfg.profile.chars_per_token
        self.session_pins.ttl_s = cfg.pins.session_ttl_s
        self.session_pins.max_pins = cfg.pins.max_pins

    def configure(self, r: Replica) -> None:
        r.count_wlc = True
        self.states.of(r)
        self.shortlist.stale()

    def state_of(self, r: Replica) -> WarmReplica:
        return self.states.of(r)

    def engine_state(self, name: str, engine: int | None) -> WarmReplica | None:
        return self.states.engine(name, engine)

    def caches_reset(self, name: str, now: float) -> None:
        """The replica's engines emptied their prefix caches at the operator's word (vLLM's /reset_prefix_cache)."""
        self.states.caches_reset(name, now)
        self.session_pins.contexts_gone(name)  # C4: a session's context is no longer there

    def engine_count(self, name: str) -> int:
        """How many data-parallel engines the replica exports (1: it exports one, or says nothing)."""
        return self.states.count(name)

    def engines_view(self, name: str) -> list[dict] | None:
        """Each data-parallel engine as the policy sees it (for /state), or None for a replica of one engine."""
        return self.states.view(name)

    def forget(self, name: str) -> None:
        self.states.forget(name)
        self.shortlist.stale()

    def replica_view(self, r: Replica, now: float) -> dict[str, float]:
        """What the policy believes of one replica, for metrics (keys: brain.metrics.WARM_VIEW); a replica with
        data-parallel engines: their sums (the longest predicted wait)."""
        self.sessions.expire(now, self.cfg.warm.active_session_s)  # quiet sessions left the working set, asked or not
        return self.states.replica_view(r, now)

    def pin_tables(self) -> tuple[PinTable, ...]:
        return (self.session_pins,)

    def expire(self, now: float) -> None:
        self.session_pins.expire(now)

    def on_load(self, r: Replica, s: LoadSample, now: float) -> None:
        if self.states.on_load(r, s, now):
            self.shortlist.stale()

    def on_health(self, r: Replica, ejected: bool) -> None:
        if ejected:
            self.states.ejected(r)

    def on_release(self, res: Reservation, now: float) -> None:
        """Everything the request added to its replica's predictions goes, however it ended: a request that ends
        before its predicted prefill did (a 413, a reset, a cancel, a prediction too long) no longer queues ahead
        of anyone, so its remaining prefill seconds and its pending KV are taken back."""
        st = self.states.engine(res.replica.name, res.engine)
        if st is None:
            return
        self.shortlist.released(st, res.work_s)
        st.work_s = max(0.0, st.work_s - res.work_s)
        if isinstance(res.booking, Booking):
            st.take_back(res.booking.prefill_end, res.booking.arrived_at, res.prefill_s, res.pending_tokens,
                         res.provisional, now)
            res.booking.queued = None  # in the queue of first tokens to come, if still there: it will not be counted
            self.sessions.ended(res.booking.session, now)  # its session is quiet from now

    # ------------------------------------------------------------------ choice

    @property
    def rr_replica(self) -> int:
        """The replica index round-robin ties go to next."""
        return self._rr // self._per

    def _pool(self, fleet: FleetView) -> list[Replica]:
        live, probing = fleet.pool()
        if not live:
            return probing  # B: no LIVE replica: the PROBING ones are the pool, no cap
        cap = self.cfg.probing_max_in_flight
        return live + [p for p in probing if p.in_flight_requests < cap]  # A2: PROBING gets limited traffic

    def estimate(self, r: Replica, st: WarmReplica, rate: float, dec: float, profile: RequestProfile,
                 pin: Pin | None, now: float, engine: int | None = None, peer_scale: float = 1.0) -> Estimate:
        """Cached tokens, wait and prefill on one candidate (C2, C3, C4), in the engine's tokens."""
        ex, hashes, w = st.exact, profile.engine_hashes, self.cfg.warm
        restored, medium = 0, None
        if ex is not None and ex.exact and hashes is not None and hashes[0] == ex.block_size and profile.engine_tokens:
            prompt = profile.engine_tokens  # the engine's own tokens and its own word on what it holds
            cached = min(prompt - 1, st.exact_cached(hashes[1], now)) if self.use_index else 0
            prefix = hashes[1][cached // ex.block_size - 1] if cached >= ex.block_size else None
            if ex.tiers and self.use_index:
                restored, medium = restorable(ex, hashes[1], cached, prompt, w)
        else:
            # tokenized as the engine does: this text's own scale, else the replica's learned one
            scale = profile.engine_tokens / profile.tokens if profile.engine_tokens and profile.tokens else \
                st.scale.value if st.scale.learned else peer_scale
            prompt = profile.engine_tokens or max(1, round(profile.tokens * scale))
            chain = profile.blocks if self.use_index and st.prefix_caching else ()
            matched = st.index.match(chain) if chain else 0
            cached = min(prompt - 1, int(matched * self.tokens_per_block * scale)) if matched else 0
            prefix = chain[matched - 1] if matched else None
            if pin is not None and (not chain or pin.unindexed) and pin.replica is r and pin.engine == engine \
                    and st.prefix_caching and st.holds_session(pin):
                cached = max(cached, min(prompt - 1, int(pin.tokens * scale)))  # C4: the session's context lives here
        if prompt > st.cache_tokens * (1 if profile.engine_tokens else 2):
            # refused by the engine before any prefill (vLLM starts only with max_model_len within its KV cache): more
            # tokens than the cache holds by the engine's count, twice that by a size's estimate (a text may run to
            # more bytes per token). It queues nothing and holds no KV; priced as a prefill, eight 32 MiB bodies the
            # engines answered 400 at once held every new session behind them (429, deadline_unmeetable)
            prompt, cached, prefix, restored = 0, 0, None, 0
        if st.engine_block and cached:  # vLLM hits whole blocks only, and never the prompt's last token
            cached -= cached % st.engine_block
        e = Estimate(r, st, rate, dec, cached, queue_wait(st, r, rate, now), (prompt - cached) / rate, engine=engine,
                     prompt=prompt, prefix=prefix if cached else None, restored=restored, medium=medium)
        if restored:
            # C3: a restore is priced at what this replica's restores took (its connector's load seconds over the
            # tokens loaded), until measured at a share of computing them; never above computing them
            e.prefill -= restored * (1.0 - restore_share(e, w, self.use_index)) / rate
        if profile.adapter is not None:
            loads, lora_wait = lora_cost(self.states.of(r), profile.adapter, dec, now, w)
            e.lora, e.lora_wait = loads + lora_wait, lora_wait
            if loads:
                # the engine loads the adapter before the step that needs it: every request running or queued
                # there waits for it too (the brain's own count: fresher than a scrape)
                e.stall = w.lora_load_s * r.in_flight_requests
        return e

    def select(self, fleet: FleetView, profile: RequestProfile, now: float, hold: Hold = Hold.NEVER) -> Decision | None:
        pin = self.session_pins.get(profile.session_key, now) if profile.session_key is not None else None
        view = self.shortlist.view_of(fleet, now, self)
        if view is None:
            pool = self._pool(fleet)
            if not pool:
                return None
            cands = self.states.candidates(pool)
            states = [st for _, st, _ in cands]
            out_tokens = sum(st.rates.output_tokens for st in states) / len(states)
            prefill_rate, decode_s = effective_rates([st.rates for st in states], now, self.cfg.warm.rate_fresh_s,
                                                     [st.running(r) for r, st, _ in cands])
            rows = list(zip(cands, prefill_rate, decode_s))
            agg = Aggregates(out_tokens, min(decode_s), peer_scale(states))
        else:
            rows, agg = self.shortlist.rows(view, profile, pin, self), view.aggregates
        self.sessions.expire(now, self.cfg.warm.active_session_s)
        mine = self.sessions.of(profile.session_key) if profile.session_key is not None else None
        ests, kept, tied = self.price_rows(rows, agg, profile, pin, mine, now)
        best = away_from_returning(self.tie_winner(tied, pin, len(fleet.replicas_view)), pin, kept, hold)
        if profile.header_path and not self._stays(best, pin, now):  # nothing booked: its body decides
            return Decision(None, Reason.READ_BODY, predicted_ttft_s=best.ttft)
        for observe in self.observers:
            observe(Priced(fleet, profile, pin, mine, view, agg, ests, best, now))
        if hold is not Hold.NEVER and saturated(best, profile, pin, ests, self.cfg.warm, hold):
            # what drains the router's queue: every candidate's prefill rate (of the shortlist's, in a big fleet: a
            # wait overestimated there refuses a little early, never late); when its best replica has room
            return Decision(None, Reason.HELD, predicted_ttft_s=best.ttft,
                            drain_tps=sum(rate / st.scale.value for (_, st, _), rate, _ in rows),
                            free_at=now + best.wait + best.lora)
        per = max((e.engine or 0) for e in tied) + 1
        self._rr, self._per = best.replica.index * per + (best.engine or 0) + 1, per
        d = self._decide(best, profile, pin, max(1, profile.tokens), now)
        d.booking = Booking(best.prefill, best.prompt, best)
        return d

    @staticmethod
    def _stays(best: Estimate, pin: Pin | None, now: float) -> bool:
        """A turn priced at its headers stays on its home: the cost model chose the home, which holds its context
        (what the session's pin says; on an exact engine, only while the engine still holds the last block the
        session's last priced turn ended with)."""
        if pin is None or best.replica is not pin.replica or best.engine != pin.engine or not best.cached:
            return False
        ex, tail = best.st.exact, pin.tail
        if ex is not None and ex.exact and tail is not None and tail[0] == ex.block_size:
            return ex.holds(tail[1]) or best.st.promised.get(tail[1], 0.0) > now
        return True

    def tie_winner(self, tied: list[Estimate], pin: Pin | None, n_replicas: int) -> Estimate:
        """Costs within a decode step (or 2%) of the least are a tie, below what the estimates can tell apart:
        then the session's own replica (where anything of it may still be), the least in-flight work, and
        round-robin, so that an idle fleet does not send every new conversation to its first replica.
        Round-robin over engines, not only replicas: a data-parallel replica's engines take turns too (its engine 0
        would win every tie once finished requests leave nothing predicted on either)."""
        per = max((e.engine or 0) for e in tied) + 1
        home, home_engine = (pin.replica, pin.engine) if pin is not None else (None, None)
        slots, rr = n_replicas * per, self._rr
        return min(tied, key=lambda e: (e.replica is not home or e.engine != home_engine, round(e.st.work_s, 3),
                                        (e.replica.index * per + (e.engine or 0) - rr) % slots))

    def price_rows(self, rows, agg: Aggregates, profile: RequestProfile, pin: Pin | None, mine: Active | None,
                   now: float) -> tuple[list[Estimate], list[Estimate], list[Estimate]]:
        """Every row's estimate, those C5's guard lets in, and those tied for the least cost after guard and fit."""
        w = self.cfg.warm
        out_tokens, fastest_decode = agg.out_tokens, agg.fastest_decode
        # a replica that has not yet said how its engine counts tokens (new, or no traffic yet) counts as its peers
        # do: priced at 1 beside peers that learned 0.6, it would look dearer than it is and never get the traffic
        # that teaches it
        ests = [self.estimate(r, st, rate, dec, profile, pin, now, k, agg.peer_scale)
                for (r, st, k), rate, dec in rows]
        level = self.states.overhead_level
        for e in ests:
            own = self.states.overhead_of(e.replica, now, e.prompt)
            e.ttft = e.wait + e.lora + e.prefill + own
            if self.use_kv_risk:
                price_kv(e, out_tokens, mine, profile.session_key is not None, now, w, self.sessions, self.use_index)
            # a replica's own overhead predicts its first token; the choice prices its peers' level: fitted on 64
            # requests, the differences between like replicas are noise, and followed they drew new sessions to
            # whichever fitted lowest (docs/routing.md, "Predictions")
            e.cost += e.ttft + e.stall - own + overhead_at(level, e.prompt)
            if self.use_decode:
                e.cost += decode_penalty(w.decode_weight, out_tokens, e.dec, fastest_decode)
            e.work = e.lora + e.prefill + out_tokens * e.dec
        busy = agg.busy if agg.busy is not None else min(1.0, sum(e.wait for e in ests) / len(ests) / w.busy_wait_s)
        if self.use_interference:
            # vLLM schedules running prefills before admitting new requests: whatever arrives at r during this
            # request's prefill P waits for the rest of it, P/2 on average, at r's arrival rate: lambda x P^2 / 2
            # of others' waiting. That holds on an idle replica; with queues everywhere the externality term
            # below prices the extra work instead
            idle = 1.0 - busy
            since = now - w.arrival_window_s
            for e in ests:
                e.cost += interference(idle, recent(e.st.arrivals, since), w.arrival_window_s, e.prefill)
        if self.use_externality:
            # the re-prefill is work the fleet does instead of serving someone: counted once always, and once more
            # as the fleet fills up (with queues everywhere it delays everybody behind it)
            load = 1.0 + busy
            least = min(e.prefill for e in ests)
            for e in ests:
                e.cost += load * (e.prefill - least)
        if self.use_guard:
            if agg.total_work is None:
                total, n = sum(e.st.work_s for e in ests), len(ests)
                # a replica's data-parallel engines are candidates of their own, but its requests count once
                in_flight = sum(r.in_flight_requests for r in {id(e.replica): e.replica for e in ests}.values())
            else:
                total, in_flight, n = self.shortlist.totals(agg)
            candidates = kept = guard(ests, out_tokens, fastest_decode, total, in_flight, n, w)
        else:
            candidates = kept = ests
        if self.use_interference and self.use_kv_risk:
            candidates = fit_rule(candidates, pin)
        # a tie: what the estimates cannot tell apart (a decode step, 2%, a rate measured on a few requests' noise)
        best = min(candidates, key=lambda e: e.cost)
        bound = best.cost + max(TIE_S, _TIE_SHARE * best.cost) + best.noise_s
        return ests, kept, [e for e in candidates if e.cost - e.noise_s <= bound]

    def _decide(self, best: Estimate, profile: RequestProfile, pin: Pin | None, prompt: int, now: float) -> Decision:
        """C4: the session pin records where the session's context now lives."""
        events: list[PinEvent] = []
        reason, pin_kind = Reason.LOAD, None
        if profile.session_key is not None:
            reason, pin_kind, events = self.session_pins.follow(profile.session_key, pin, best.replica, best.engine,
                                                                prompt, profile.tail, profile.header_path, now)
        return Decision(best.replica, reason, pin_kind, events, predicted_ttft_s=best.ttft, cached_tokens=best.cached,
                        prompt_tokens=best.prompt, prefix=best.prefix, restored_tokens=best.restored,
                        restored_from=best.medium, work_s=best.work, engine=best.engine,
                        steer=best.engine is not None and self.cfg.warm.steer_data_parallel)

    # ------------------------------------------------------------------ books

    def _book(self, st: WarmReplica, res: Reservation | None, start: float, prefill_s: float, prompt: int,
              work_s: float, estimated: int | None, requests: int = 1) -> Booking:
        """A request on ``st`` (ours, its prefill leg, one whose body arrived, another brain's): its prefill queued,
        its KV pending, its work in flight; its reservation says what to take back when it ends."""
        st.book(start, prefill_s, prompt, work_s, estimated)
        self.shortlist.booked(work_s, requests)
        b = res.booking if res is not None and isinstance(res.booking, Booking) else Booking(prefill_s, prompt)
        b.prefill_end, b.queued = st.prefill_busy_until, (prefill_s, prompt)
        st.queue(b)
        if res is not None:
            res.work_s, res.prefill_s, res.pending_tokens, res.booking = work_s, prefill_s, prompt, b
        return b

    def on_reserved(self, d: Decision, profile: RequestProfile, now: float) -> None:
        assert d.replica is not None  # the fleet books what was placed
        st = self.states.engine(d.replica.name, d.engine) or self.states.of(d.replica)
        b = d.booking if isinstance(d.booking, Booking) else Booking()
        b.estimate = None  # what disaggregation weighed: not kept for the request's life
        res = d.reservation
        if res is not None:
            res.overhead_s = self.states.overhead_of(d.replica, now, b.prompt)  # what the model's part excludes
            res.engine = d.engine
        if profile.deferred and res is not None:
            # its body is still on its way: no engine has it, so nothing queues or holds KV for it until it arrives
            # (uploads held open past the picker's byte limit would hold every new session behind them)
            self.shortlist.booked(0.0)
            b.deferred, res.booking = (b.prefill_s, b.prompt, d.work_s), b
            return
        if res is not None:
            res.booking = b
        b = self._book(st, res, now, b.prefill_s, b.prompt, d.work_s, None if profile.provisional else profile.tokens)
        if not profile.provisional:  # a size declared in a header says nothing of this replica's typical request
            st.uncached_ewma += _UNCACHED_EWMA * (max(1, b.prompt - d.cached_tokens - d.restored_tokens)
                                                  - st.uncached_ewma)
        if self.use_interference:
            a = st.arrivals
            a.append(now)
            while a[0] < now - self.cfg.warm.arrival_window_s:  # bounded by the window
                a.popleft()
            b.arrived_at = now
        if (ex := st.exact) is not None and ex.exact and (h := profile.engine_hashes) and h[0] == ex.block_size:
            st.promise(h[1], st.prefill_busy_until + PROMISE_SLACK_S, now)
        if self.use_index and st.prefix_caching and (profile.blocks or profile.header_path):
            pin = self.session_pins.peek(profile.session_key) if profile.session_key is not None else None
            st.routed(pin if pin is not None and pin.replica is d.replica and pin.engine == d.engine else None,
                      profile.blocks, b.prompt)
            if self.outbox is not None and profile.blocks:
                self.outbox.indexed(d.replica.name, d.engine, profile.blocks, len(profile.blocks))
        if profile.adapter is not None:
            sent = self.states.of(d.replica).lora_sent
            sent[profile.adapter] = now
            sent.move_to_end(profile.adapter)
            while len(sent) > _LORA_SENT:
                sent.popitem(last=False)
        if profile.session_key is not None and not profile.provisional:
            b.session = self.sessions.place(profile.session_key, st, b.prompt, now, d.prefix, d.cached_tokens,
                                            under_way=res is not None)

    def returning_share(self) -> float | None:
        return self.sessions.return_share

    def on_arrived(self, res: Reservation, now: float) -> None:
        b = res.booking
        if not isinstance(b, Booking) or b.deferred is None:
            return
        (prefill_s, prompt, work_s), b.deferred = b.deferred, None
        st = self.states.engine(res.replica.name, res.engine) or self.states.of(res.replica)
        self._book(st, res, now, prefill_s, prompt, work_s, None, requests=0)  # counted in flight when decided

    def on_remote_reserved(self, res: Reservation, prefill_s: float, prompt_tokens: int, session_key: bytes | None,
                           prompt: int, at: float, now: float, estimated: int | None = None,
                           shared: tuple[int, int] | None = None) -> None:
        """Another brain's request on a replica (shared state), booked as ``on_reserved`` books ours: one brain
        taking all the traffic would see it queue there, hold its KV and keep its session's context active. Its
        prefill started queueing when it was decided (``at``), not when the news arrived."""
        st = self.states.engine(res.replica.name, res.engine) or self.states.of(res.replica)
        # what one request can be here, by this brain's own view of the replica (one event per replica with an hour
        # of work would refuse every new session): its prefill at a quarter of the learned rate, and its decode a
        # long answer's at a quarter of the learned speed
        rates = st.rates
        prompt_tokens = min(prompt_tokens, st.cache_tokens)
        prefill_s = min(prefill_s, _REMOTE_SLACK * prompt_tokens / max(rates.prefill_tokens_per_s, 1.0) + 1.0)
        work_s = min(res.work_s, prefill_s + _REMOTE_SLACK * _LONG_ANSWER_TOKENS * rates.decode_s_per_token + 1.0)
        b = self._book(st, res, at, prefill_s, prompt_tokens, work_s, estimated)
        if self.use_interference:
            st.arrivals.append(now)
            b.arrived_at = now
        if session_key is not None:
            self.sessions.expire(now, self.cfg.warm.active_session_s)
            prefix, cached = shared or (None, 0)
            b.session = self.sessions.place(session_key, st, prompt, now, prefix, cached, under_way=True)

    # ------------------------------------------------------------------ disaggregation

    def plan_prefill(self, d: Decision, prefills: list[Replica], profile: RequestProfile,
                     now: float) -> PrefillPlan | None:
        """P/D (``disaggregation``'s docstring): the leg's plan when a remote prefill beats the local one, else None."""
        best = d.booking.estimate if isinstance(d.booking, Booking) else None
        if best is None or best.replica is not d.replica or not eligible(profile, best.prompt, self.cfg.disaggregation):
            return None
        states = [self.states.of(r) for r in prefills]
        rates, decs = effective_rates([st.rates for st in states], now, self.cfg.warm.rate_fresh_s,
                                      [st.running(r) for r, st in zip(prefills, states)], [best.st.rates])
        # the same model's tokenizer: a prefill replica that has not learned its tokens' scale counts as the decode one
        scale = best.prompt / profile.tokens if profile.tokens else 1.0
        own = self.states.overhead_of  # a leg is a request there: its replica's own first-token overhead too
        leg = min((self.estimate(r, st, rate, dec, profile, None, now, peer_scale=scale)
                   for r, st, rate, dec in zip(prefills, states, rates, decs)),
                  key=lambda e: e.wait + e.prefill + own(e.replica, now, e.prompt))
        # the streams its prefill would stall: those decoding there, and those that join meanwhile (half of it each,
        # on average: the interference term's reasoning)
        r, window = best.replica, self.cfg.warm.arrival_window_s
        decoding = max(best.st.running(r), r.in_flight_requests - 1) + \
            recent(best.st.arrivals, now - window) / window * best.prefill / 2
        return plan(best, leg, self.transfer.value, decoding, TIE_S, own(leg.replica, now, leg.prompt))

    def on_prefill_reserved(self, d: Decision, profile: RequestProfile, now: float) -> None:
        """The prefill leg's books on its replica (its queue, its cache); its decode replica computes no prompt."""
        plan = d.prefill
        assert plan is not None and d.reservation is not None  # the fleet books the leg it planned and reserved
        st = self.states.of(plan.replica)
        self._book(st, d.prefill_reservation, now, plan.prefill_s, plan.prompt, plan.prefill_s, profile.tokens)
        if self.use_index and profile.blocks and st.prefix_caching:
            st.index.insert(profile.blocks)
        b = d.booking
        if isinstance(b, Booking) and b.estimate is not None:
            b.prefill_s = b.estimate.dec  # the decode replica loads the prompt: one step of its own
        d.reservation.transfer_tokens = plan.transfer_tokens

    def on_transfer(self, tokens: int, seconds: float) -> None:
        """A decode leg's first token came ``seconds`` after it was sent: what its transfer took, near enough."""
        self.transfer.observe(tokens, seconds)

    # ------------------------------------------------------------------ what others read

    def expected_output(self, r: Replica) -> float:
        return self.states.of(r).rates.output_tokens

    def on_prefill_ended(self, res: Reservation, now: float) -> None:
        """A first token before its predicted prefill end (a cache hit not foreseen, a rate read slow): the rest of its
        prefill and its pending KV leave the replica's queue now, not at the request's end, long after."""
        st, b = self.states.engine(res.replica.name, res.engine), res.booking
        if st is not None and isinstance(b, Booking):
            st.prefill_ended(b, now)

    def on_first_token(self, res: Reservation, observed_s: float, now: float) -> None:
        self.states.first_token(res, observed_s, now)

    def kv_tokens(self, r: Replica, engine: int | None) -> int | None:
        st = (self.states.engine(r.name, engine) if engine is not None else None) or self.states.of(r)
        return st.cache_tokens

    def index_of(self, r: Replica, engine: int | None) -> PrefixIndex | None:
        """The prefix index of a replica (or one of its data-parallel engines), for another brain's chains."""
        if not self.use_index:
            return None
        st = self.states.engine(r.name, engine) if engine is not None else self.states.of(r)
        return st.index if st is not None and st.prefix_caching else None


# warm_no_index: session pins only (what a cost model knows without a prefix index); warm_no_interference: the
# default before the interference term and the fit rule (docs/routing.md)
WARM_VARIANTS = {"warm": {}, "warm_no_externality": {"externality": False}, "warm_no_guard": {"guard": False},
                 "warm_no_index": {"index": False}, "warm_no_decode": {"decode": False},
                 "warm_no_kv_risk": {"kv_risk": False}, "warm_no_interference": {"interference": False}}

__all__ = ["WarmPolicy", "WarmReplica", "WARM_VARIANTS"]
