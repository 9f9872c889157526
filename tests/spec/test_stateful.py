"""hypothesis.stateful machines for the health machine and for the router with its pin tables."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from extproc.core import (
    EJECTED,
    FALLBACK,
    LIVE,
    PROBING,
    HealthConfig,
    HealthMachine,
    Router,
    RouterConfig,
)

from ..helpers import chain, names, prof

SETTINGS = settings(max_examples=80, stateful_step_count=100, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


class HealthMachineRules(RuleBasedStateMachine):
    """Random scrapes, upstream outcomes and time; the SPEC A2 invariants must hold throughout."""

    def __init__(self):
        super().__init__()
        self.cfg = HealthConfig()
        self.h = HealthMachine(self.cfg, 0.0)
        self.now = 0.0
        self.cooldowns: list[float] = []
        self.good_after_cooldown = 0  # consecutive good scrapes after the cooldown (model)
        self.probing_since: float | None = None

    def _observe(self, before, t):
        if t is None:
            return
        assert t.old is before
        if t.new is EJECTED:
            self.cooldowns.append(self.h.cooldown_until - self.now)
            self.probing_since = None
            self.good_after_cooldown = 0
        if t.new is PROBING:
            # A2: only 2 good scrapes after the cooldown move EJECTED -> PROBING
            assert before is EJECTED and t.reason == "good_scrapes"
            assert self.good_after_cooldown >= self.cfg.good_scrapes_to_probe
            self.probing_since = self.now
        if t.new is LIVE:
            assert before is PROBING
            assert self.now - self.probing_since >= self.cfg.probing_clean_window_s

    @rule(dt=st.sampled_from([0.5, 1.0, 3.0, 3.0, 3.0, 10.0, 40.0]), ok=st.booleans() | st.just(True))
    def scrape(self, dt, ok):
        self.now += dt
        before = self.h.state
        if before is EJECTED:
            self.good_after_cooldown = self.good_after_cooldown + 1 if ok and self.now >= self.h.cooldown_until else 0
        self._observe(before, self.h.advance("r", self.now) if before is not EJECTED else None)
        before = self.h.state
        self._observe(before, self.h.on_scrape("r", ok, self.now))
        if self.h.state is PROBING:
            self.good_after_cooldown = 0

    @rule(ok=st.booleans())
    def upstream(self, ok):
        before = self.h.state
        t = self.h.on_upstream("r", ok, self.now)
        if ok or before is EJECTED:
            assert t is None and self.h.state is before  # a user's request never recovers a replica
        self._observe(before, t)

    @rule(dt=st.sampled_from([1.0, 5.0, 15.0, 100.0, 700.0]))
    def wait(self, dt):
        self.now += dt
        before = self.h.state
        self._observe(before, self.h.advance("r", self.now))

    @invariant()
    def cooldown_follows_30_60_120_240_300(self):
        for c in self.cooldowns:
            assert c in (30.0, 60.0, 120.0, 240.0, 300.0)
        assert self.h.cooldown_s == min(300.0,
                                        30.0 * 2 ** (self.h.streak - 1)) if self.h.streak else self.h.cooldown_s == 0


TestHealthMachine = HealthMachineRules.TestCase
TestHealthMachine.settings = SETTINGS


def test_cooldown_sequence_is_30_60_120_240_300_300_from_a_flapping_replica():
    h = HealthMachine(HealthConfig(), 0.0)
    t = 0.0
    seq = []
    for _ in range(6):
        t = max(t, h.cooldown_until)
        h.on_scrape("r", True, t)
        h.on_scrape("r", True, t + 3)
        h.on_upstream("r", False, t + 4)  # any 5xx while PROBING
        seq.append(h.cooldown_until - (t + 4))
        t += 4
    assert seq == [30, 60, 120, 240, 300, 300]


class RouterRules(RuleBasedStateMachine):
    """The router under random traffic, scrapes, failures, drains and time."""

    N = 4

    def __init__(self):
        super().__init__()
        self.now = 0.0
        self.router = Router(RouterConfig(seed=5, policy="seed"), names(self.N), 0.0)
        self.open = []

    @initialize(warm=st.booleans())
    def start(self, warm):
        if warm:  # start from an all-LIVE fleet half the time
            for k in range(7):
                self.now = 3.0 * k
                for n in names(self.N):
                    self.router.on_scrape(n, True, self.now)

    @rule(
        session=st.none() | st.sampled_from(["a", "b", "c", "d", "e"]),
        prefix=st.none() | st.sampled_from(["sys1", "sys2"]),
        tokens=st.sampled_from([0, 500, 1500, 8000, 100_000]),
    )
    def select(self, session, prefix, tokens):
        r = self.router
        self.now += 0.001  # so that "touched now" means "touched by this decision"
        d = r.select(self.profile(session, prefix, tokens), self.now)
        # state as select saw it (it may run timers first)
        routable = [x for x in r.replicas if not x.drained and x.state in (LIVE, PROBING)]
        if d.replica is None:
            assert not [x for x in r.replicas if not x.drained]
            return
        self.open.append(d.reservation)
        assert not d.replica.drained
        if routable:
            # an EJECTED replica is never chosen while a LIVE or PROBING one exists
            assert d.replica.state in (LIVE, PROBING)
            assert d.reason != FALLBACK
            self.check_choice(d)
        else:
            assert d.reason == FALLBACK
        if d.replica.state is PROBING and any(x.state is LIVE for x in routable):
            assert d.replica.in_flight_requests <= r.cfg.probing_max_in_flight
        # every pin touched or created now points to a LIVE, undrained replica
        for table in (r.session_pins, r.prefix_pins):
            for _, pin in table:
                if pin.last_used == self.now:
                    assert pin.replica.state is LIVE and not pin.replica.drained

    def profile(self, session, prefix, tokens):
        return prof(session=session, prefix=prefix, tokens=tokens)

    def check_choice(self, d):
        pass

    @precondition(lambda self: self.open)
    @rule(i=st.integers(0, 1000), twice=st.booleans())
    def release(self, i, twice):
        res = self.open.pop(i % len(self.open))
        first = not res.released  # the safety timeout may have released it already
        assert self.router.release(res, self.now) is first
        if twice:
            assert self.router.release(res, self.now) is False

    @rule(
        i=st.integers(0, N - 1),
        ok=st.booleans() | st.just(True) | st.just(True),
        running=st.integers(0, 6),
        waiting=st.integers(0, 2) | st.just(0),
    )
    def scrape(self, i, ok, running, waiting):
        self.router.on_scrape(f"r{i}", ok, self.now, running=running, waiting=waiting)

    @rule()
    def scrape_all_ok(self):
        for n in names(self.N):
            self.router.on_scrape(n, True, self.now)

    @rule(
        oks=st.lists(st.sampled_from([True, True, True, True, False]), min_size=N, max_size=N),
        queued=st.booleans(),
    )
    def scrape_round(self, oks, queued):
        """3 s pass and every replica is scraped, as the scraper does; ``queued`` gives LIVE ones a queue
        (the path where PROBING replicas become candidates, SPEC B)."""
        self.now += 3.0
        self.router.tick(self.now)
        for rep, ok in zip(self.router.replicas, oks):
            q = queued and rep.state is LIVE
            self.router.on_scrape(rep.name, ok, self.now, running=2 if q else 0, waiting=1 if q else 0)

    @rule(i=st.integers(0, N - 1), ok=st.booleans())
    def upstream(self, i, ok):
        self.router.on_upstream(f"r{i}", ok, self.now)

    @rule(i=st.integers(0, N - 1), on=st.booleans())
    def drain(self, i, on):
        self.router.drain(f"r{i}", on)

    @rule(dt=st.sampled_from([0.1, 1.0, 3.0, 3.0, 16.0, 301.0]))
    def wait(self, dt):
        self.now += dt
        self.router.tick(self.now)

    @invariant()
    def wlc_in_flight_is_the_sum_of_open_reservations(self):
        for rep in self.router.replicas:
            mine = [res for res in self.open if res.replica is rep and not res.released]
            assert rep.wlc_milli == sum(res.weight_milli for res in mine)
            assert rep.in_flight_requests == len(mine)

    @invariant()
    def pins_point_only_at_known_replicas(self):
        known = set(self.router.replicas)
        for table in (self.router.session_pins, self.router.prefix_pins):
            for _, pin in table:
                assert pin.replica in known

    @invariant()
    def pin_counts_per_replica_match_the_pins(self):
        """/state reads the kept counts (issue 11 #9): they must equal a walk over the table."""
        for table in (self.router.session_pins, self.router.prefix_pins):
            walk: dict[str, int] = {}
            for _, pin in table:
                walk[pin.replica.name] = walk.get(pin.replica.name, 0) + 1
            assert table.count_by_replica() == walk

    def teardown(self):
        for res in self.open:
            self.router.release(res, self.now)
        for rep in self.router.replicas:
            assert rep.wlc_in_flight == 0  # exactly 0 once every reservation is released
            assert rep.in_flight_requests == 0
        assert self.router.open_reservations == 0


TestRouter = RouterRules.TestCase
TestRouter.settings = SETTINGS


class WarmRouterRules(RouterRules):
    """The same machine on the cost-based policy: the fleet's guarantees hold whichever policy chooses."""

    def __init__(self):
        super().__init__()
        self.router = Router(RouterConfig(seed=5, policy="warm"), names(self.N), 0.0)

    def profile(self, session, prefix, tokens):
        return prof(session=session, prefix=prefix, tokens=tokens, blocks=chain(prefix or "none", session, tokens))

    def check_choice(self, d):
        assert d.predicted_ttft_s is not None and d.predicted_ttft_s >= 0

    @invariant()
    def predicted_work_in_flight_is_never_negative(self):
        for rep in self.router.replicas:
            assert self.router.policy.state_of(rep).work_s >= -1e-9


TestWarmRouter = WarmRouterRules.TestCase
TestWarmRouter.settings = SETTINGS
