"""The cost-based policy (SPEC C): each request goes where its estimated time to first token is least.

Every quantity is in seconds of engine time (C1). Per candidate replica r:

    ttft(r) = wait(r) + prefill(prompt_tokens - cached_tokens(r), r)  [+ what KV pressure adds]
    cost(r) = ttft(r) + decode(r) + eviction(r) + idle x interference(r) + load x extra_work(r) + overload(r)
    (idle in [0, 1], load in [1, 2])

- ``cached_tokens``: the request's block chain matched against what was routed to r (C2, the prefix
  index); a session pin stands in when the request has no chain (C4); on an engine whose KV events verify
  (exact mode), what that engine holds of the prompt's blocks, in its own tokens;
- ``wait``: prefill work ahead on r: this router's requests still in their predicted prefill, or the
  scraped queue (fresh every 0.5 s, C6) if that says more, since it also holds other routers' work;
- ``prefill``: uncached tokens over r's prefill rate, learned from r's own counters (C3);
- KV pressure (C3): if the request does not fit beside what runs and what is queued ahead, it waits for
  KV to free and its cached blocks are likely evicted meanwhile: its ttft counts them as uncached;
- ``decode``: the decode slow-down the request would feel on r against the fastest candidate;
- ``eviction``: a session will be back with this context; the fuller r's working set of active
  sessions, the likelier LRU evicts it before then, priced as the expected re-prefill (Preble);
- ``interference``: vLLM runs a prefill to its end before it admits what arrives behind it, so a prefill of P
  seconds makes the requests arriving at r meanwhile wait P/2 on average: arrival rate x P^2 / 2 of others'
  waiting. Weighted by how idle the fleet is (with queues everywhere ``extra_work`` prices it instead);
- ``extra_work``: prefill beyond what the best-cached candidate would need: work the fleet does instead
  of serving someone. It counts once (``load`` 1), and up to twice as the candidates' queues grow
  (``load`` 2), since then it delays everybody behind it: a move must save more than it costs the fleet;
- ``overload`` (C5): in-flight work above Envoy's bounded-load share (balance_factor x the mean,
  rounded up to whole requests) counts as waiting; beyond ``hard_bound_factor`` x that share a
  replica takes nothing, so crystallization cannot happen;
- fit (C3): a replica where the request does not fit beside the active sessions' contexts is left out, unless
  it fits on none: the replicas few requests arrive at are the ones long sessions live on, and two of those
  contexts in one cache evict each other on every turn.
- LoRA: a request for an adapter adds the adapter's load where it is not in a slot (``_lora_s``), and the same
  load once more for each request running or queued there: the engine loads it before the step that needs it,
  so the whole batch waits for it;
- data parallelism: a replica that exports several engines is priced engine by engine (``_candidates``), each
  with its own queue, KV usage and prefix index; the answer names the engine (X-data-parallel-rank).

The minimum cost wins; ties go to the session's pinned replica, the least in-flight work, then round-robin. Each stage is a constructor switch, so the
ablations are compositions (``make_policy("warm_no_guard")``).
"""

from __future__ import annotations

import itertools

from .config import RouterConfig
from .cost import Aggregates, Estimate, decode_penalty, fair_share, interference, recent
from .decision import Decision, FleetView, PinEvent
from .disaggregation import DISAGGREGATED_APIS, LEG_BODIES, PrefillPlan, TransferRate, worth_it
from .load import LoadSample, effective_rates
from .names import Cause, PinAction, Reason
from .pins import SESSION, Pin, PinTable
from .policy_base import Policy
from .prefix_index import Holders
from .profile import RequestProfile
from .replica import LIVE, Replica
from .shortlist import SHORTLIST_FROM, Shortlist, View  # noqa: F401 (SHORTLIST_FROM: read from here)
from .warm_replica import WarmReplica, overhead_at, peer_scale, replica_view
from .working_set import WorkingSet

_INF = float("inf")
_LONG_ANSWER_TOKENS = 8192  # another brain's request: its decode priced as at most this long an answer (x4 slack)
_TIE_S, _TIE_SHARE = 0.01, 0.02  # cost differences below a decode step or 2% are ties
# a replica's own first-token overhead counts half as much after this long without a sample (its peers' the rest)
OVERHEAD_HALF_LIFE_S = 120.0
PROMISE_SLACK_S = 2.0  # a block sent to an exact engine counts as held until its predicted prefill + this (llm-d: 2 s)


class WarmPolicy(Shortlist, Policy):
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
        self._state: dict[str, WarmReplica] = {}
        # replicas that export several data-parallel engines: one state per engine, in rank order
        self._engines: dict[str, list[WarmReplica]] = {}
        self.sessions = WorkingSet()  # where each active session's context lives (C3)
        self._chosen_prefill_s = 0.0  # select -> on_reserved, within one synchronous call
        self._chosen_prompt = 1
        self._chosen: Estimate | None = None
        # prefill/decode disaggregation: KV tokens a second between replicas, learned from decode legs
        self.transfer = TransferRate(cfg.disaggregation.transfer_tokens_per_s)
        self._rr = 0  # round-robin pointer for ties
        self._per = 1  # engines per replica in the last round-robin
        # who holds which sampled block, for big fleets' shortlists: kept from the first look at a fleet that big
        # (a small fleet does not pay for it: a megabyte's first turn adds ~17K blocks)
        self.holders: Holders | None = None
        self.shortlist = True  # False: every candidate priced whatever the fleet's size (the reference)
        self._view: View | None = None
        self._eased: set[int] = set()  # id() of the states released since the view was taken
        self._work_delta = 0.0  # work and requests booked or released since the view was taken
        self._flight_delta = 0
        # a list: each shortlisted decision appends (shortlist's choice, full pricing's, whether the shortlist's is
        # among full pricing's ties, how many seconds dearer than the least it is there) under the same fleet
        # view; tests compare the two
        self.verify: list | None = None
        # set by the router for one select (flow control on, the request not critical): a request that every
        # candidate is saturated for is not placed but held (Reason.HELD), nothing booked. hold_on_wait: a wait
        # longer than the request's own prefill saturates too (flow_control.hold_on_wait), not only KV
        self.may_hold = False
        self.hold_on_wait = False
        self.held_drain_tps = 0.0  # the prompt tokens per second the candidates prefilled at the last hold
        self.held_free_at = 0.0
        self._overhead_level = (0.0, 0.0)  # the measured replicas' median first-token overhead line
        self.outbox = None  # shared state: the router's Outbox while sharing is on (core.shared)
        self.trace: list | None = None  # a list: each candidate's (name, cost, ttft, cached, wait, work) is appended
        self.update_config(cfg)

    # ---------------------------------------------------------------- plumbing

    def update_config(self, cfg: RouterConfig) -> None:
        old = getattr(self, "cfg", None)  # None: from __init__
        if old is not None and cfg.warm.active_session_s != old.warm.active_session_s:
            # the operator's new word on how long sessions pause holds until the fleet shows its gaps again
            self.sessions.forget_gaps()
        self.cfg = cfg
        self._view = None
        if self.transfer is not None and not self.transfer.samples:
            self.transfer.value = cfg.disaggregation.transfer_tokens_per_s  # a new prior, while nothing is learned
        self.tokens_per_block = cfg.profile.block_chars / cfg.profile.chars_per_token
        self.session_pins.ttl_s = cfg.pins.session_ttl_s
        self.session_pins.max_pins = cfg.pins.max_pins

    def configure(self, r: Replica) -> None:
        r.count_wlc = True
        self.state_of(r)
        self._view = None

    def state_of(self, r: Replica) -> WarmReplica:
        st = self._state.get(r.name)
        if st is None:
            st = self._state[r.name] = WarmReplica(self.cfg, self.tokens_per_block, holders=self.holders)
        return st

    def engine_state(self, name: str, engine: int | None) -> WarmReplica | None:
        if engine is not None:
            subs = self._engines.get(name)
            if subs is not None and engine < len(subs):
                return subs[engine]
        return self._state.get(name)

    def caches_reset(self, name: str, now: float) -> None:
        """The replica's engines emptied their prefix caches at the operator's word (vLLM's /reset_prefix_cache)."""
        for st in filter(None, (self._state.get(name), *self._engines.get(name, ()))):
            st.cache_reset(now)
        self.session_pins.contexts_gone(name)  # C4: a session's context is no longer there

    def engine_count(self, name: str) -> int:
        """How many data-parallel engines the replica exports (1: it exports one, or says nothing)."""
        return len(self._engines.get(name) or ()) or 1

    def engines_view(self, name: str) -> list[dict] | None:
        """Each data-parallel engine as the policy sees it (for /state), or None for a replica of one engine."""
        subs = self._engines.get(name)
        if not subs:
            return None
        return [s.engine_view(k) for k, s in enumerate(subs)]

    def forget(self, name: str) -> None:
        for st in (self._state.pop(name, None), *self._engines.pop(name, ())):
            if st is not None:
                st.index.close()
        self._view = None

    def replica_view(self, r: Replica, now: float) -> dict[str, float]:
        """What the policy believes of one replica, for metrics (keys: brain.metrics.WARM_VIEW); a replica with
        data-parallel engines: their sums (the longest predicted wait)."""
        st = self.state_of(r)
        parts = self._engines.get(r.name) or [st]
        for p in parts:
            p.kv_ahead(now, 0.0)  # prefills predicted done by now leave the pending KV
        self.sessions.expire(now, self.cfg.warm.active_session_s)  # sessions quiet for warm.active_session_s left the working set, asked or not
        line = st.overhead.line or self._overhead_level
        return {**replica_view(st, parts, now), "first_token_overhead_seconds": overhead_at(line, 0),
                "first_token_overhead_seconds_per_token": line[1]}

    def pin_tables(self) -> tuple[PinTable, ...]:
        return (self.session_pins,)

    def expire(self, now: float) -> None:
        self.session_pins.expire(now)

    def on_load(self, r: Replica, s: LoadSample, now: float) -> None:
        st = self.state_of(r)
        st.rates.update(s, now)
        st.scale.update(s)
        st.engine_block = s.engine_block
        if s.max_lora is not None:
            st.lora = s
        st.hold_cache(s.cache_tokens, self.tokens_per_block)
        if s.prefix_caching is not None and s.prefix_caching != st.prefix_caching:
            st.prefix_caching = s.prefix_caching
            st.index.clear()
        if not s.engines:
            for sub in self._engines.pop(r.name, ()):
                sub.index.close()
                self._view = None
            return
        subs = self._engines.get(r.name)
        if subs is None or len(subs) != len(s.engines):  # new, or restarted with another engine count
            for sub in subs or ():
                sub.index.close()
            subs = self._engines[r.name] = [WarmReplica(self.cfg, self.tokens_per_block, st.rates, st.scale,
                                                        self.holders) for _ in s.engines]
            self._view = None
        for sub, es in zip(subs, s.engines):
            sub.scraped = es
            sub.prefix_caching = st.prefix_caching
            sub.engine_block = st.engine_block
            sub.hold_cache(es.cache_tokens, self.tokens_per_block)

    def on_health(self, r: Replica, ejected: bool) -> None:
        """An ejected replica may come back restarted, with a cold cache: forget what we thought it held."""
        if ejected:
            for st in (self.state_of(r), *self._engines.get(r.name, ())):
                st.index.clear()
                st.prefill_busy_until = 0.0
                st.pending.clear()
                st.pending_tokens = 0

    def on_release(self, res, now: float) -> None:
        """Everything the request added to its replica's predictions goes, however it ended: a request that ends
        before its predicted prefill did (a 413, a reset, a cancel, a prediction too long) no longer queues ahead
        of anyone, so its remaining prefill seconds and its pending KV are taken back."""
        st = self.engine_state(res.replica.name, res.engine)
        if st is None:
            return
        self._work_delta -= min(st.work_s, res.work_s)
        self._flight_delta -= 1
        self._eased.add(id(st))
        st.work_s = max(0.0, st.work_s - res.work_s)
        remaining = res.prefill_end - now
        if remaining > 0 and res.prefill_s > 0:
            st.prefill_busy_until = max(now, st.prefill_busy_until - min(remaining, res.prefill_s))
            try:
                st.pending.remove((res.prefill_end, res.pending_tokens))
                st.pending_tokens -= res.pending_tokens
            except ValueError:  # already past, or cleared when the replica was ejected
                pass
            # a size declared in a header and gone before its prefill ended (a probe, a 413) never arrived at the
            # engine: nothing will queue behind it. Only those: the search is linear in the arrival window, and an
            # ordinary request that ends early did arrive
            if res.arrived_at is not None and res.provisional:
                try:
                    st.arrivals.remove(res.arrived_at)
                except ValueError:
                    pass

    # ------------------------------------------------------------------ choice

    def _pool(self, fleet: FleetView) -> list[Replica]:
        live, probing = fleet.pool()
        if not live:
            return probing  # B: no LIVE replica: the PROBING ones are the pool, no cap
        cap = self.cfg.probing_max_in_flight
        return live + [p for p in probing if p.in_flight_requests < cap]  # A2: PROBING gets limited traffic

    def _candidates(self, pool: list[Replica]) -> list[tuple[Replica, WarmReplica, int | None]]:
        """(replica, state, engine) to price: each data-parallel engine on its own when the answer can name it;
        else the one the replica's front end will pick (vLLM: the least waiting x 4 + running, from the last
        scrape plus what this brain sent since, as its front end counts its own sends)."""
        out = []
        for r in pool:
            subs = self._engines.get(r.name)
            if not subs:
                out.append((r, self.state_of(r), None))
            elif self.cfg.warm.steer_data_parallel:
                out.extend((r, sub, k) for k, sub in enumerate(subs))
            else:
                k = min(range(len(subs)), key=lambda i: (4 * subs[i].scraped.waiting + subs[i].scraped.running
                                                         + 4 * len(subs[i].pending), i))
                out.append((r, subs[k], k))
        return out

    def _estimate(self, r: Replica, st: WarmReplica, rate: float, dec: float, profile: RequestProfile,
                  pin: Pin | None, now: float, engine: int | None = None, peer_scale: float = 1.0) -> "Estimate":
        """Cached tokens, wait and prefill on one candidate (C2, C3, C4), in the engine's tokens."""
        ex, hashes = st.exact, profile.engine_hashes
        restored, medium = 0, None
        if ex is not None and ex.exact and hashes is not None and hashes[0] == ex.block_size and profile.engine_tokens:
            prompt = profile.engine_tokens  # the engine's own tokens and its own word on what it holds
            cached = min(prompt - 1, st.exact_cached(hashes[1], now)) if self.use_index else 0
            prefix = hashes[1][cached // ex.block_size - 1] if cached >= ex.block_size else None
            if ex.tiers and self.use_index:
                restored, medium = self._restorable(ex, hashes[1], cached, prompt)
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
                    and st.prefix_caching:
                cached = max(cached, min(prompt - 1, int(pin.tokens * scale)))  # C4: the session's context lives here
        if prompt > st.cache_tokens * (1 if profile.engine_tokens else 2):
            # refused by the engine before any prefill (vLLM starts only with max_model_len within its KV cache): more
            # tokens than the cache holds by the engine's count, twice that by a size's estimate (a text may run to
            # more bytes per token). It queues nothing and holds no KV; priced as a prefill, eight 32 MiB bodies the
            # engines answered 400 at once held every new session behind them (429, deadline_unmeetable)
            prompt, cached, prefix, restored = 0, 0, None, 0
        if st.engine_block and cached:  # vLLM hits whole blocks only, and never the prompt's last token
            cached -= cached % st.engine_block
        wait = max(0.0, st.prefill_busy_until - now)
        waiting = st.waiting(r)
        if waiting:
            wait = max(wait, waiting * max(st.uncached_ewma, 1.0) / rate)
        e = Estimate(r, st, rate, dec, cached, wait, (prompt - cached) / rate, engine=engine, prompt=prompt,
                     prefix=prefix if cached else None, restored=restored, medium=medium)
        if restored:
            # C3: a restore is priced at what this replica's restores took (its connector's load seconds over the
            # tokens loaded), until measured at a share of computing them; never above computing them
            e.prefill -= restored * (1.0 - self._restore_share(e)) / rate
        if profile.adapter is not None:
            loads, lora_wait = self._lora_s(self.state_of(r), profile.adapter, dec, now)
            e.lora, e.lora_wait = loads + lora_wait, lora_wait
            if loads:
                # the engine loads the adapter before the step that needs it: every request running or queued
                # there waits for it too (the brain's own count: fresher than a scrape)
                e.stall = self.cfg.warm.lora_load_s * r.in_flight_requests
        return e

    def _restore_share(self, e: "Estimate") -> float:
        """What restoring a token costs on ``e``'s engine against computing it there: 1 where nothing is restored
        (no offloaded tier in warm.offload_tiers by its events, or the policy does not read events)."""
        ex = e.st.exact
        if ex is None or not ex.exact or not ex.tiers or not self.use_index or \
                not any(m in ex.tiers for m in self.cfg.warm.offload_tiers):
            return 1.0
        s_per = e.st.rates.restore_s_per_token
        return min(1.0, s_per * e.rate if s_per is not None else self.cfg.warm.restore_cost_prior)

    def _tier_tokens(self, ex) -> int:
        """Tokens the engine's offloaded tiers in warm.offload_tiers hold by its events: at least what they can hold."""
        return sum(len(ex.tiers.get(m, ())) for m in self.cfg.warm.offload_tiers) * (ex.block_size or 0)

    def _restorable(self, ex, hashes, cached: int, prompt: int) -> tuple[int, str | None]:
        """The prompt's tokens past the GPU's hit that one of ``offload_tiers`` holds in a run on this engine (vLLM's
        connector loads the run that follows the hit), and which tier: the longest."""
        bs = ex.block_size
        best, medium = 0, None
        for m in self.cfg.warm.offload_tiers:
            n = ex.restorable(hashes, cached // bs, m)
            if n > best:
                best, medium = n, m
        return min(best * bs, max(0, prompt - 1 - cached)), medium

    def _lora_s(self, st: WarmReplica, adapter: str, dec: float, now: float) -> tuple[float, float]:
        """What bringing the request's LoRA adapter in costs on a replica (C3): nothing where it runs, waits or
        was sent lately (still in a slot, the slots being least-recently-used); else its load, once more when
        the slots already serve as many adapters with sessions here as there are slots (the one it evicts will
        be loaded again when its session is back), and the wait for a slot where every slot serves a running
        adapter (a typical decode). (loads' seconds, the wait's)."""
        s = st.lora
        if s is None:
            return 0.0, 0.0  # no LoRA metrics: nothing known, nothing priced
        busy = (s.lora_running or frozenset()) | (s.lora_waiting or frozenset())
        cap = max(1, s.max_lora or 1)
        if adapter in busy or adapter in itertools.islice(reversed(st.lora_sent), cap):
            return 0.0, 0.0
        load = self.cfg.warm.lora_load_s
        since = now - self.cfg.warm.active_session_s
        hosted = sum(1 for a, t in st.lora_sent.items() if t >= since and a != adapter)
        return load * (2 if hosted >= cap else 1), (0.0 if len(busy) < cap else st.rates.output_tokens * dec)

    def _kv(self, e: "Estimate", out_tokens: float, mine, session: bool, now: float) -> None:
        """KV pressure now (C3) and the eviction risk of a session's context before its next turn."""
        w = self.cfg.warm
        st, cap, prompt = e.st, e.st.cache_tokens, e.prompt
        home = mine is not None and mine.st is st
        # what the others count already of this context: the prefix it shares with them, counted once
        shared = self.sessions.shares(st, mine.shared[1]) if home and mine.shared is not None else \
            0 if home else self.sessions.shares(st, e.prefix)
        used = st.kv_ahead(now, st.kv_usage(e.replica))
        over = used + prompt + out_tokens - w.kv_pressure * cap
        # an engine with an offloaded tier keeps what its GPU evicts: a context lost there is restored, not computed,
        # while the tier already holds as much as the contexts under way (a small one would lose them too)
        share = self._restore_share(e)
        if share < 1.0 and self._tier_tokens(e.st.exact) < st.active_tokens:
            share = 1.0
        e.room = st.active_tokens - (mine.own if home else 0) + prompt - min(shared, e.cached) + out_tokens \
            <= w.kv_pressure * cap
        if share < 1.0 and not e.room:
            # flow control holds a turn that would evict the active sessions' contexts, lest their next turns compute
            # them again; an offloaded tier gives them back at a restore's price: held only while it does not fit
            # beside what runs (placement still prefers where the contexts fit)
            e.room = over - e.cached <= 0
        others = st.active_whole - (mine.whole if home else 0)
        pressure = (others + prompt + out_tokens) / cap
        e.fits = pressure <= w.kv_pressure
        if session and pressure > w.evict_start:
            risk = min(1.0, (pressure - w.evict_start) / (w.kv_pressure - w.evict_start))
            e.cost += risk * share * prompt / e.rate
        # The risks below are costs of the choice; this turn's time to first token carries only what this turn waits.
        # Counted in the prediction, a 250K-token turn found cached was predicted 50 s and took 0.33 s (the
        # simulator's worst predictions were all of these kinds: its MAPE 0.58, bias +87% at load 1)
        if e.cached and pressure > w.kv_pressure:
            # the active sessions here and this one do not fit together: LRU evicts each before its next turn. What
            # the index holds here now is here for this turn
            e.risk = share * e.cached / e.rate
            e.cost += e.risk
        elif over > 0:
            # it does not fit beside what runs and what is queued: it waits for KV to free, and loses its cache
            lost = share * e.cached / e.rate + min(1.0, over / cap) * out_tokens * e.dec
            # vLLM admits a prefill whose new blocks are free now (its output's come step by step), and its cached
            # blocks may be the very ones the scrape counts as used (taken while its last turn ran): within that it
            # runs at once, and the margin is a risk, not a wait
            if used + prompt - e.cached > cap:
                e.ttft += lost
            else:
                e.risk = lost
                e.cost += lost

    def select(self, fleet: FleetView, profile: RequestProfile, now: float) -> Decision | None:
        self._chosen = None
        pin = self.session_pins.get(profile.session_key, now) if profile.session_key is not None else None
        view = self._view_of(fleet, now) if self.shortlist else None
        if view is None:
            pool = self._pool(fleet)
            if not pool:
                return None
            cands = self._candidates(pool)
            states = [st for _, st, _ in cands]
            out_tokens = sum(st.rates.output_tokens for st in states) / len(states)
            prefill_rate, decode_s = effective_rates([st.rates for st in states], now, self.cfg.warm.rate_fresh_s,
                                                     [st.running(r) for r, st, _ in cands])
            rows = list(zip(cands, prefill_rate, decode_s))
            fleet_view = Aggregates(out_tokens, min(decode_s), peer_scale(states))
        else:
            rows, fleet_view = self._shortlist(view, profile, pin), view.aggregates
        self.sessions.expire(now, self.cfg.warm.active_session_s)
        mine = self.sessions.of(profile.session_key) if profile.session_key is not None else None
        ests, tied = self._price(rows, fleet_view, profile, pin, mine, now)
        per = max((e.engine or 0) for e in tied) + 1
        home = pin.replica if pin is not None else None
        best = self._break_tie(tied, home, pin.engine if pin is not None else None, per, len(fleet.replicas_view))
        if profile.header_path and not self._stays(best, pin, now):  # nothing booked: its body decides
            return Decision(None, Reason.READ_BODY, predicted_ttft_s=best.ttft)
        if view is not None and self.verify is not None:
            every = view.rows[:view.n_live] + [row for row in view.rows[view.n_live:]
                                                 if row[0][0].in_flight_requests < view.cap]
            all_ests, full = self._price(every, fleet_view, profile, pin, mine, now)
            per_full = max((e.engine or 0) for e in full) + 1
            ref = self._break_tie(full, home, pin.engine if pin is not None else None, per_full,
                                  len(fleet.replicas_view))
            mine_full = next(e.cost for e in all_ests if e.st is best.st)
            self.verify.append(((best.replica.name, best.engine), (ref.replica.name, ref.engine),
                                any(e.st is best.st for e in full), mine_full - min(e.cost for e in full)))
        if self.may_hold and self._saturated(best, profile, pin, ests):
            # what drains the router's queue: every candidate's prefill rate (of the shortlist's, in a big fleet: a
            # wait overestimated there refuses a little early, never late)
            self.held_drain_tps = sum(rate / st.scale.value for (_, st, _), rate, _ in rows)
            self.held_free_at = now + best.wait + best.lora  # when its best replica was predicted to have room
            return Decision(None, Reason.HELD, predicted_ttft_s=best.ttft)
        self._rr, self._per = best.replica.index * per + (best.engine or 0) + 1, per
        if self.trace is not None:
            self.trace.extend((e.replica.name, round(e.cost, 3), round(e.ttft, 3), e.cached, round(e.wait, 3),
                               round(e.st.work_s, 2)) for e in ests)
        self._chosen_prefill_s, self._chosen_prompt, self._chosen = best.prefill, best.prompt, best
        return self._decide(best, profile, pin, max(1, profile.tokens), now)

    @staticmethod
    def _stays(best: "Estimate", pin: Pin | None, now: float) -> bool:
        """A turn priced at its headers stays on its home: the cost model chose the home, which holds its context
        (what the session's pin says; on an exact engine, only while the engine still holds the last block the
        session's last priced turn ended with)."""
        if pin is None or best.replica is not pin.replica or best.engine != pin.engine or not best.cached:
            return False
        ex, tail = best.st.exact, pin.tail
        if ex is not None and ex.exact and tail is not None and tail[0] == ex.block_size:
            return ex.holds(tail[1]) or best.st.promised.get(tail[1], 0.0) > now
        return True

    def _saturated(self, best: "Estimate", profile: RequestProfile, pin: Pin | None,
                   ests: "list[Estimate] | None" = None) -> bool:
        """Flow control's saturation, with nothing to tune. A turn that needs new room in a cache (a new session, or
        one that must prefill most of its context again: no home yet, or less than half of it cached on the best
        candidate) and fits on no candidate beside the active sessions' contexts (C3's fit rule, the best not
        fitting: none does) waits in the router for a replica where it fits: placed now, the engine's LRU would
        evict active sessions' contexts while they think, and their next turns would prefill them again (the tail
        of every router in lasting overload, docs/routing.md). A context too big for an empty replica is placed as
        today: waiting would not make it fit. Turns that keep their cache are never held, nor one-shots.
        With hold_on_wait, also: even the best candidate makes the request wait longer than its own prefill there
        (half of it, sheddable), so holding it loses no engine time while it keeps the choice of replica open."""
        fresh = pin is None or best.cached < best.prompt / 2
        if fresh and profile.session_key is not None:
            if not any(e.room for e in (ests or (best,))) and \
                    best.prompt <= self.cfg.warm.kv_pressure * best.st.cache_tokens:
                return True
            # Sessions under way on it (active contexts) come back for their next turns, and an engine runs its
            # queue in order: each new session placed behind a queue longer than its own prefill only lengthens
            # what their cached turns wait (a flood of 2,000 new sessions took them from 0.08 s to 20 s). A new
            # session (no home yet) waits here instead while every candidate with sessions under way has more than
            # its prefill queued: no engine time lost. A session under way is never held for this. Only while the
            # fleet is busy (every such queue at least warm.busy_wait_s, the cost model's mark of no idle capacity):
            # a queue of a tenth of a second comes and goes on any busy fleet, and a new session held until none
            # had one waited 0.6 s for the 0.04 s its prefill would have added (three real vLLMs, docs/routing.md)
            floor = max(_TIE_S, self.cfg.warm.busy_wait_s)
            if pin is None and all(e.st.active_tokens > 0 and e.wait + e.lora_wait > max(e.prefill, floor)
                                   for e in (ests or (best,))):
                return True
        if not self.hold_on_wait:
            return False
        afford = max(best.prefill, _TIE_S) * (0.5 if profile.priority >= 2 else 1.0)
        return best.wait + best.lora_wait > afford  # an adapter's load is paid whenever it goes: no reason to wait

    def _break_tie(self, tied: list["Estimate"], home: Replica | None, home_engine: int | None, per: int,
                   n_replicas: int) -> "Estimate":
        """Costs within a decode step (or 2%) of the least are a tie, below what the estimates can tell apart:
        then the session's own replica (where anything of it may still be), the least in-flight work, and
        round-robin, so that an idle fleet does not send every new conversation to its first replica.
        Round-robin over engines, not only replicas: a data-parallel replica's engines take turns too (its engine 0
        would win every tie once finished requests leave nothing predicted on either)."""
        slots, rr = n_replicas * per, self._rr
        return min(tied, key=lambda e: (e.replica is not home or e.engine != home_engine, round(e.st.work_s, 3),
                                        (e.replica.index * per + (e.engine or 0) - rr) % slots))

    def _price(self, rows, agg: "Aggregates", profile: RequestProfile, pin: Pin | None, mine,
               now: float) -> tuple[list["Estimate"], list["Estimate"]]:
        """Every row's estimate, and those tied for the least cost once the guard and the fit rule had their say."""
        w = self.cfg.warm
        out_tokens, fastest_decode = agg.out_tokens, agg.fastest_decode
        # a replica that has not yet said how its engine counts tokens (new, or no traffic yet) counts as its peers
        # do: priced at 1 beside peers that learned 0.6, it would look dearer than it is and never get the traffic
        # that teaches it
        ests = [self._estimate(r, st, rate, dec, profile, pin, now, k, agg.peer_scale)
                for (r, st, k), rate, dec in rows]
        for e in ests:
            own = self.overhead_of(e.replica, now, e.prompt)
            e.ttft = e.wait + e.lora + e.prefill + own
            if self.use_kv_risk:
                self._kv(e, out_tokens, mine, profile.session_key is not None, now)
            # a replica's own overhead predicts its first token; the choice prices its peers' level: fitted on 64
            # requests, the differences between like replicas are noise, and followed they drew new sessions to
            # whichever fitted lowest (three real vLLMs: p50 1.22x ring hash's, against 1.11x without them)
            e.cost += e.ttft + e.stall - own + overhead_at(self._overhead_level, e.prompt)
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
                total = max(0.0, agg.total_work + self._work_delta)
                in_flight, n = max(0, agg.in_flight + self._flight_delta), agg.n
            candidates = self._guard(ests, out_tokens, fastest_decode, total, in_flight, n)
        else:
            candidates = ests
        if self.use_interference and self.use_kv_risk:
            # the interference term draws big prefills to the replicas with few arrivals, which are where long
            # sessions live: without this it sends a long context where it and theirs thrash (one shared system
            # prompt, docs/routing.md). The home is no exception: a context that does not fit there
            # is lost there too
            candidates = [e for e in candidates if e.fits] or candidates
        least_cost = min(e.cost for e in candidates)
        return ests, [e for e in candidates if e.cost <= least_cost + max(_TIE_S, _TIE_SHARE * least_cost)]

    def _guard(self, ests: list["Estimate"], out_tokens: float, fastest_decode: float, total: float,
               in_flight: int, n: int) -> list["Estimate"]:
        """C5: Envoy's bounded-load rule in work units. With k typical requests in flight a replica may hold
        max(1, ceil(ceil((k + 1) x c) / n)) of them; what it holds beyond counts as waiting, and beyond
        hard_bound_factor x that it takes nothing (unless every replica is that far over). ``total``, ``in_flight``
        and ``n``: the whole pool's (of which ``ests`` may be a shortlist)."""
        w = self.cfg.warm
        if n < 2:
            return ests
        unit = total / in_flight if in_flight and total > 0 else ests[0].prompt / ests[0].rate + out_tokens * fastest_decode
        bound = fair_share(total, unit, w.balance_factor, n)
        kept = []
        for e in ests:
            over = e.st.work_s - bound
            if over > 0:
                e.cost += over
                if e.st.work_s > w.hard_bound_factor * bound:
                    continue
            kept.append(e)
        return kept or ests

    def _decide(self, best: "Estimate", profile: RequestProfile, pin: Pin | None, prompt: int, now: float) -> Decision:
        """C4: the session pin records where the session's context now lives."""
        chosen = best.replica
        events: list[PinEvent] = []
        reason = Reason.LOAD
        pin_kind = None
        if profile.session_key is not None:
            live = chosen.health.state is LIVE and not chosen.drained
            if pin is None:
                if live:
                    new = self.session_pins.put(profile.session_key, chosen, now)
                    new.tokens, new.engine = prompt, best.engine
                    new.tail = _tail(profile)
                    events.append(PinEvent(PinAction.PIN, SESSION, Cause.NEW))
            else:
                pin_kind = SESSION
                if live:  # A2: a PROBING replica never takes a pin, nor refreshes one
                    tail = _tail(profile)
                    if pin.replica is chosen and pin.engine == best.engine:
                        reason = Reason.AFFINITY
                        pin.tail = tail or pin.tail  # a turn not priced by the engine's tokens leaves the last known
                    else:
                        # the session moves only because moving is cheaper, re-prefill included
                        dead = pin.replica.removed or pin.replica.health.state is not LIVE
                        self.session_pins.move(pin, chosen)
                        events.append(PinEvent(PinAction.REBIND, SESSION, Cause.DEAD if dead else Cause.COST))
                        pin.tail = tail
                    pin.tokens = prompt
                    pin.engine = best.engine
                    # a turn decided at its headers adds no blocks to the index: until a body is read again, the pin
                    # says how much of the session the home holds
                    pin.unindexed = profile.header_path
                    self.session_pins.touch(profile.session_key, pin, now)
        return Decision(chosen, reason, pin_kind, events, predicted_ttft_s=best.ttft, cached_tokens=best.cached,
                        prompt_tokens=best.prompt, prefix=best.prefix, restored_tokens=best.restored,
                        restored_from=best.medium,
                        work_s=best.work, engine=best.engine,
                        steer=best.engine is not None and self.cfg.warm.steer_data_parallel)

    def on_reserved(self, d: Decision, profile: RequestProfile, now: float) -> None:
        st = self.engine_state(d.replica.name, d.engine) or self.state_of(d.replica)
        if d.reservation is not None:
            # as priced: what the model's part of the prediction excludes
            d.reservation.overhead_s = self.overhead_of(d.replica, now, self._chosen_prompt)
        prompt = self._chosen_prompt  # the engine's tokens, as priced
        if profile.deferred and d.reservation is not None:
            # its body is still on its way: no engine has it, so nothing queues or holds KV for it until it arrives
            # (four uploads held open past the picker's byte limit refused every new session for ~55 s)
            self._flight_delta += 1
            d.reservation.engine = d.engine
            d.reservation.deferred = (self._chosen_prefill_s, prompt, d.work_s)
            return
        uncached = max(1, prompt - d.cached_tokens - d.restored_tokens)
        st.book(now, self._chosen_prefill_s, prompt, d.work_s, None if profile.provisional else profile.tokens)
        if not profile.provisional:  # a size declared in a header says nothing of this replica's typical request
            st.uncached_ewma += 0.2 * (uncached - st.uncached_ewma)
        self._work_delta += d.work_s
        self._flight_delta += 1
        if self.use_interference:
            a = st.arrivals
            a.append(now)
            while a[0] < now - self.cfg.warm.arrival_window_s:  # bounded by the window
                a.popleft()
        if d.reservation is not None:
            res = d.reservation
            res.work_s, res.engine = d.work_s, d.engine
            res.prefill_s, res.prefill_end, res.pending_tokens = self._chosen_prefill_s, st.prefill_busy_until, prompt
            res.arrived_at = now if self.use_interference else None
        if (ex := st.exact) is not None and ex.exact and (h := profile.engine_hashes) and h[0] == ex.block_size:
            st.promise(profile.engine_hashes[1], st.prefill_busy_until + PROMISE_SLACK_S, now)
        if self.use_index and profile.blocks and st.prefix_caching:
            st.index.insert(profile.blocks)
            if self.outbox is not None:
                self.outbox.indexed(d.replica.name, d.engine, profile.blocks, len(profile.blocks))
        if profile.adapter is not None:
            sent = self.state_of(d.replica).lora_sent
            sent[profile.adapter] = now
            sent.move_to_end(profile.adapter)
            while len(sent) > 64:  # far more than any replica's slots
                sent.popitem(last=False)
        if profile.session_key is not None and not profile.provisional:
            self.sessions.place(profile.session_key, st, prompt, now, d.prefix, d.cached_tokens)

    def on_arrived(self, res, now: float) -> None:
        if res.deferred is None:
            return
        (prefill_s, prompt, work_s), res.deferred = res.deferred, None
        st = self.engine_state(res.replica.name, res.engine) or self.state_of(res.replica)
        st.book(now, prefill_s, prompt, work_s, None)
        self._work_delta += work_s
        res.work_s, res.prefill_s, res.prefill_end, res.pending_tokens = work_s, prefill_s, st.prefill_busy_until, prompt

    def plan_prefill(self, d: Decision, prefills: list[Replica], profile: RequestProfile,
                     now: float) -> PrefillPlan | None:
        """Prefill/decode disaggregation (``disaggregation``'s docstring): the prefill leg's plan when a remote
        prefill beats the local one on the decode replica just chosen, else None."""
        best = self._chosen
        if best is None or best.replica is not d.replica or profile.provisional or profile.header_path or \
                profile.body_status not in LEG_BODIES or profile.api not in DISAGGREGATED_APIS or \
                profile.adapter is not None:
            return None
        limit = self.cfg.disaggregation.max_transfer_tokens
        if limit is not None and best.prompt > limit:
            return None
        states = [self.state_of(r) for r in prefills]
        rates, decs = effective_rates([st.rates for st in states], now, self.cfg.warm.rate_fresh_s,
                                      [st.running(r) for r, st in zip(prefills, states)])
        # the same model's tokenizer: a prefill replica that has not learned its tokens' scale counts as the decode one
        scale = best.prompt / profile.tokens if profile.tokens else 1.0
        leg = min((self._estimate(r, st, rate, dec, profile, None, now, peer_scale=scale)
                   for r, st, rate, dec in zip(prefills, states, rates, decs)), key=lambda e: e.wait + e.prefill)
        moved = best.prompt - best.cached
        ttft = leg.wait + leg.prefill + moved / self.transfer.value + best.dec
        r = best.replica
        # the streams its prefill would stall: those decoding there, and those that join meanwhile (half of it each,
        # on average: the interference term's reasoning)
        window = self.cfg.warm.arrival_window_s
        decoding = max(best.st.running(r), r.in_flight_requests - 1) + \
            recent(best.st.arrivals, now - window) / window * best.prefill / 2
        if not worth_it(best.ttft + best.risk, best.prefill, decoding, ttft, _TIE_S):
            return None
        return PrefillPlan(leg.replica, ttft, best.ttft, leg.prefill, leg.prompt, moved)

    def on_prefill_reserved(self, d: Decision, profile: RequestProfile, now: float) -> None:
        """The prefill leg's books on its replica (its queue, its cache); its decode replica computes no prompt."""
        plan, res = d.prefill, d.prefill_reservation
        st = self.state_of(plan.replica)
        st.book(now, plan.prefill_s, plan.prompt, plan.prefill_s, profile.tokens)
        self._work_delta += plan.prefill_s
        self._flight_delta += 1
        res.work_s, res.prefill_s, res.prefill_end, res.pending_tokens = \
            plan.prefill_s, plan.prefill_s, st.prefill_busy_until, plan.prompt
        if self.use_index and profile.blocks and st.prefix_caching:
            st.index.insert(profile.blocks)
        if self._chosen is not None:
            self._chosen_prefill_s = self._chosen.dec  # the decode replica loads the prompt: one step of its own
        d.reservation.transfer_tokens = plan.transfer_tokens

    def on_transfer(self, tokens: int, seconds: float) -> None:
        """A decode leg's first token came ``seconds`` after it was sent: what its transfer took, near enough."""
        self.transfer.observe(tokens, seconds)

    def expected_output(self, r: Replica) -> float:
        return self.state_of(r).rates.output_tokens

    def on_first_token(self, res, observed_s: float, now: float) -> None:
        """What the request's first token took beyond the cost model's part of its prediction: its replica's
        overhead (``warm_replica.Overhead``)."""
        if res.predicted_ttft_s is None or res.remote or res.transfer_tokens:
            return  # nothing predicted, another brain's, or a decode leg (its transfer is learned apart)
        if res.predicted_ttft_s - res.overhead_s - res.prefill_s > _TIE_S:
            # predicted to wait: its error is the queue model's, not the replica's own overhead. Learned from those
            # too, an overloaded fleet's queue errors became a slope that changed what flow control held
            return
        st = self.state_of(res.replica)
        st.overhead.add(res.pending_tokens, observed_s - (res.predicted_ttft_s - res.overhead_s), now)
        lines = [x.overhead.line for x in self._state.values() if x.overhead.line is not None]
        if lines:
            mid = len(lines) // 2
            self._overhead_level = (sorted(a for a, _ in lines)[mid], sorted(b for _, b in lines)[mid])

    def overhead_of(self, r: Replica, now: float, prompt_tokens: int) -> float:
        """A replica's first-token overhead for a prompt this long: its own, drifting to its peers' level as its
        samples age (a replica that stopped getting traffic is not kept off by an old reading); its peers' until it
        has its own (one never measured is priced as they are, neither shunned nor trusted blindly)."""
        level = overhead_at(self._overhead_level, prompt_tokens)
        own = self.state_of(r).overhead
        if own.line is None:
            return level
        w = 0.5 ** ((now - own.at) / OVERHEAD_HALF_LIFE_S)
        return w * overhead_at(own.line, prompt_tokens) + (1.0 - w) * level

    def on_remote_reserved(self, res, prefill_s: float, prompt_tokens: int, session_key: bytes | None,
                           prompt: int, at: float, now: float, estimated: int | None = None,
                           shared: tuple[int, int] | None = None) -> None:
        """Another brain's request on a replica (shared state), booked as ``on_reserved`` books ours: one brain
        taking all the traffic would see it queue there, hold its KV and keep its session's context active. Its
        prefill started queueing when it was decided (``at``), not when the news arrived."""
        st = self.engine_state(res.replica.name, res.engine) or self.state_of(res.replica)
        # what one request can be here, by this brain's own view of the replica (one event per replica
        # with an hour of work refused every new session): its prefill at a quarter of the learned rate, and its
        # decode a long answer's at a quarter of the learned speed
        rates = st.rates
        prompt_tokens = min(prompt_tokens, st.cache_tokens)
        prefill_s = min(prefill_s, 4.0 * prompt_tokens / max(rates.prefill_tokens_per_s, 1.0) + 1.0)
        res.work_s = min(res.work_s, prefill_s + 4.0 * _LONG_ANSWER_TOKENS * rates.decode_s_per_token + 1.0)
        st.book(at, prefill_s, prompt_tokens, res.work_s, estimated)
        self._work_delta += res.work_s
        self._flight_delta += 1
        res.prefill_s, res.prefill_end, res.pending_tokens = prefill_s, st.prefill_busy_until, prompt_tokens
        if self.use_interference:
            st.arrivals.append(now)
            res.arrived_at = now
        if session_key is not None:
            self.sessions.expire(now, self.cfg.warm.active_session_s)
            self.sessions.place(session_key, st, prompt, now, *(shared or (None, 0)))

    def kv_tokens(self, r: Replica, engine: int | None) -> int | None:
        st = (self.engine_state(r.name, engine) if engine is not None else None) or self.state_of(r)
        return st.cache_tokens if st is not None else None

    def index_of(self, r: Replica, engine: int | None):
        """The prefix index of a replica (or one of its data-parallel engines), for another brain's chains."""
        if not self.use_index:
            return None
        st = self.engine_state(r.name, engine) if engine is not None else self.state_of(r)
        return st.index if st is not None and st.prefix_caching else None


def _tail(profile: RequestProfile) -> tuple[int, int] | None:
    """(block size, its last full block's hash) of a prompt priced by the engine's tokens; None otherwise."""
    h = profile.engine_hashes
    return (h[0], h[1][-1]) if h is not None and h[1] else None


WARM_VARIANTS = {
    "warm": {},
    "warm_no_externality": {"externality": False},
    "warm_no_guard": {"guard": False},
    "warm_no_index": {"index": False},  # session pins only: what a cost model knows without a prefix index
    "warm_no_decode": {"decode": False},
    "warm_no_kv_risk": {"kv_risk": False},
    # the default before the interference term and the fit rule (docs/routing.md)
    "warm_no_interference": {"interference": False},
}

__all__ = ["WarmPolicy", "WarmReplica", "WARM_VARIANTS"]
