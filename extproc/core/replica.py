"""Per-replica signals (SPEC A1) and the health state machine (SPEC A2, B).

Nothing here reads a clock: every call that depends on time takes ``now``
(seconds, any monotonic origin).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .config import HealthConfig

_NEVER = float("-inf")


class State(enum.StrEnum):
    LIVE = "LIVE"
    PROBING = "PROBING"
    EJECTED = "EJECTED"


LIVE, PROBING, EJECTED = State.LIVE, State.PROBING, State.EJECTED


@dataclass(frozen=True, slots=True)
class Transition:
    """One health state change, for logs, metrics and the simulator's timeline."""

    replica: str
    old: State
    new: State
    reason: str
    at: float
    cooldown_s: float = 0.0  # set when new is EJECTED
    streak: int = 0


class HealthMachine:
    """LIVE / PROBING / EJECTED, driven by scrapes and upstream outcomes only.

    Recovery never uses a user's request as the probe (A2): only
    ``on_scrape(ok=True)`` moves EJECTED towards PROBING.
    """

    __slots__ = (
        "cfg",
        "state",
        "entered_at",
        "cooldown_until",
        "streak",
        "good_scrapes",
        "upstream_failures",
        "last_scrape_ok_at",
        "served_at",
        "ejections",
        "ejected_passively",
    )

    def __init__(self, cfg: HealthConfig, now: float):
        self.cfg = cfg
        # B (start-up): a replica starts EJECTED without cooldown, so it must
        # earn 2 good scrapes and the clean window before it takes pins.
        self.state = EJECTED
        self.entered_at = now
        self.cooldown_until = now
        self.streak = 0
        self.good_scrapes = 0
        self.upstream_failures = 0
        self.last_scrape_ok_at = _NEVER
        self.served_at = _NEVER  # a user's request last succeeded there (or had its first token), as Envoy saw it
        self.ejections = 0
        self.ejected_passively = False  # the last ejection came from users' requests, not from scrapes

    @property
    def cooldown_s(self) -> float:
        """Cooldown of the current streak (0 when the streak is reset)."""
        return self.cfg.cooldown_s(self.streak)

    def _move(self, name: str, new: State, reason: str, now: float) -> Transition:
        old = self.state
        self.state = new
        self.entered_at = now
        if new is EJECTED:
            return Transition(name, old, new, reason, now, self.cooldown_s, self.streak)
        return Transition(name, old, new, reason, now)

    def _eject(self, name: str, reason: str, now: float) -> Transition:
        if self.state is LIVE and now - self.entered_at >= self.cfg.streak_reset_live_s:
            self.streak = 0  # the streak resets only after 600 s of continuous LIVE
        self.streak += 1
        self.ejections += 1
        self.cooldown_until = now + self.cfg.cooldown_s(self.streak)
        self.good_scrapes = 0
        self.upstream_failures = 0
        self.ejected_passively = reason.startswith("upstream")
        return self._move(name, EJECTED, reason, now)

    def on_scrape(self, name: str, ok: bool, now: float, slow: bool = False) -> Transition | None:
        """A scrape finished at ``now``. EJECTED replicas keep being scraped: it is their only way back. ``slow``:
        it failed by running out of time (a refusal, an error status or a page that does not parse is no slowness)."""
        if not ok:
            self.good_scrapes = 0
            if self.state is EJECTED or (slow and self.busy(now)):
                return None
            return self._eject(name, "scrape_failed", now)
        self.last_scrape_ok_at = now
        if self.state is EJECTED:
            if now < self.cooldown_until:
                # A2: the 2 good scrapes count only after the cooldown.
                self.good_scrapes = 0
                return None
            self.good_scrapes += 1
            if self.good_scrapes >= self.cfg.good_scrapes_to_probe:
                self.good_scrapes = 0
                return self._move(name, PROBING, "good_scrapes", now)
            return None
        return self.advance(name, now)

    def would_eject(self, ok: bool) -> bool:
        """Whether this outcome would eject the replica (on_upstream's rule, without applying it)."""
        if ok:
            return False
        return self.state is PROBING or (
            self.state is LIVE and self.upstream_failures + 1 >= self.cfg.upstream_failures_to_eject)

    def on_upstream(self, name: str, ok: bool, now: float, may_eject: bool = True) -> Transition | None:
        """Outcome of a user request as seen by Envoy (a failure of the replica = not ok). With ``may_eject``
        false the failure is not counted against it and the replica stays: the fleet's share of passive
        ejections is spent (the router counts the refusal)."""
        if ok:
            self.upstream_failures = 0
            return None
        if not may_eject:
            return None
        if self.state is PROBING:
            return self._eject(name, "upstream_failure", now)  # A2: any failure while PROBING
        if self.state is LIVE:
            self.upstream_failures += 1
            if self.upstream_failures >= self.cfg.upstream_failures_to_eject:
                return self._eject(name, "upstream_failures", now)
        return None

    def advance(self, name: str, now: float) -> Transition | None:
        """Apply the timers: stale scrapes eject; a clean PROBING window promotes to LIVE."""
        st = self.state
        if st is EJECTED:
            return None
        if now > self.fresh_until() and not self.busy(now):
            return self._eject(name, "stale_scrape", now)
        if st is PROBING:
            if now - self.entered_at >= self.cfg.probing_clean_window_s:
                return self._move(name, LIVE, "clean_window", now)
        elif self.streak and now - self.entered_at >= self.cfg.streak_reset_live_s:
            self.streak = 0
        return None

    def fresh_until(self) -> float:
        """When the last good scrape goes stale (B's stale rule; -inf for a replica not yet scraped well)."""
        return self.last_scrape_ok_at + self.stale_s

    @property
    def stale_s(self) -> float:
        """B: a scrape older than 3 intervals counts as failed."""
        return self.cfg.stale_scrape_intervals * self.cfg.scrape_interval_s

    def served(self, now: float) -> None:
        """The replica answered a user's request at ``now`` (Envoy saw its response, or a stream's first token).
        Not every success counts: a client that gave up on a hung replica is no failure of it, and no answer."""
        self.served_at = max(self.served_at, now)

    def busy(self, now: float) -> bool:
        """Busy, not dead: a LIVE replica whose users' requests succeed keeps its place while its /metrics answers
        late or not at all, for as long as a scrape could stay fresh since the last success (B's stale window). On
        three CPU vLLMs in overload (`python -m bench real`) each API server let a scrape wait past 9 s while its
        engine served: one replica ejected a run, its sessions moved ("dead") and the other two took its load. One
        that serves nobody either goes at the stale rule; a refused scrape, an error status or a page that does not
        parse eject at once, busy or not."""
        return self.state is LIVE and now - self.served_at <= self.stale_s

    def scrape_deadline(self, now: float, floor: float) -> float:
        """How long a health scrape begun at ``now`` waits for its answer (B, "one failed scrape (timeout, ...)"):
        a LIVE replica's, until its last good scrape goes stale, or while it is ``busy`` until its last answer to a
        user is as old (the stale rule ejects it then, answer or not);
        any other's, ``floor`` (A2: any scrape failure while PROBING sends it back, and the way back stays the
        stricter). Ended at 0.8 of an interval, a vLLM API server busy with its requests ejected healthy replicas:
        on three CPU engines (`python -m bench real`) two at once, every new session then held behind the third
        (p99 27-35 s), and once all three (95 of 212 requests sent to a random replica). A refused connection, an
        error status or a page that does not parse still eject at once."""
        if self.state is not LIVE:
            return floor
        # a busy replica's scrape may wait as long as the replica stays LIVE without one
        return max(floor, self.fresh_until() - now, self.served_at + self.stale_s - now)

    def next_due(self) -> float:
        """Earliest time at which ``advance`` may change something."""
        st = self.state
        if st is EJECTED:
            return float("inf")
        due = self.fresh_until()
        if st is LIVE:  # stale and busy: checked again when the last success is as old as a stale scrape
            due = max(due, self.served_at + self.stale_s)
        if st is PROBING:
            due = min(due, self.entered_at + self.cfg.probing_clean_window_s)
        elif self.streak:
            due = min(due, self.entered_at + self.cfg.streak_reset_live_s)
        return due


class Replica:
    """What the router knows of one replica: scraped load, its own in-flight work, health, drain."""

    __slots__ = (
        "name",
        "index",
        "health",
        "drained",
        "removed",
        "scraped_running",
        "scraped_waiting",
        "kv_usage",
        "engine_cached_tokens",
        "wlc_milli",
        "in_flight_requests",
        "count_wlc",
        "pool_selects",
        "pool_since",
        "role",
    )

    def __init__(self, name: str, index: int, health: HealthMachine, count_wlc: bool = True):
        self.name = name
        self.index = index
        self.health = health
        self.drained = False
        self.removed = False
        self.scraped_running = 0
        self.scraped_waiting = 0
        self.kv_usage = 0.0
        # the engine's prefix-cache hits (tokens) since it started, as last scraped (None: not exported): against
        # the cached tokens routing predicted, the engine's word on what its cache really held
        self.engine_cached_tokens: float | None = None
        # Token weights are kept in thousandths as an int so that releasing
        # every reservation brings wlc_in_flight back to exactly 0.
        self.wlc_milli = 0
        self.in_flight_requests = 0
        self.count_wlc = count_wlc
        # prefill/decode disaggregation: "prefill" takes prefill legs only, never a client's request (ROLES)
        self.role = "both"
        # decisions made while this replica could have been chosen (LIVE or PROBING, not drained), kept as the
        # router's decision count when it entered the pool (None: out) plus those of its earlier stays there;
        # a replica that takes little traffic says from this whether it was passed over or out of the pool
        self.pool_selects = 0
        self.pool_since: int | None = None

    @property
    def state(self) -> State:
        return self.health.state

    @property
    def wlc_in_flight(self) -> float:
        """Sum of token weights of this router's unfinished requests on the replica (A1, B)."""
        return self.wlc_milli / 1000

    @property
    def effective_running(self) -> float:
        """A1: max(scraped_num_running, wlc_in_flight)."""
        if not self.count_wlc:
            return self.scraped_running
        w = self.wlc_milli / 1000
        r = self.scraped_running
        return w if w > r else r

    @property
    def effective_waiting(self) -> float:
        """A1: scraped_num_waiting + max(0, wlc_in_flight - scraped_num_running)."""
        if not self.count_wlc:
            return self.scraped_waiting
        extra = self.wlc_milli / 1000 - self.scraped_running
        return self.scraped_waiting + (extra if extra > 0 else 0)

    def snapshot(self) -> dict:
        h = self.health
        return {
            "name": self.name,
            "state": h.state.value,
            "drained": self.drained,
            "role": self.role,
            "effective_running": self.effective_running,
            "effective_waiting": self.effective_waiting,
            "wlc_in_flight": self.wlc_in_flight,
            "in_flight_requests": self.in_flight_requests,
            "scraped_running": self.scraped_running,
            "scraped_waiting": self.scraped_waiting,
            "kv_usage": self.kv_usage,
            "cooldown_s": h.cooldown_s,
            "cooldown_until": h.cooldown_until,
            "streak": h.streak,
            "ejections": h.ejections,
        }
