"""The seed's pipeline (SPEC A3-A4 steps 2-4, B) as a policy: no-wait filter -> least-loaded -> pin override.

``routing.policy: seed`` is Parts A+B exactly. Its ablations are the same composition with a stage
removed (``make_policy("seed_no_spill")`` ...), never flags in the production config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .config import RouterConfig
from .decision import Decision, FleetView, PinEvent
from .names import Cause, Hold, PinAction, Reason
from .pins import PREFIX, SESSION, Pin, PinTable
from .policy_base import Policy
from .profile import RequestProfile
from .replica import LIVE, Replica

if TYPE_CHECKING:
    from .load import LoadSample

_INF = float("inf")


class SeedPolicy(Policy):
    """Stages: ``no_wait`` filter (step 2), least ``effective_running`` (step 3, with ``wlc`` or
    scraped running only), session-then-prefix pin override with TTL and spills (step 4, A3)."""

    needs_blocks = False
    parse_max_bytes = None  # B: every body up to profile.max_body_bytes is parsed (the prefix key needs it)

    def __init__(self, cfg: RouterConfig, name: str = "seed", *, no_wait: bool = True, wlc: bool = True,
                 pin_ttl: bool = True, spill: bool = True):
        self.name = name
        self.no_wait = no_wait
        self.wlc = wlc
        self.pin_ttl = pin_ttl
        self.spill = spill  # off: a pin holds whenever its replica is LIVE, whatever the load ("never rebind")
        self.session_pins = PinTable(SESSION, _INF)
        self.prefix_pins = PinTable(PREFIX, _INF)
        self._rr = 0  # round-robin pointer over replica indices (A4 step 3 ties)
        self.outbox = None  # shared state: pins and reservations are shared by the router (core.shared)
        self.update_config(cfg)

    def update_config(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.session_pins.ttl_s = cfg.pins.session_ttl_s if self.pin_ttl else _INF
        self.prefix_pins.ttl_s = cfg.pins.prefix_ttl_s if self.pin_ttl else _INF
        self.session_pins.max_pins = self.prefix_pins.max_pins = cfg.pins.max_pins

    def configure(self, r: Replica) -> None:
        r.count_wlc = self.wlc

    def pin_tables(self) -> tuple[PinTable, ...]:
        return (self.session_pins, self.prefix_pins)

    def expire(self, now: float) -> None:
        self.session_pins.expire(now)
        self.prefix_pins.expire(now)

    def on_release(self, res, now: float) -> None:
        pass

    def on_load(self, r: Replica, s: "LoadSample", now: float) -> None:
        pass

    def on_health(self, r: Replica, ejected: bool) -> None:
        pass

    def forget(self, name: str) -> None:
        pass

    # ------------------------------------------------------------------ stages

    def _least_loaded(self, fleet: FleetView, candidates: list[Replica]) -> tuple[Replica, float]:
        """Step 3: minimum effective_running; ties -> round-robin, LIVE before PROBING."""
        min_r = _INF
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
            n = len(fleet.replicas_view)
            rr = self._rr
            best = min(tied, key=lambda r: (r.index - rr) % n)
        else:
            best = tied[0]
        self._rr = best.index + 1
        return best, min_r

    def _candidates(self, live: list[Replica], probing: list[Replica]) -> list[Replica]:
        """Step 2 (no-wait) over the pool, with B's PROBING rule."""
        if not self.no_wait:
            return live
        no_wait = [r for r in live if r.effective_waiting == 0]
        if no_wait:
            return no_wait
        # B: a PROBING replica is a candidate only when no LIVE one is free of a queue, and then holds at
        # most probing_max_in_flight requests.
        cap = self.cfg.probing_max_in_flight
        return live + [p for p in probing if p.in_flight_requests < cap]

    def select(self, fleet: FleetView, profile: RequestProfile, now: float, hold: Hold = Hold.NEVER) -> Decision | None:
        live, probing = fleet.pool()
        if not live:
            if not probing:
                return None
            # B: with no LIVE replica the PROBING ones are the pool: no cap, no pins.
            best, min_r = self._least_loaded(fleet, probing)
            return Decision(best, Reason.LOAD, None, [])
        candidates = self._candidates(live, probing)
        best, min_r = self._least_loaded(fleet, candidates)

        pcfg = self.cfg.pins
        events: list[PinEvent] = []
        chosen = best
        reason = Reason.LOAD

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

        if pin is not None and table is not None and key is not None and pin_kind is not None:
            pr = pin.replica
            slack = pcfg.session_slack if pin_kind == SESSION else pcfg.prefix_slack
            if pr.removed or pr.drained or pr.health.state is not LIVE:
                # A pin to a dead, drained or PROBING replica never blocks distribution.
                _move_pin(table, key, pin, best, now, events, Cause.DEAD)
            elif not self.spill or (pr.effective_waiting == 0 and pr.effective_running <= min_r + slack):
                chosen = pr
                reason = Reason.AFFINITY
                pin.spills = 0
                table.touch(key, pin, now)
            elif pr is best:
                table.touch(key, pin, now)  # not usable, but least-loaded chose it anyway: no spill
            else:
                table.touch(key, pin, now)
                pin.spills += 1
                events.append(PinEvent(PinAction.SPILL, pin_kind))
                gap = pr.effective_running - min_r
                if pin_kind == PREFIX and pin.spills >= pcfg.prefix_spills_to_delete:
                    # A shared system prompt must not hold a hot replica.
                    table.delete(key)
                    events.append(PinEvent(PinAction.UNPIN, PREFIX, Cause.SPILLS))
                elif gap >= pcfg.force_rebind_gap:
                    _move_pin(table, key, pin, best, now, events, Cause.FORCE)
                elif pin_kind == SESSION and pin.spills >= pcfg.session_spills_to_rebind:
                    _move_pin(table, key, pin, best, now, events, Cause.SPILLS)

        # B: each key without a live pin is pinned to the chosen replica (never a PROBING one).
        if chosen.health.state is LIVE:
            if profile.session_key is not None and pin_kind != SESSION and \
                    self.session_pins.get(profile.session_key, now) is None:
                self.session_pins.put(profile.session_key, chosen, now)
                events.append(PinEvent(PinAction.PIN, SESSION, Cause.NEW))
            if profile.prefix_key is not None and pin_kind != PREFIX:
                ppin = self.prefix_pins.get(profile.prefix_key, now)
                if ppin is None:
                    self.prefix_pins.put(profile.prefix_key, chosen, now)
                    events.append(PinEvent(PinAction.PIN, PREFIX, Cause.NEW))
                elif ppin.replica is chosen:
                    self.prefix_pins.touch(profile.prefix_key, ppin, now)

        return Decision(chosen, reason, pin_kind, events)

    def on_reserved(self, d: Decision, profile: RequestProfile, now: float) -> None:
        pass

    def on_remote_reserved(self, res, prefill_s: float, prompt_tokens: int, session_key, prompt: int,
                           at: float, now: float, estimated: int | None = None, shared=None) -> None:
        pass  # another brain's request counts in the replica's in-flight weight, which the router keeps

def _move_pin(table: PinTable, key: bytes, pin: Pin, target: Replica, now: float, events: list, cause: Cause) -> None:
    """Rebind to ``target``; a PROBING (or drained) target takes no pin, so the pin is dropped instead."""
    if target.health.state is LIVE and not target.drained:
        table.move(pin, target)
        pin.spills = 0
        table.touch(key, pin, now)
        events.append(PinEvent(PinAction.REBIND, table.kind, cause))
    else:
        table.delete(key)
        events.append(PinEvent(PinAction.UNPIN, table.kind, cause))


SEED_VARIANTS = {
    "seed": {},
    "seed_no_pin_ttl": {"pin_ttl": False},
    "seed_no_spill": {"spill": False},
    "seed_no_wlc": {"wlc": False},
    "seed_no_no_wait": {"no_wait": False},
    "seed_pins_forever": {"pin_ttl": False, "spill": False},  # the seed's first version (incident 1)
}

__all__ = ["SeedPolicy", "SEED_VARIANTS"]
