"""The fleet every policy shares (DESIGN "Policies as compositions"): replicas, health machines, drain,
the candidate pool, reservations, and select + reserve as ONE synchronous call.

``Router.select`` asks the policy for a replica and reserves its in-flight weight in the same call,
with no ``await`` inside: two concurrent requests can never both see the same stale load (A1).
Step 1 (the pool) and step 5 (fallback) of A4 are the fleet's; the policy chooses among the pool.
The core reads no clock: every time-dependent call takes ``now``.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from typing import Callable, Collection, Iterable

from .config import RouterConfig
from .decision import Decision, FleetView, PinEvent, Reservation
from .load import LoadSample
from .names import Reason
from .pins import PREFIX, SESSION, PinTable
from .policy import Policy, make_policy
from .profile import RequestProfile
from .caps import TenantCaps
from .flow import CRITICAL, FlowControl, tenant_key
from .shared import Outbox, Remote
from .fleet_views import Pinned, Subset
from .reservations import OpenReservations
from .replica import EJECTED, LIVE, PROBING, HealthMachine, Replica, State, Transition

AFFINITY, LOAD, FALLBACK, NO_HEALTHY = Reason.AFFINITY, Reason.LOAD, Reason.FALLBACK, Reason.NO_HEALTHY

# Housekeeping (pin expiry, reservation safety timeout) need not be exact: an expired pin is absent to lookups
_HOUSEKEEPING_EVERY_S = 1.0
_NO_PINS = PinTable(PREFIX, 0.0)


class Router:
    """The fleet: replica table, health machines, reservations, and the policy that chooses."""

    def __init__(self, cfg: RouterConfig, replica_names: Iterable[str], now: float, policy: Policy | None = None):
        self.cfg = cfg
        self.policy = policy if policy is not None else make_policy(cfg.policy, cfg)
        self._replicas: list[Replica] = []
        self._by_name: dict[str, Replica] = {}
        self.reservations = OpenReservations()  # open, oldest first
        self._random = random.Random(cfg.seed)
        self._next_due = float("inf")
        self._housekeeping_at = now + _HOUSEKEEPING_EVERY_S
        self.safety_timeouts = 0
        # None: a reservation lives until its end is seen or the safety timeout. A number: it must be seen
        # alive (Envoy's periodic access-log entries) at least this often, or it was a lost or rogue call
        self.liveness_timeout_s: float | None = None
        self.liveness_timeouts = 0
        self.passive_ejections_refused = 0  # users' requests would have ejected more than the fleet's share
        # bumped whenever the pool may have changed (a health transition, a drain, a replica added or removed): a
        # policy may keep what it derives from the pool until then
        self.pool_epoch = 0
        self.only: Collection[str] | None = None  # as a FleetView: the router's own pool, every replica
        self.disaggregates = False  # P/D: the front sends prefill legs (a picker's gateway carries one per pick)
        self._prefills = False  # some replica is of role prefill (set_roles)
        self.flow: FlowControl | None = None  # flow control (core.flow): None, every request is placed at once
        self.caps: TenantCaps | None = None  # per-tenant token caps (core.caps): None, no tenant is capped
        self._ready: list = []  # held requests a select let go before its newcomer, for the next offer
        self.offer_due = True  # something changed since the last offer (a release, a scrape): a newcomer offers
        self._offered_at = float("-inf")
        self._last_hold = (0.0, 0.0)  # the last held decision's (drain_tps, free_at): what a queued request waits by
        self.selects = 0  # decisions asked for, fallbacks included (the denominator of candidate_decisions)
        self.transitions: deque[Transition] = deque(maxlen=1000)
        self.listeners: list[Callable[[Transition], None]] = []
        # shared state: None with one brain; else what this brain's decisions change, for the others
        self.outbox: Outbox | None = None
        self.remote = Remote()  # what the other brains said: their reservations and chains
        self._set_profile_cfg()
        for name in replica_names:
            self.add_replica(name, now)

    # ---------------------------------------------------------------- replicas

    @property
    def replicas(self) -> list[Replica]:
        return list(self._replicas)

    @property
    def replicas_view(self) -> list[Replica]:
        """The replica list itself, for policies (read only)."""
        return self._replicas

    @property
    def needs_blocks(self) -> bool:
        """Whether the policy reads the request's block chain (the profile computes it only then)."""
        return self.policy.needs_blocks

    def _set_profile_cfg(self) -> None:
        """The profile settings in force: the config's, with the policy's parse limit where the config names none."""
        p = self.cfg.profile
        if p.parse_max_bytes is None and self.policy.parse_max_bytes is not None:
            p = dataclasses.replace(p, parse_max_bytes=self.policy.parse_max_bytes)
        self.profile_cfg = p

    @property
    def session_pins(self) -> PinTable:
        return self.policy.session_pins

    @property
    def prefix_pins(self) -> PinTable:
        return self.policy.prefix_pins

    def share(self, on: bool = True) -> Outbox | None:
        """Start (or stop) writing this brain's state changes out as events (``core.shared``)."""
        self.outbox = Outbox() if on else None
        self.policy.outbox = self.outbox
        return self.outbox

    def apply(self, origin: str, events: list, offset: float, now: float) -> None:
        """Another brain's events (shared state), in its order; ``offset`` turns its clock into ours."""
        self.remote.apply(self, origin, events, offset, now)

    def find(self, name: str) -> Replica | None:
        return self._by_name.get(name)

    def replica(self, name: str) -> Replica:
        return self._by_name[name]

    def add_replica(self, name: str, now: float) -> Replica:
        """A new replica starts EJECTED without cooldown and joins through the health machine (B)."""
        if name in self._by_name:
            raise ValueError(f"replica {name!r} already known")
        r = Replica(name, len(self._replicas), HealthMachine(self.cfg.health, now))
        self.policy.configure(r)
        self._replicas.append(r)
        self._by_name[name] = r
        self.pool_epoch += 1
        return r

    def first_token_observed(self, res: Reservation, observed_s: float, now: float) -> None:
        """A request's first token came ``observed_s`` after it was sent to its replica (Envoy's timing)."""
        self.policy.on_first_token(res, observed_s, now)

    def transfer_observed(self, res: Reservation, first_byte_s: float) -> None:
        """A decode leg's first byte, ``first_byte_s`` after its request began (its prefill leg included)."""
        if res.transfer_tokens:
            self.policy.on_transfer(res.transfer_tokens, first_byte_s - res.leg_s)

    def set_roles(self, roles: dict[str, str]) -> None:
        """Each replica's part in a disaggregated fleet (absent: both)."""
        for r in self._replicas:
            role = roles.get(r.name, "both")
            if role != r.role:
                r.role = role
                self.pool_epoch += 1
        self._prefills = any(r.role == "prefill" for r in self._replicas)

    def prefill_pool(self, only: Collection[str] | None) -> list[Replica]:
        """The replicas a prefill leg may go to: LIVE replicas of role prefill (of the request's model)."""
        if not self._prefills:  # a fleet of whole replicas: nothing to look at on any request's path
            return []
        return [r for r in self._replicas if r.role == "prefill" and not r.drained and r.health.state is LIVE
                and (only is None or r.name in only)]

    def remove_replica(self, name: str) -> None:
        """Forget a replica. Its in-flight reservations still release cleanly; pins to it rebind on next use."""
        r = self._by_name.pop(name)
        r.removed = True
        self._replicas.remove(r)
        for i, rep in enumerate(self._replicas):
            rep.index = i
        self.pool_epoch += 1
        self.policy.forget(name)

    def update_config(self, cfg: RouterConfig) -> None:
        """New thresholds and TTLs take effect at once; pins, reservations and health states are kept.

        A new ``routing.policy`` starts with empty pins (the old policy's are dropped)."""
        if cfg.policy != self.cfg.policy:
            self.policy = make_policy(cfg.policy, cfg)
            self.policy.outbox = self.outbox
        self.cfg = cfg
        self.policy.update_config(cfg)
        self._set_profile_cfg()
        for r in self._replicas:
            r.health.cfg = cfg.health
            self.policy.configure(r)
        self._next_due = min((r.health.next_due() for r in self._replicas), default=float("inf"))

    def drain(self, name: str, drained: bool = True) -> None:
        """Operator drain: no new traffic and no pins; in-flight requests finish; scraping goes on."""
        r = self._by_name[name]
        r.drained = drained
        self.pool_epoch += 1
        self._sync_pool(r)

    def _sync_pool(self, r: Replica) -> None:
        """Book the replica's entry into or exit from the pool (for ``candidate_decisions``; nothing per request)."""
        in_pool = not r.drained and not r.removed and r.health.state is not EJECTED
        if in_pool and r.pool_since is None:
            r.pool_since = self.selects
        elif not in_pool and r.pool_since is not None:
            r.pool_selects += self.selects - r.pool_since
            r.pool_since = None

    def candidate_decisions(self, r: Replica) -> int:
        """Decisions made while ``r`` could have been chosen (LIVE or PROBING, not drained)."""
        return r.pool_selects + (self.selects - r.pool_since if r.pool_since is not None else 0)

    # ------------------------------------------------------------------ inputs

    def _emit(self, t: Transition | None) -> Transition | None:
        if t is not None:
            self.pool_epoch += 1
            self.transitions.append(t)
            self._sync_pool(self._by_name[t.replica])
            if t.new is EJECTED:
                self.policy.on_health(self._by_name[t.replica], True)
            for fn in self.listeners:
                fn(t)
        return t

    def on_scrape(self, name: str, ok: bool, now: float, running: int = 0, waiting: int = 0, kv_usage: float = 0.0,
                  sample: LoadSample | None = None, slow: bool = False) -> Transition | None:
        """Feed one health scrape. EJECTED replicas are scraped too: it is their only way back (A2). ``slow``: it
        failed by running out of time (a LIVE replica serving users' requests is busy, not dead)."""
        r = self._by_name.get(name)
        if r is None:
            return None
        if ok:
            if sample is None:
                sample = LoadSample(running, waiting, kv_usage)
            self._apply_load(r, sample, now)
        t = self._emit(r.health.on_scrape(name, ok, now, slow))
        self._next_due = min(self._next_due, r.health.next_due())
        return t

    def on_load(self, name: str, sample: LoadSample, now: float) -> None:
        """A load-only scrape between health scrapes (C6): fresher signals, no effect on health."""
        r = self._by_name.get(name)
        if r is not None:
            self._apply_load(r, sample, now)

    def _apply_load(self, r: Replica, s: LoadSample, now: float) -> None:
        self.offer_due = True
        r.scraped_running = s.running
        r.scraped_waiting = s.waiting
        r.kv_usage = s.kv_usage
        if s.cached_tokens is not None:
            r.engine_cached_tokens = s.cached_tokens
        self.policy.on_load(r, s, now)

    def passive_ejection_allowed(self) -> bool:
        """Whether users' requests may eject one more replica: Envoy's max_ejection_percent rule, at least one."""
        n = len(self._replicas)
        limit = max(1, int(n * self.cfg.health.max_passive_ejection_percent / 100))
        out = sum(1 for r in self._replicas if r.health.state is EJECTED and r.health.ejected_passively)
        return out < limit

    def on_upstream(self, name: str, ok: bool, now: float) -> Transition | None:
        """Outcome of a user request on ``name`` (B: N consecutive failures eject a LIVE replica, within its share)."""
        r = self._by_name.get(name)
        if r is None:
            return None
        may = True
        if r.health.would_eject(ok) and not self.passive_ejection_allowed():
            may = False
            self.passive_ejections_refused += 1
        t = self._emit(r.health.on_upstream(name, ok, now, may))
        self._next_due = min(self._next_due, r.health.next_due())
        return t

    def tick(self, now: float) -> list[Transition]:
        """Apply timers: health (clean window, stale scrapes, streak reset), pin TTLs, safety timeouts."""
        out = []
        due = float("inf")
        for r in self._replicas:
            t = r.health.advance(r.name, now)
            if t is not None:
                self._emit(t)
                out.append(t)
            d = r.health.next_due()
            if d < due:
                due = d
        self._next_due = due
        if now >= self._housekeeping_at:
            self._housekeeping_at = now + _HOUSEKEEPING_EVERY_S
            self.policy.expire(now)
            self._expire_reservations(now)
            self.remote.expire(self, now, self.cfg.reservation_timeout_s)
        return out

    def _expire_reservations(self, now: float) -> None:
        for res in self.reservations.timed_out(now, self.cfg.reservation_timeout_s):
            self.release(res, now)
            self.safety_timeouts += 1
        if self.liveness_timeout_s is not None:
            for res in self.reservations.unseen(now, self.liveness_timeout_s):
                self.release(res, now)
                self.liveness_timeouts += 1

    # ---------------------------------------------------------------- pipeline

    def pool(self) -> tuple[list[Replica], list[Replica]]:
        """Step 1: the LIVE and the PROBING replicas, drained ones left out (EJECTED gets no traffic)."""
        live: list[Replica] = []
        probing: list[Replica] = []
        for r in self._replicas:
            if r.drained or r.role == "prefill":  # a prefill replica serves prefill legs alone
                continue
            st = r.health.state
            if st is LIVE:
                live.append(r)
            elif st is PROBING:
                probing.append(r)
        return live, probing

    def select(self, profile: RequestProfile, now: float, only: Collection[str] | None = None,
               holder: str | None = None, hold_key: object = None, hold_bytes: int = 0) -> Decision:
        """Choose a replica for ``profile`` and reserve its weight: one synchronous call (A1 atomic reserve).

        ``only``: the replicas a gateway allows for this request (the endpoint picker's subset hint); the
        choice, the fallback and every pin decision see no other. ``holder``: the one replica holding what the
        request reads (a stored response): chosen whatever its state, drained or ejected, since no other can
        answer; the policy still prices it and keeps its books. ``hold_key``: with flow control on
        (``self.flow``), the caller can hold the request under this key: a request every candidate is saturated
        for, or one that would overtake queued requests of its class or above, is queued (Reason.HELD) and comes
        back from ``offer``; Reason.QUEUE_FULL when the queue is full of its class and above. ``hold_bytes``: what
        holding it keeps in memory (its body), counted against the queue's byte bound."""
        if now >= self._next_due or now >= self._housekeeping_at:
            self.tick(now)
        self.selects += 1
        wait = self.over_cap(profile.tenant, profile.priority, now)
        if wait is not None:  # refused before anything is priced or booked: it costs the fleet nothing
            return Decision(None, Reason.TENANT_CAP, retry_after_s=wait)
        if holder is not None:
            r = self._by_name.get(holder)
            if r is None or (only is not None and holder not in only):
                return Decision(None, NO_HEALTHY)
            pinned = Pinned(self, r)
            flow = self.flow
            if flow is not None and hold_key is not None and profile.priority != CRITICAL:
                # bound to one replica, and still flow control's like any request: 40 follow-ups of one stored
                # response went to its replica at once with 20.6 s predicted there, none held
                d = self._select_may_hold(pinned, profile, now)
                if d is not None and d.reason is Reason.HELD:
                    return flow.hold(hold_key, profile, pinned, now, hold_bytes, d.predicted_ttft_s)
                self._charge(tenant_key(profile.tenant), profile.tokens)
            else:
                d = self.policy.select(pinned, profile, now)
            if d is None:  # the policy would not place it there (it does not fit, say): the replica will answer
                return self._shared(Decision(r, Reason.HOLDER, None, [], self._reserve(r, profile, now)), profile, now)
            d.reason = Reason.HOLDER
        else:
            fleet: FleetView = self if only is None else Subset(self, only)
            flow = self.flow
            if flow is not None and hold_key is not None and profile.priority != CRITICAL:
                if flow.queue.ahead(profile.priority)[0] and (self.offer_due or now - self._offered_at
                                                              >= _OFFER_GAP_S):
                    # whatever can go now goes before it. offer() replaces self._ready: read it after the call.
                    # Not again before something changed (a release, a scrape) or a moment passed: an offer prices
                    # up to 32 held requests, and one per arrival in a flood of 2,000 made the brain fall behind
                    # and fail hundreds open past it
                    ready = self.offer(now)
                    self._ready.extend(ready)
                queued, wait = self.behind_queue(profile, now)
                if queued:
                    if profile.header_path:
                        return Decision(None, Reason.READ_BODY)  # held, it is held with its body, as any other
                    return flow.hold(hold_key, profile, only, now, hold_bytes, wait)
                d = self._select_may_hold(fleet, profile, now)
                if d is not None and d.reason is Reason.HELD:
                    if profile.header_path:
                        return Decision(None, Reason.READ_BODY, predicted_ttft_s=d.predicted_ttft_s)
                    return flow.hold(hold_key, profile, only, now, hold_bytes, d.predicted_ttft_s)
            else:
                d = self.policy.select(fleet, profile, now)
            if profile.header_path and (d is None or d.reason is Reason.READ_BODY):
                return d or Decision(None, Reason.READ_BODY)  # no pool to keep it on: the body decides
            if flow is not None:
                self._charge(tenant_key(profile.tenant), profile.tokens)
        return self._place(d, profile, now, only)

    def _place(self, d: Decision | None, profile: RequestProfile, now: float,
               only: Collection[str] | None) -> Decision:
        if d is None:
            return self._shared(self._fallback(profile, now, only), profile, now)
        assert d.replica is not None  # a policy's decision names its replica, or is None
        d.reservation = self._reserve(d.replica, profile, now)
        try:  # a fault past the booking gives it back: its request goes on without the brain, and nothing names it
            if self.cfg.disaggregation.enabled and self.disaggregates and d.reason is not Reason.HOLDER:
                prefills = self.prefill_pool(only)
                d.prefill = self.policy.plan_prefill(d, prefills, profile, now) if prefills else None
                if d.prefill is not None:
                    d.predicted_ttft_s = d.prefill.ttft
                    d.prefill_reservation = self._reserve(d.prefill.replica, profile, now)
                    self.policy.on_prefill_reserved(d, profile, now)
            d.reservation.predicted_ttft_s = d.predicted_ttft_s
            self.policy.on_reserved(d, profile, now)
        except BaseException:
            self.release(d.prefill_reservation, now)
            self.release(d.reservation, now)
            raise
        return self._shared(d, profile, now)

    def over_cap(self, tenant: str | None, priority: int, now: float) -> float | None:
        """Seconds until ``tenant`` may send again, its token cap taken (core.caps); None: it may now. A request
        naming no tenant, and critical work, are never capped (with no tenant configured every client is one)."""
        if self.caps is None or tenant is None or priority == CRITICAL:
            return None
        return self.caps.retry_after(tenant_key(tenant), now)

    def _spend(self, tenant: str | None, tokens: float, now: float) -> None:
        """A tenant's request placed: out of its cap here and, sharing state, in every brain."""
        assert self.caps is not None
        self.caps.spend(tenant, tokens, now)
        if self.outbox is not None:
            self.outbox.events.append(("t", tenant, round(tokens)))

    # ------------------------------------------------------------ flow control

    def behind_queue(self, profile: RequestProfile, now: float) -> tuple[bool, float | None]:
        """Whether flow control queues a request behind its class or above unpriced (competing for what they wait for:
        engine time if held by wait, else room for a new context, which a session under way never takes), and its
        wait: until the replica the last held one was priced for has room, then the queue before it."""
        assert self.flow is not None  # only flow control queues
        n_ahead, tokens_ahead = self.flow.queue.ahead(profile.priority)
        if not n_ahead or not (self.flow.hold_on_wait or self._new_session(profile, now)):
            return False, None
        drain, free_at = self._last_hold
        return True, max(0.0, free_at - now) + tokens_ahead / drain if drain > 0 else None

    def _new_session(self, profile: RequestProfile, now: float) -> bool:
        return profile.session_key is not None and self.session_pins.get(profile.session_key, now) is None

    def _select_may_hold(self, fleet: FleetView, profile: RequestProfile, now: float) -> Decision | None:
        assert self.flow is not None  # only flow control holds
        d = self.policy.select(fleet, profile, now, hold := self.flow.mode(now))
        if d is not None and d.reason is Reason.HELD:
            self._last_hold = (d.drain_tps, d.free_at)
            self.flow.held_in(hold, now)
        return d

    def offer(self, now: float) -> list[tuple[object, Decision]]:
        """Held requests that can go now, in the queue's order, each placed by the policy at this moment (late
        binding): (its key, its decision). Also what a ``select`` let go before a newcomer (taken once)."""
        out, self._ready = self._ready, []
        flow = self.flow
        if flow is None:
            return out
        self.offer_due, self._offered_at = False, now
        flow.expire(now)
        # in the queue's order; one still saturated (its home busy, say) does not keep a later one from a replica
        # that has room for it: no head-of-line blocking
        for h in flow.queue.in_order(_OFFER_SCAN):
            profile, only = flow.held[h.key]
            # the one replica holding what it reads (a Pinned view, whatever that replica's state), or a subset
            fleet: FleetView = only if isinstance(only, Pinned) else self if only is None else Subset(self, only)
            d = self._select_may_hold(fleet, profile, now)
            if d is not None and d.reason is Reason.HELD:
                continue
            flow.queue.take(h)
            if self.outbox is not None:
                self.outbox.events.append(("v", h.tenant, h.tokens))
            del flow.held[h.key]
            if isinstance(only, Pinned):
                r = only.replica
                if d is None:  # it does not fit there at all: that replica answers, as without flow control
                    out.append((h.key, self._shared(Decision(r, Reason.HOLDER, None, [], self._reserve(r, profile,
                                                                                                       now)),
                                                    profile, now)))
                    continue
                d.reason = Reason.HOLDER
                out.append((h.key, self._place(d, profile, now, None)))
                continue
            out.append((h.key, self._place(d, profile, now, only)))
        return out

    def _charge(self, tenant: str | None, tokens: float) -> None:
        """Service a tenant got: counted here and, sharing state, by every brain (fairness across brains)."""
        assert self.flow is not None
        self.flow.queue.charge(tenant, tokens)
        if self.outbox is not None:
            self.outbox.events.append(("v", tenant, tokens))

    def cancel(self, key: object, now: float = 0.0) -> bool:
        """A held request's client went away: out of the queue at once. One already let go by a newcomer and
        waiting for the next offer gives its reservation back."""
        if self.flow is None:
            return False
        for i, (k, d) in enumerate(self._ready):
            if k == key:
                del self._ready[i]
                self.release(d.reservation, now)
                return True
        if self.flow.queue.remove(key) is None:
            return False
        self.flow.held.pop(key, None)
        return True

    def _shared(self, d: Decision, profile: RequestProfile, now: float) -> Decision:
        """Every placement ends here: the other brains told, its tenant's cap charged."""
        if self.caps is not None and profile.tenant is not None and d.replica is not None:
            # what it makes the fleet compute: its prompt's uncached part as priced, and its expected answer
            computed = d.prompt_tokens - d.cached_tokens if d.prompt_tokens else profile.tokens
            self._spend(tenant_key(profile.tenant), computed + self.policy.expected_output(d.replica), now)
        if self.outbox is not None:
            self.outbox.decided(self, d, profile, now)
        return d

    def _fallback(self, profile: RequestProfile, now: float, only: Collection[str] | None = None) -> Decision:
        """Step 5: nothing LIVE or PROBING -> a random known replica; nothing known -> no_healthy_instances."""
        known = [r for r in self._replicas if not r.drained and r.role != "prefill" and (only is None or r.name
                                                                                         in only)]
        if not known:
            return Decision(None, NO_HEALTHY)
        r = self._random.choice(known)
        return Decision(r, FALLBACK, None, [], self._reserve(r, profile, now))

    def next_best(self, chosen: Replica, k: int, only: Collection[str] | None = None) -> list[Replica]:
        """Up to ``k`` other replicas for a proxy to try when ``chosen`` refuses the connection: the pool (LIVE before
        PROBING) by least in-flight weight (a rare retry, to a replica without its cache: load is what matters)."""
        if k <= 0:
            return []
        live, probing = (self if only is None else Subset(self, only)).pool()
        rest = [r for r in live if r is not chosen] or [r for r in probing if r is not chosen]
        return sorted(rest, key=lambda r: (r.wlc_milli, r.index))[:k]

    # ------------------------------------------------------------ reservations

    def weight_milli(self, tokens: int) -> int:
        """B: weight = max(1, prompt_tokens_estimate / unit), in thousandths."""
        return max(1000, tokens * 1000 // self.cfg.token_weight_unit)

    def _reserve(self, r: Replica, profile: RequestProfile, now: float) -> Reservation:
        return self.reservations.open(r, self.weight_milli(profile.tokens), now, profile.provisional)

    def reserve_remote(self, r: Replica, weight_milli: int, started_at: float, provisional: bool) -> Reservation:
        """Another brain's request in flight on ``r`` (shared state): counted like ours, ended by that brain."""
        return self.reservations.remote(r, weight_milli, started_at, provisional)

    def release(self, res: Reservation | None, now: float) -> bool:
        """End a reservation (success, error, disconnect, reset). Idempotent: True only the first time."""
        if res is None or res.released:
            return False
        res.released = True
        self.offer_due = True  # room freed: a held request may fit now
        r = res.replica
        r.wlc_milli -= res.weight_milli
        r.in_flight_requests -= 1
        if not res.remote:
            self.reservations.close(res)
            if self.outbox is not None:
                self.outbox.events.append(("c", res.id))
        self.policy.on_release(res, now)
        return True

    def arrived(self, res: Reservation | None, now: float) -> None:
        """The body of a request decided while it arrived has arrived whole: the policy books its work now."""
        if res is not None and not res.released:
            self.policy.on_arrived(res, now)

    def touch(self, res: Reservation, now: float, first_token: bool = False) -> None:
        """Envoy says the request is still in flight (a periodic access-log entry); ``first_token``: and it has had
        its first token (its prefill is over)."""
        res.seen_at = now
        if first_token:
            res.replica.health.served(now)
        if first_token and not res.released and not res.remote:
            self.policy.on_prefill_ended(res, now)

    def release_started_before(self, t: float, now: float) -> int:
        """Release every open reservation made before ``t`` (the Envoy that carried them is gone); how many."""
        return sum(self.release(r, now) for r in self.reservations.started_before(t))

    def reservation(self, rid: int) -> Reservation | None:
        """The open reservation with id ``rid`` (None once released)."""
        return self.reservations.get(rid)

    @property
    def open_reservations(self) -> int:
        return len(self.reservations)

    # ------------------------------------------------------------------- views

    def snapshot(self) -> list[dict]:
        """Replica table for admin views and the demo (O(pins): not for the request path)."""
        s = self.session_pins.count_by_replica()
        p = self.prefix_pins.count_by_replica()
        return [{**r.snapshot(), "candidate_decisions": self.candidate_decisions(r), "session_pins": s.get(r.name, 0),
                 "prefix_pins": p.get(r.name, 0)} for r in self._replicas]


_OFFER_SCAN = 32  # held requests an offer looks at, in order
_OFFER_GAP_S = 0.01  # a newcomer's offer, when nothing changed since the last: at most this often (the brain's tick)


__all__ = [
    "AFFINITY", "LOAD", "FALLBACK", "NO_HEALTHY", "Decision", "PinEvent", "Reservation", "Router",
    "State", "LIVE", "PROBING", "EJECTED", "SESSION",
]
