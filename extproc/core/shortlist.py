"""The big fleet's half of the warm policy: from SHORTLIST_FROM candidates on, the fleet is looked at whole now and
then (``View``: every replica's standing for a typical request, with the same cost terms as the price), and each
request prices a shortlist of the rows that can win instead of every candidate (docs/brains.md, "Big fleets").
The policy holds one ``Shortlist``: it owns the view and what was booked and released since it was taken."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .cost import (Aggregates, Estimate, decode_penalty, evict_risk, fair_share, interference, queue_wait, recent,
                   work_unit)
from .decision import FleetView
from .load import effective_rates
from .pins import Pin
from .profile import RequestProfile
from .replica import LIVE
from .warm_replica import WarmReplica, peer_scale
from .working_set import Active

if TYPE_CHECKING:
    from collections.abc import Callable, Collection

    from .config import RouterConfig
    from .warm_states import WarmStates

# A fleet of this many candidates or more prices a shortlist (``_View``): the replicas holding most of the
# request's chain, the least loaded, the least busy, the fastest, the next in round-robin, the session's home
# and whatever was released since the fleet was last looked at whole. Below it every candidate is priced.
SHORTLIST_FROM = 24
_DEEP, _LEVEL_LEAST, _LEAST_LOADED, _LEAST_WORK, _NEXT_RR, _FASTEST = 4, 8, 8, 3, 3, 2
# the fleet as a whole (its mean wait, rates, totals, the orders above) is looked at again after a 16th of the
# fleet's count in decisions, 50 ms, or a change of the pool
_VIEW_DECISIONS_SHARE, _VIEW_MAX_AGE_S, _VIEW_MAX_EASED = 16, 0.05, 16


class View:
    """A big fleet looked at whole (``Shortlist.look``): rows, aggregates and the shortlist's standing picks."""

    __slots__ = ("epoch", "only", "at", "left", "rows", "n_live", "cap", "aggregates", "picks", "pos_of_bit",
                 "pos_of_state", "pos_of", "index_at", "by_load", "bit_at")
    epoch: int
    only: "Collection[str] | None"
    at: float
    left: int
    rows: list | None  # None: a pool too small to shortlist, until it changes
    n_live: int
    cap: int
    aggregates: Aggregates
    picks: list[int]
    pos_of_bit: dict[int, int]
    pos_of_state: dict[int, int]
    pos_of: dict[tuple[str, int | None], int]
    index_at: list[int]
    by_load: list[int]
    bit_at: list[int]


@dataclass(slots=True)
class Priced:
    """One select's pricing, for ``WarmPolicy.observers`` (tests, the shortlist's check): nothing else reads it."""
    fleet: FleetView
    profile: RequestProfile
    pin: Pin | None
    mine: Active | None
    view: View | None
    agg: Aggregates
    ests: list[Estimate]
    best: Estimate
    now: float


class Pricing(Protocol):
    """What the shortlist reads of the policy that holds it (the warm policy)."""

    cfg: "RouterConfig"
    states: "WarmStates"
    use_index: bool
    shortlist: "Shortlist"
    observers: "list[Callable[[Priced], None]]"

    @property
    def rr_replica(self) -> int: ...

    def price_rows(self, rows: list, agg: Aggregates, profile: RequestProfile, pin: Pin | None, mine: Active | None,
                   now: float) -> tuple[list[Estimate], list[Estimate], list[Estimate]]: ...

    def tie_winner(self, tied: list[Estimate], pin: Pin | None, n_replicas: int) -> Estimate: ...


class Shortlist:
    """From SHORTLIST_FROM candidates on: the fleet looked at whole now and then, the rows each request prices."""

    def __init__(self) -> None:
        self.on = True  # False: every candidate priced whatever the fleet's size (the reference)
        self.view: View | None = None
        self.eased: set[int] = set()  # id() of the states released since the view was taken
        self.work_delta = 0.0  # work and requests booked or released since the view was taken
        self.flight_delta = 0

    def stale(self) -> None:
        """The candidates changed (a replica or an engine came or went, a new config): look again."""
        self.view = None

    def booked(self, work_s: float, requests: int = 1) -> None:
        self.work_delta += work_s
        self.flight_delta += requests

    def released(self, st: WarmReplica, work_s: float) -> None:
        self.work_delta -= min(st.work_s, work_s)
        self.flight_delta -= 1
        self.eased.add(id(st))

    def totals(self, agg: Aggregates) -> tuple[float, int, int]:
        """The pool's work, requests in flight and size now: the view's, with what changed since."""
        assert agg.total_work is not None  # a view's aggregates carry the pool's totals
        return max(0.0, agg.total_work + self.work_delta), max(0, agg.in_flight + self.flight_delta), agg.n

    def view_of(self, fleet: FleetView, now: float, pol: Pricing) -> "View | None":
        """The fleet looked at whole, when it is big enough to price a shortlist and the pool is the router's own
        (a gateway's subset or a holder's one replica price every candidate)."""
        epoch = fleet.pool_epoch
        if epoch is None or not self.on or not pol.use_index:
            return None
        only = fleet.only
        v = self.view
        if v is not None and v.epoch == epoch and (v.only is only or v.only == only):
            if v.rows is None:
                return None  # a small pool, until it changes
            if v.left > 0 and 0 <= now - v.at < _VIEW_MAX_AGE_S and len(self.eased) <= _VIEW_MAX_EASED:
                v.left -= 1
                return v
        self.view = v = self.look(fleet, epoch, now, pol)
        v.only = only
        return v if v.rows is not None else None

    def look(self, fleet: FleetView, epoch: int, now: float, pol: Pricing) -> View:
        v = View()
        v.epoch, v.at, v.rows = epoch, now, None
        live, probing = fleet.pool()
        w = pol.cfg.warm
        if not live or (pol.states.engines and not w.steer_data_parallel):
            return v  # nothing LIVE (the PROBING pool is uncapped, and small), or engines chosen per request
        cands = pol.states.candidates(live + probing)
        if len(cands) < SHORTLIST_FROM:
            return v
        pol.states.track()
        states = [st for _, st, _ in cands]
        prefill_rate, decode_s = effective_rates([st.rates for st in states], now, w.rate_fresh_s,
                                                 [st.running(r) for r, st, _ in cands])
        rows = list(zip(cands, prefill_rate, decode_s))
        out_tokens = sum(st.rates.output_tokens for st in states) / len(states)
        waits = [queue_wait(st, r, rate, now) for (r, st, _), rate in zip(cands, prefill_rate)]
        n_live = sum(1 for r, _, _ in cands if r.health.state is LIVE)
        live_waits = waits[:n_live]  # candidates keep the pool's order: LIVE first
        typical = max(1.0, sum(st.uncached_ewma for st in states) / len(states))
        v.left = max(0, len(cands) // _VIEW_DECISIONS_SHARE - 1)
        v.rows = rows
        v.n_live = n_live
        v.cap = pol.cfg.probing_max_in_flight
        busy = min(1.0, sum(live_waits) / n_live / w.busy_wait_s)
        work_total = sum(st.work_s for st in states[:n_live])
        v.aggregates = agg = Aggregates(out_tokens, min(decode_s), peer_scale(states), busy=busy, total_work=work_total,
                                        in_flight=sum({id(r): r.in_flight_requests
                                                       for r, _, _ in cands[:n_live]}.values()), n=n_live)
        # what a typical request, its cache left aside, would cost on each LIVE candidate: the terms of the price
        # that depend on the replica alone (wait, prefill at its rate, decode slower than the fastest, arrivals'
        # interference, eviction risk, the guard's overload); equal keys go round-robin, as ties do
        fastest, idle = agg.fastest_decode, 1.0 - busy
        since = now - w.arrival_window_s
        unit = work_unit(work_total, agg.in_flight, typical / prefill_rate[0] + out_tokens * fastest)
        bound = fair_share(work_total, unit, w.balance_factor, n_live)
        rr, n_all = pol.rr_replica, max(1, len(fleet.replicas_view))
        load = []
        for i in range(n_live):
            st = states[i]
            p = typical * st.scale.value / prefill_rate[i]
            pressure = (st.active_whole + 2 * typical) / st.cache_tokens
            load.append((waits[i] + p
                         + decode_penalty(w.decode_weight, out_tokens, decode_s[i], fastest)
                         + interference(idle, recent(st.arrivals, since), w.arrival_window_s, p)
                         + p * evict_risk(pressure, w)
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
        self.eased.clear()
        self.work_delta, self.flight_delta = 0.0, 0
        return v

    def rows(self, v: View, profile: RequestProfile, pin: Pin | None, pol: Pricing) -> list:
        """The rows that can win: see SHORTLIST_FROM."""
        picks = set(v.picks)
        holders = pol.states.holders
        if profile.blocks and pol.use_index and holders is not None:
            # at each depth the chain is held at, the least loaded few of those holding it there: the deepest win
            # on cache, a shared system prompt's holders on cache and load together
            pos_of_bit = v.pos_of_bit
            for mask, _ in holders.levels(profile.blocks):
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
        for key in self.eased:
            i = v.pos_of_state.get(key)
            if i is not None:
                picks.add(i)
        n = len(v.index_at)
        start = bisect.bisect_left(v.index_at, pol.rr_replica)
        for j in range(_NEXT_RR):
            picks.add((start + j) % n)
        assert v.rows is not None  # a view_of answer: a pool big enough
        rows = [v.rows[i] for i in sorted(picks)]
        cap = v.cap
        rows += [row for row in v.rows[v.n_live:] if row[0][0].in_flight_requests < cap]
        return rows

    def every(self, v: View) -> list:
        """Every row the view's pool prices without a shortlist (what ``agreement`` checks it against)."""
        assert v.rows is not None
        return v.rows[:v.n_live] + [row for row in v.rows[v.n_live:] if row[0][0].in_flight_requests < v.cap]


def agreement(pol: Pricing) -> list:
    """A list each shortlisted decision of ``pol`` appends to: (the shortlist's choice, full pricing's, whether the
    shortlist's is among full pricing's ties, how many seconds dearer than the least it is there), every candidate
    priced once more under the same view of the fleet. For tests and benchmarks: it prices the fleet twice."""
    out: list = []

    def check(p) -> None:
        if p.view is None:
            return
        all_ests, _, full = pol.price_rows(pol.shortlist.every(p.view), p.agg, p.profile, p.pin, p.mine, p.now)
        ref = pol.tie_winner(full, p.pin, len(p.fleet.replicas_view))
        mine = next(e.cost for e in all_ests if e.st is p.best.st)
        out.append(((p.best.replica.name, p.best.engine), (ref.replica.name, ref.engine),
                    any(e.st is p.best.st for e in full), mine - min(e.cost for e in full)))

    pol.observers.append(check)
    return out


def tracing(pol: Pricing) -> list:
    """A list each decision of ``pol`` appends its candidates to: (name, cost, ttft, cached, wait, work in flight)."""
    out: list = []
    pol.observers.append(lambda p: out.extend(
        (e.replica.name, round(e.cost, 3), round(e.ttft, 3), e.cached, round(e.wait, 3), round(e.st.work_s, 2))
        for e in p.ests))
    return out
