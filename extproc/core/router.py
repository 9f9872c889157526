"""The 5-step selection pipeline (SPEC A4) with the atomic WLC reserve (A1).

``Router.select`` chooses a replica and reserves its in-flight weight in
one synchronous call with no ``await`` inside: two concurrent requests can
never both see the same stale load. The core reads no clock: every
time-dependent call takes ``now``.
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

from .config import RouterConfig
from .names import Cause, PinAction, PinKind, Reason
from .pins import PREFIX, SESSION, Pin, PinTable
from .profile import RequestProfile
from .replica import EJECTED, LIVE, PROBING, HealthMachine, Replica, State, Transition

AFFINITY, LOAD, FALLBACK, NO_HEALTHY = Reason.AFFINITY, Reason.LOAD, Reason.FALLBACK, Reason.NO_HEALTHY

# Housekeeping (pin expiry, reservation safety timeout) need not be exact:
# lookups already treat an expired pin as absent.
_HOUSEKEEPING_EVERY_S = 1.0


@dataclass(slots=True)
class Reservation:
    """In-flight weight held on a replica from selection until Envoy ends the request."""

    id: int
    replica: Replica
    weight_milli: int
    started_at: float
    released: bool = False


@dataclass(frozen=True, slots=True)
class PinEvent:
    """A pin table change of one decision: ``action`` on a pin of ``kind``, and why."""

    action: PinAction
    kind: PinKind
    cause: Cause = Cause.NONE


@dataclass(slots=True)
class Decision:
    replica: Replica | None
    reason: Reason
    pin_kind: PinKind | None = None  # the pin resolved for this request, if any
    events: list[PinEvent] = field(default_factory=list)
    reservation: Reservation | None = None
    min_r: float = 0.0

    @property
    def replica_name(self) -> str | None:
        return self.replica.name if self.replica is not None else None


class Router:
    """Replica table, health machines, pin tables, reservations and the pipeline."""

    def __init__(self, cfg: RouterConfig, replica_names: Iterable[str], now: float):
        self.cfg = cfg
        self._replicas: list[Replica] = []
        self._by_name: dict[str, Replica] = {}
        self.session_pins = PinTable(SESSION, cfg.pins.session_ttl_s if cfg.pins.ttl_enabled else float("inf"))
        self.prefix_pins = PinTable(PREFIX, cfg.pins.prefix_ttl_s if cfg.pins.ttl_enabled else float("inf"))
        self._reservations: OrderedDict[int, Reservation] = OrderedDict()
        self._next_reservation_id = 1
        self._rr = 0  # round-robin pointer over replica indices (A4 step 3 ties)
        self._random = random.Random(cfg.seed)
        self._next_due = float("inf")
        self._housekeeping_at = now + _HOUSEKEEPING_EVERY_S
        self.safety_timeouts = 0
        self.transitions: deque[Transition] = deque(maxlen=1000)
        self.listeners: list[Callable[[Transition], None]] = []
        for name in replica_names:
            self.add_replica(name, now)

    # ---------------------------------------------------------------- replicas

    @property
    def replicas(self) -> list[Replica]:
        return list(self._replicas)

    def replica(self, name: str) -> Replica:
        return self._by_name[name]

    def add_replica(self, name: str, now: float) -> Replica:
        """A new replica starts EJECTED without cooldown and joins through the health machine (B)."""
        if name in self._by_name:
            raise ValueError(f"replica {name!r} already known")
        r = Replica(name, len(self._replicas), HealthMachine(self.cfg.health, now), self.cfg.wlc_enabled)
        self._replicas.append(r)
        self._by_name[name] = r
        return r

    def remove_replica(self, name: str) -> None:
        """Forget a replica. Its in-flight reservations still release cleanly; pins to it rebind on next use."""
        r = self._by_name.pop(name)
        r.removed = True
        self._replicas.remove(r)
        for i, rep in enumerate(self._replicas):
            rep.index = i

    def update_config(self, cfg: RouterConfig) -> None:
        """New thresholds and TTLs take effect at once; pins, reservations and health states are kept."""
        self.cfg = cfg
        self.session_pins.ttl_s = cfg.pins.session_ttl_s if cfg.pins.ttl_enabled else float("inf")
        self.prefix_pins.ttl_s = cfg.pins.prefix_ttl_s if cfg.pins.ttl_enabled else float("inf")
        for r in self._replicas:
            r.health.cfg = cfg.health
            r.count_wlc = cfg.wlc_enabled
        self._next_due = min((r.health.next_due() for r in self._replicas), default=float("inf"))

    def drain(self, name: str, drained: bool = True) -> None:
        """Operator drain: no new traffic and no pins; in-flight requests finish; scraping goes on."""
        self._by_name[name].drained = drained

    # ------------------------------------------------------------------ inputs

    def _emit(self, t: Transition | None) -> Transition | None:
        if t is not None:
            self.transitions.append(t)
            for fn in self.listeners:
                fn(t)
        return t

    def on_scrape(
        self,
        name: str,
        ok: bool,
        now: float,
        running: int = 0,
        waiting: int = 0,
        kv_usage: float = 0.0,
    ) -> Transition | None:
        """Feed one scrape result. EJECTED replicas are scraped too: it is their only way back (A2)."""
        r = self._by_name.get(name)
        if r is None:
            return None
        if ok:
            r.scraped_running = running
            r.scraped_waiting = waiting
            r.kv_usage = kv_usage
        t = self._emit(r.health.on_scrape(name, ok, now))
        self._next_due = min(self._next_due, r.health.next_due())
        return t

    def on_upstream(self, name: str, ok: bool, now: float) -> Transition | None:
        """Outcome of a user request on ``name`` (B: N consecutive failures eject a LIVE replica)."""
        r = self._by_name.get(name)
        if r is None:
            return None
        t = self._emit(r.health.on_upstream(name, ok, now))
        self._next_due = min(self._next_due, r.health.next_due())
        return t

    def tick(self, now: float) -> list[Transition]:
        """Apply timers: health (clean window, stale scrapes, streak reset), pin TTLs, safety timeouts."""
        out = []
        due = float("inf")
        for r in self._replicas:
            t = r.health.advance(r.name, now)
            if t is not None:
                out.append(self._emit(t))
            d = r.health.next_due()
            if d < due:
                due = d
        self._next_due = due
        if now >= self._housekeeping_at:
            self._housekeeping_at = now + _HOUSEKEEPING_EVERY_S
            self.session_pins.expire(now)
            self.prefix_pins.expire(now)
            self._expire_reservations(now)
        return out

    def _expire_reservations(self, now: float) -> None:
        limit = now - self.cfg.reservation_timeout_s
        res = self._reservations
        while res:
            rid, r = next(iter(res.items()))
            if r.started_at > limit:
                break
            self.release(r, now)
            self.safety_timeouts += 1

    # ---------------------------------------------------------------- pipeline

    def _least_loaded(self, candidates: list[Replica]) -> tuple[Replica, float]:
        """Step 3: minimum effective_running; ties -> round-robin, LIVE before PROBING."""
        min_r = float("inf")
        tied: list[Replica] = []
        for r in candidates:
            er = r.effective_running
            if er < min_r:
                min_r = er
                tied = [r]
            elif er == min_r:
                tied.append(r)
        if len(tied) > 1:
            live_tied = [r for r in tied if r.health.state is LIVE]
            if live_tied:
                tied = live_tied
            n = len(self._replicas)
            rr = self._rr
            best = min(tied, key=lambda r: (r.index - rr) % n)
        else:
            best = tied[0]
        self._rr = best.index + 1
        return best, min_r

    def _candidates(self) -> tuple[list[Replica], bool]:
        """Steps 1-2: the pool (LIVE and PROBING, not drained), narrowed by no-wait.

        Returns the candidates and whether any LIVE replica exists (pins apply only then).
        """
        live: list[Replica] = []
        no_wait: list[Replica] = []
        probing: list[Replica] = []
        for r in self._replicas:
            if r.drained:
                continue
            st = r.health.state
            if st is LIVE:
                live.append(r)
                if r.effective_waiting == 0:
                    no_wait.append(r)
            elif st is PROBING:
                probing.append(r)
        if not live:
            # B: with no LIVE replica the PROBING ones are the pool: no cap, no pins.
            return probing, False
        if not self.cfg.no_wait_enabled:
            return live, True
        if no_wait:
            return no_wait, True
        # B: a PROBING replica is a candidate only when no LIVE one is free of a
        # queue, and then holds at most probing_max_in_flight requests.
        cap = self.cfg.probing_max_in_flight
        return live + [p for p in probing if p.in_flight_requests < cap], True

    def select(self, profile: RequestProfile, now: float) -> Decision:
        """Choose a replica for ``profile`` and reserve its weight (A4 steps 1-5, A1 atomic reserve)."""
        if now >= self._next_due or now >= self._housekeeping_at:
            self.tick(now)

        candidates, any_live = self._candidates()
        if not candidates:
            return self._fallback(profile, now)

        best, min_r = self._least_loaded(candidates)
        if not any_live:
            return Decision(best, LOAD, None, [], self._reserve(best, profile, now), min_r)

        pcfg = self.cfg.pins
        events: list[PinEvent] = []
        chosen = best
        reason = LOAD

        # Step 4: the session pin is looked up before the prefix pin.
        pin_kind = None
        pin: Pin | None = None
        table: PinTable | None = None
        key = None
        if profile.session_key is not None:
            pin = self.session_pins.get(profile.session_key, now)
            if pin is not None:
                pin_kind, table, key = SESSION, self.session_pins, profile.session_key
        if pin is None and profile.prefix_key is not None:
            pin = self.prefix_pins.get(profile.prefix_key, now)
            if pin is not None:
                pin_kind, table, key = PREFIX, self.prefix_pins, profile.prefix_key

        if pin is not None:
            pr = pin.replica
            slack = pcfg.session_slack if pin_kind == SESSION else pcfg.prefix_slack
            if pr.removed or pr.drained or pr.health.state is not LIVE:
                # A pin to a dead, drained or PROBING replica never blocks distribution.
                self._move_pin(table, key, pin, best, now, events, Cause.DEAD)
            elif not pcfg.spill_enabled or (pr.effective_waiting == 0 and pr.effective_running <= min_r + slack):
                # (spill_enabled off is the seed's removed "never rebind": the pin holds whatever the load)
                chosen = pr
                reason = AFFINITY
                pin.spills = 0
                table.touch(key, pin, now)
            elif pr is best:
                table.touch(key, pin, now)  # not usable, but least-loaded chose it anyway: no spill
            else:
                table.touch(key, pin, now)
                if pcfg.spill_enabled:
                    pin.spills += 1
                    events.append(PinEvent(PinAction.SPILL, pin_kind))
                    gap = pr.effective_running - min_r
                    if pin_kind == PREFIX and pin.spills >= pcfg.prefix_spills_to_delete:
                        # A shared system prompt must not hold a hot replica.
                        table.delete(key)
                        events.append(PinEvent("unpin", PREFIX, Cause.SPILLS))
                    elif gap >= pcfg.force_rebind_gap:
                        self._move_pin(table, key, pin, best, now, events, Cause.FORCE)
                    elif pin_kind == SESSION and pin.spills >= pcfg.session_spills_to_rebind:
                        self._move_pin(table, key, pin, best, now, events, Cause.SPILLS)

        # B: each key without a live pin is pinned to the chosen replica (never a PROBING one).
        if chosen.health.state is LIVE:
            if profile.session_key is not None and pin_kind != SESSION:
                if self.session_pins.get(profile.session_key, now) is None:
                    self.session_pins.put(profile.session_key, chosen, now)
                    events.append(PinEvent(PinAction.PIN, SESSION, Cause.NEW))
            if profile.prefix_key is not None and pin_kind != PREFIX:
                ppin = self.prefix_pins.get(profile.prefix_key, now)
                if ppin is None:
                    self.prefix_pins.put(profile.prefix_key, chosen, now)
                    events.append(PinEvent(PinAction.PIN, PREFIX, Cause.NEW))
                elif ppin.replica is chosen:
                    self.prefix_pins.touch(profile.prefix_key, ppin, now)

        return Decision(chosen, reason, pin_kind, events, self._reserve(chosen, profile, now), min_r)

    def _move_pin(
        self,
        table: PinTable,
        key: bytes,
        pin: Pin,
        target: Replica,
        now: float,
        events: list[PinEvent],
        cause: Cause,
    ) -> None:
        """Rebind to ``target``; a PROBING target takes no pin, so the pin is dropped instead."""
        if target.health.state is LIVE and not target.drained:
            pin.replica = target
            pin.spills = 0
            table.touch(key, pin, now)
            events.append(PinEvent(PinAction.REBIND, table.kind, cause))
        else:
            table.delete(key)
            events.append(PinEvent(PinAction.UNPIN, table.kind, cause))

    def _fallback(self, profile: RequestProfile, now: float) -> Decision:
        """Step 5: nothing LIVE or PROBING -> a random known replica; nothing known -> no_healthy_instances."""
        known = [r for r in self._replicas if not r.drained]
        if not known:
            return Decision(None, NO_HEALTHY)
        r = self._random.choice(known)
        return Decision(r, FALLBACK, None, [], self._reserve(r, profile, now))

    # ------------------------------------------------------------ reservations

    def weight_milli(self, tokens: int) -> int:
        """B: weight = max(1, prompt_tokens_estimate / unit), in thousandths."""
        return max(1000, tokens * 1000 // self.cfg.token_weight_unit)

    def _reserve(self, r: Replica, profile: RequestProfile, now: float) -> Reservation:
        w = self.weight_milli(profile.tokens)
        res = Reservation(self._next_reservation_id, r, w, now)
        self._next_reservation_id += 1
        r.wlc_milli += w
        r.in_flight_requests += 1
        self._reservations[res.id] = res
        return res

    def release(self, res: Reservation | None, now: float) -> bool:
        """End a reservation (success, error, disconnect, reset). Idempotent: True only the first time."""
        if res is None or res.released:
            return False
        res.released = True
        r = res.replica
        r.wlc_milli -= res.weight_milli
        r.in_flight_requests -= 1
        self._reservations.pop(res.id, None)
        return True

    def reservation(self, rid: int) -> Reservation | None:
        """The open reservation with id ``rid`` (None once released)."""
        return self._reservations.get(rid)

    @property
    def open_reservations(self) -> int:
        return len(self._reservations)

    # ------------------------------------------------------------------- views

    def snapshot(self) -> list[dict]:
        """Replica table for admin views and the demo (O(pins): not for the request path)."""
        s = self.session_pins.count_by_replica()
        p = self.prefix_pins.count_by_replica()
        out = []
        for r in self._replicas:
            d = r.snapshot()
            d["session_pins"] = s.get(r.name, 0)
            d["prefix_pins"] = p.get(r.name, 0)
            out.append(d)
        return out


__all__ = [
    "AFFINITY",
    "LOAD",
    "FALLBACK",
    "NO_HEALTHY",
    "Decision",
    "PinEvent",
    "Reservation",
    "Router",
    "State",
    "LIVE",
    "PROBING",
    "EJECTED",
]
