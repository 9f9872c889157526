"""The big fleet's half of the warm policy: from SHORTLIST_FROM candidates on, the fleet is looked at whole now and
then (``View``: every replica's standing for a typical request, with the same cost terms as the price), and each
request prices a shortlist of the rows that can win instead of every candidate (docs/routing.md, "Big fleets").
``WarmPolicy`` is a ``Shortlist``: these methods read its state."""

from __future__ import annotations

import bisect
import itertools

from .cost import Aggregates, decode_penalty, fair_share, interference, recent
from .decision import FleetView
from .load import effective_rates
from .pins import Pin
from .prefix_index import Holders
from .profile import RequestProfile
from .replica import LIVE
from .warm_replica import peer_scale

# A fleet of this many candidates or more prices a shortlist (``_View``): the replicas holding most of the
# request's chain, the least loaded, the least busy, the fastest, the next in round-robin, the session's home
# and whatever was released since the fleet was last looked at whole. Below it every candidate is priced.
SHORTLIST_FROM = 24
_DEEP, _LEVEL_LEAST, _LEAST_LOADED, _LEAST_WORK, _NEXT_RR, _FASTEST = 4, 8, 8, 3, 3, 2
# the fleet as a whole (its mean wait, rates, totals, the orders above) is looked at again after a 16th of the
# fleet's count in decisions, 50 ms, or a change of the pool
_VIEW_DECISIONS_SHARE, _VIEW_MAX_AGE_S, _VIEW_MAX_EASED = 16, 0.05, 16


class View:
    """A big fleet looked at whole (``WarmPolicy._look``): rows, aggregates and the shortlist's standing picks."""

    __slots__ = ("epoch", "only", "at", "left", "rows", "n_live", "cap", "aggregates", "picks", "pos_of_bit", "pos_of_state",
                 "pos_of", "index_at", "by_load", "bit_at")


class Shortlist:

    def _view_of(self, fleet: FleetView, now: float) -> "View | None":
        """The fleet looked at whole, when it is big enough to price a shortlist and the pool is the router's own
        (a gateway's subset or a holder's one replica price every candidate)."""
        epoch = getattr(fleet, "pool_epoch", None)
        if epoch is None or not self.use_index:
            return None
        only = getattr(fleet, "only", None)
        v = self._view
        if v is not None and v.epoch == epoch and (v.only is only or v.only == only):
            if v.rows is None:
                return None  # a small pool, until it changes
            if v.left > 0 and 0 <= now - v.at < _VIEW_MAX_AGE_S and len(self._eased) <= _VIEW_MAX_EASED:
                v.left -= 1
                return v
        self._view = v = self._look(fleet, epoch, now)
        v.only = only
        return v if v.rows is not None else None

    def _look(self, fleet: FleetView, epoch: int, now: float) -> "View | None":
        v = View()
        v.epoch, v.at, v.rows = epoch, now, None
        live, probing = fleet.pool()
        if not live or (self._engines and not self.cfg.warm.steer_data_parallel):
            return v  # nothing LIVE (the PROBING pool is uncapped, and small), or engines chosen per request
        cands = self._candidates(live + probing)
        if len(cands) < SHORTLIST_FROM:
            return v
        if self.holders is None:
            self.holders = Holders()
            for st in itertools.chain(self._state.values(), *self._engines.values()):
                self.holders.track(st.index)
        w = self.cfg.warm
        states = [st for _, st, _ in cands]
        prefill_rate, decode_s = effective_rates([st.rates for st in states], now, w.rate_fresh_s,
                                                 [st.running(r) for r, st, _ in cands])
        rows = list(zip(cands, prefill_rate, decode_s))
        out_tokens = sum(st.rates.output_tokens for st in states) / len(states)
        waits = []
        for (r, st, _), rate in zip(cands, prefill_rate):
            wait = st.prefill_busy_until - now
            queued = st.waiting(r)
            if queued:
                wait = max(wait, queued * max(st.uncached_ewma, 1.0) / rate)
            waits.append(max(0.0, wait))
        n_live = sum(1 for r, _, _ in cands if r.health.state is LIVE)
        live_waits = waits[:n_live]  # _candidates keeps the pool's order: LIVE first
        typical = max(1.0, sum(st.uncached_ewma for st in states) / len(states))
        v.left = max(0, len(cands) // _VIEW_DECISIONS_SHARE - 1)
        v.rows = rows
        v.n_live = n_live
        v.cap = self.cfg.probing_max_in_flight
        v.aggregates = Aggregates(out_tokens, min(decode_s), peer_scale(states),
                                   busy=min(1.0, sum(live_waits) / n_live / w.busy_wait_s),
                                   total_work=sum(st.work_s for st in states[:n_live]),
                                   in_flight=sum({id(r): r.in_flight_requests
                                                  for r, _, _ in cands[:n_live]}.values()), n=n_live)
        # what a typical request, its cache left aside, would cost on each LIVE candidate: the terms of _price
        # that depend on the replica alone (wait, prefill at its rate, decode slower than the fastest, arrivals'
        # interference, eviction risk, the guard's overload); equal keys go round-robin, as ties do
        agg = v.aggregates
        fastest, idle = agg.fastest_decode, 1.0 - agg.busy
        since = now - w.arrival_window_s
        k, work_total = max(1, agg.in_flight), agg.total_work
        unit = work_total / k if work_total > 0 and agg.in_flight else typical / prefill_rate[0] + out_tokens * fastest
        bound = fair_share(work_total, unit, w.balance_factor, n_live)
        rr, n_all = self._rr // self._per, max(1, len(fleet.replicas_view))
        load = []
        for i in range(n_live):
            st = states[i]
            p = typical * st.scale.value / prefill_rate[i]
            pressure = (st.active_whole + 2 * typical) / st.cache_tokens
            load.append((waits[i] + p
                         + decode_penalty(w.decode_weight, out_tokens, decode_s[i], fastest)
                         + interference(idle, recent(st.arrivals, since), w.arrival_window_s, p)
                         + (p * min(1.0, (pressure - w.evict_start) / (w.kv_pressure - w.evict_start))
                            if pressure > w.evict_start else 0.0)
                         + max(0.0, st.work_s - bound),
                         st.work_s, (cands[i][0].index - rr) % n_all))
        order = range(n_live)
        v.by_load = sorted(order, key=load.__getitem__)
        v.bit_at = [st.index.bit for st in states[:n_live]]
        v.picks = sorted(set(
            v.by_load[:_LEAST_LOADED]
            + sorted(order, key=lambda i: load[i][1:])[:_LEAST_WORK]
            # a long prompt's cost is mostly what it makes others wait (interference): where few arrive
            + sorted(order, key=lambda i: (len(states[i].arrivals), load[i][1:]))[:_LEAST_WORK]
            + sorted(order, key=lambda i: states[i].scale.value / prefill_rate[i])[:_FASTEST]))
        v.pos_of_bit = {st.index.bit: i for i, st in enumerate(states[:n_live])}
        v.pos_of_state = {id(st): i for i, st in enumerate(states[:n_live])}
        v.pos_of = {(r.name, k): i for i, (r, _, k) in enumerate(cands[:n_live])}
        v.index_at = [r.index for r, _, _ in cands[:n_live]]
        self._eased.clear()
        self._work_delta, self._flight_delta = 0.0, 0
        return v

    def _shortlist(self, v: "View", profile: RequestProfile, pin: Pin | None) -> list:
        """The rows that can win: see SHORTLIST_FROM."""
        picks = set(v.picks)
        if profile.blocks and self.use_index:
            # at each depth the chain is held at, the least loaded few of those holding it there: the deepest win
            # on cache, a shared system prompt's holders on cache and load together
            pos_of_bit = v.pos_of_bit
            for mask, _ in self.holders.levels(profile.blocks):
                if mask.bit_count() <= _DEEP:
                    while mask:
                        low = mask & -mask
                        mask ^= low
                        i = pos_of_bit.get(low)
                        if i is not None:
                            picks.add(i)
                else:
                    found = 0
                    bit_at = v.bit_at
                    for i in v.by_load:
                        if bit_at[i] & mask:
                            picks.add(i)
                            found += 1
                            if found == _LEVEL_LEAST:
                                break
        if pin is not None:
            i = v.pos_of.get((pin.replica.name, pin.engine))
            if i is not None:
                picks.add(i)
        for key in self._eased:
            i = v.pos_of_state.get(key)
            if i is not None:
                picks.add(i)
        n = len(v.index_at)
        start = bisect.bisect_left(v.index_at, self._rr // self._per)
        for j in range(_NEXT_RR):
            picks.add((start + j) % n)
        rows = [v.rows[i] for i in sorted(picks)]
        cap = v.cap
        rows += [row for row in v.rows[v.n_live:] if row[0][0].in_flight_requests < cap]
        return rows
