"""One table test per numbered rule of SPEC.md Parts A and B. Test names use the rule's own words.

Parts A+B are ``routing.policy: seed`` (SPEC C8), so every router here runs it; the fleet-level rules
(health, pool, fallback, drain, reservations) are the same under any policy, and the cost-based
policy's own rules are in tests/core/test_warm.py.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

from extproc.core import (
    AFFINITY,
    EJECTED,
    FALLBACK,
    LIVE,
    LOAD,
    NO_HEALTHY,
    PROBING,
    HealthConfig,
    HealthMachine,
    PinTable,
    Replica,
    Router,
    RouterConfig,
    imbalance_index,
)

from ..helpers import live_router, names, prof, scrape_all, scrape_until

RouterConfig = functools.partial(RouterConfig, policy="seed")  # noqa: F811 - Parts A+B are the seed policy
NO_STALE = RouterConfig(health=HealthConfig(stale_scrape_intervals=1e9))


def events_of(d) -> list[str]:
    return [f"{e.action}:{e.kind}" + (f":{e.cause}" if e.cause else "") for e in d.events]


# ----------------------------------------------------------------------------- A1


@pytest.mark.parametrize(
    "running,waiting,wlc,eff_running,eff_waiting",
    [
        (0, 0, 0, 0, 0),
        (2, 0, 1, 2, 0),  # the scrape already sees more than we sent
        (1, 0, 3, 3, 2),  # 2 of ours are not in the scrape yet: they count as waiting
        (2, 1, 5, 5, 4),
        (5, 3, 0, 5, 3),
        (0, 0, 1.5, 1.5, 1.5),
    ],
)
def test_A1_effective_running_and_effective_waiting(running, waiting, wlc, eff_running, eff_waiting):
    r = Replica("r0", 0, HealthMachine(HealthConfig(), 0.0))
    r.scraped_running, r.scraped_waiting, r.wlc_milli = running, waiting, int(wlc * 1000)
    assert r.effective_running == eff_running
    assert r.effective_waiting == eff_waiting


@pytest.mark.parametrize(
    "tokens,weight",
    [(0, 1.0), (999, 1.0), (1000, 1.0), (1500, 1.5), (100_000, 100.0), (256_000, 256.0)],
)
def test_B_token_weight_is_max_1_tokens_over_1000(tokens, weight):
    router, t = live_router(1)
    d = router.select(prof(tokens=tokens), t)
    assert router.replica("r0").wlc_in_flight == weight
    router.release(d.reservation, t)
    assert router.replica("r0").wlc_in_flight == 0


def test_A1_wlc_in_flight_weighted_by_tokens_100k_weighs_100x_1k():
    router, t = live_router(2)
    heavy = router.select(prof(tokens=100_000), t)
    light = router.select(prof(tokens=1_000), t)
    assert heavy.replica is not light.replica
    assert heavy.replica.wlc_in_flight == 100 * light.replica.wlc_in_flight


def test_A1_atomic_reservation_burst_between_scrapes_spreads():
    router, t = live_router(4)
    chosen = [router.select(prof(), t).replica_name for _ in range(4)]
    assert sorted(chosen) == names(4)


def test_A1_reservation_counts_against_the_next_choice_before_any_scrape():
    router, t = live_router(2)
    first = router.select(prof(tokens=5_000), t)  # weight 5
    for _ in range(4):  # four light requests all fit on the other replica before loads equalise
        assert router.select(prof(), t).replica is not first.replica


# ----------------------------------------------------------------------------- A2


def test_B_startup_replica_starts_ejected_without_cooldown():
    router = Router(RouterConfig(), ["r0"], 0.0)
    r = router.replica("r0")
    assert r.state is EJECTED and r.health.cooldown_s == 0
    router.on_scrape("r0", True, 0.0)
    assert r.state is EJECTED  # one good scrape is not enough (hysteresis)
    router.on_scrape("r0", True, 3.0)
    assert r.state is PROBING


def test_A2_ejected_to_probing_after_cooldown_on_2_successful_scrapes():
    router, t = live_router(2)
    router.on_scrape("r0", False, t)
    r0 = router.replica("r0")
    assert r0.state is EJECTED and r0.health.cooldown_until == t + 30
    # good scrapes during the cooldown do not count
    for k in range(1, 10):
        router.on_scrape("r0", True, t + 3 * k)
        assert r0.state is EJECTED
    router.on_scrape("r0", True, t + 30)
    assert r0.state is EJECTED
    router.on_scrape("r0", True, t + 33)
    assert r0.state is PROBING


def test_A2_a_failed_scrape_resets_the_good_scrape_count():
    h = HealthMachine(HealthConfig(), 0.0)
    h.on_scrape("r", True, 0.0)
    h.on_scrape("r", False, 3.0)
    h.on_scrape("r", True, 6.0)
    assert h.state is EJECTED
    h.on_scrape("r", True, 9.0)
    assert h.state is PROBING


def test_A2_probing_to_live_after_15s_clean_window():
    h = HealthMachine(HealthConfig(), 0.0)
    h.on_scrape("r", True, 0.0)
    h.on_scrape("r", True, 3.0)
    assert h.state is PROBING
    for t in (6.0, 9.0, 12.0, 15.0):
        h.on_scrape("r", True, t)
    assert h.advance("r", 17.99) is None and h.state is PROBING
    t = h.advance("r", 18.0)
    assert t is not None and t.reason == "clean_window" and h.state is LIVE


@pytest.mark.parametrize("failure", ["scrape", "5xx"])
def test_A2_any_scrape_failure_or_5xx_while_probing_goes_back_to_ejected(failure):
    h = HealthMachine(HealthConfig(), 0.0)
    h.on_scrape("r", True, 0.0)
    h.on_scrape("r", True, 3.0)
    assert h.state is PROBING
    if failure == "scrape":
        h.on_scrape("r", False, 6.0)
    else:
        h.on_upstream("r", False, 6.0)
    assert h.state is EJECTED
    assert h.cooldown_until == 6.0 + 30


def _flap(h: HealthMachine, t: float) -> float:
    """Bring an EJECTED machine to PROBING by scrapes after its cooldown, then fail it."""
    t = max(t, h.cooldown_until)
    h.on_scrape("r", True, t)
    h.on_scrape("r", True, t + 3)
    assert h.state is PROBING
    h.on_scrape("r", False, t + 6)
    assert h.state is EJECTED
    return t + 6


def test_A2_cooldown_grows_30_60_120_240_300_300_capped():
    h = HealthMachine(HealthConfig(), 0.0)
    t = 0.0
    seen = []
    for _ in range(7):
        t = _flap(h, t)
        seen.append(h.cooldown_until - t)
    assert seen == [30, 60, 120, 240, 300, 300, 300]


@pytest.mark.parametrize("live_for,next_cooldown", [(599.0, 60.0), (600.0, 30.0)])
def test_A2_streak_resets_only_after_600s_of_continuous_live(live_for, next_cooldown):
    h = HealthMachine(HealthConfig(), 0.0)
    t = _flap(h, 0.0)  # streak 1
    t = h.cooldown_until
    for k in range(7):  # 2 good scrapes -> PROBING at t+3; the scrape at t+18 ends the 15 s window
        h.on_scrape("r", True, t + 3 * k)
    assert h.state is LIVE
    live_at = h.entered_at
    s = live_at
    while s + 3 < live_at + live_for:
        s += 3
        h.on_scrape("r", True, s)
    h.on_scrape("r", False, live_at + live_for)
    assert h.cooldown_until - (live_at + live_for) == next_cooldown


def test_A2_scraping_is_the_only_way_back_user_success_never_recovers_an_ejected_replica():
    router, t = live_router(2)
    router.on_scrape("r0", False, t)
    for k in range(100):
        router.on_upstream("r0", True, t + k)  # a user's success proves nothing
    assert router.replica("r0").state is EJECTED


def test_A2_probing_never_takes_a_pin():
    router, t = live_router(2)
    router.on_scrape("r1", False, t)
    t = scrape_until(router, t + 3, lambda: router.replica("r1").state is PROBING)
    # r0 has a queue, so the PROBING replica becomes a candidate (B) and wins on load.
    router.on_scrape("r0", True, t, running=3, waiting=2)
    d = router.select(prof(session="s", prefix="sys"), t)
    assert d.replica_name == "r1"
    assert router.session_pins.get(prof(session="s").session_key, t) is None
    assert router.prefix_pins.get(prof(prefix="sys").prefix_key, t) is None
    assert not [e for e in d.events if e.action in ("pin", "rebind")]


# ----------------------------------------------------------------------------- B: eject


def test_B_eject_from_live_on_one_failed_scrape():
    router, t = live_router(2)
    tr = router.on_scrape("r1", False, t)
    assert tr is not None and tr.reason == "scrape_failed" and tr.new is EJECTED


def test_B_eject_from_live_on_a_scrape_timeout_once_the_last_good_scrape_is_stale_a_probing_one_at_the_floor():
    """B's "one failed scrape (timeout, ...)": a LIVE replica's health scrape waits for its answer until its last
    good scrape is 3 intervals old (a busy engine's /metrics answers late; the stale rule ejects one that never does);
    a PROBING or EJECTED one's, the scraper's own floor (A2: any scrape failure while PROBING sends it back)."""
    router, t = live_router(2)  # both scraped well at t, interval 3 s, stale after 9 s
    live = router.replica("r0").health
    assert live.scrape_deadline(t, 2.4) == 9.0
    assert live.scrape_deadline(t + 5.0, 2.4) == 4.0  # what is left of its freshness
    assert live.scrape_deadline(t + 8.0, 2.4) == 2.4  # never below the floor
    router.on_scrape("r1", False, t)  # ejected: on its way back it is held to the floor
    out = router.replica("r1").health
    assert out.scrape_deadline(t + 30.0, 2.4) == 2.4
    router.on_scrape("r1", True, t + 30.0)
    router.on_scrape("r1", True, t + 33.0)
    assert router.replica("r1").state is PROBING and out.scrape_deadline(t + 33.0, 2.4) == 2.4


def test_B_eject_on_3_consecutive_upstream_failures_a_success_resets_the_count():
    router, t = live_router(2)
    router.on_upstream("r0", False, t)
    router.on_upstream("r0", False, t)
    router.on_upstream("r0", True, t)
    router.on_upstream("r0", False, t)
    router.on_upstream("r0", False, t)
    assert router.replica("r0").state is LIVE
    tr = router.on_upstream("r0", False, t)
    assert tr is not None and tr.reason == "upstream_failures"
    assert router.replica("r0").state is EJECTED


def test_B_stale_scrape_older_than_3_intervals_counts_as_failed():
    router, t = live_router(1)
    router.tick(t + 9.0)
    assert router.replica("r0").state is LIVE
    trs = router.tick(t + 9.01)
    assert [x.reason for x in trs] == ["stale_scrape"]
    assert router.replica("r0").state is EJECTED



def test_B_stale_scrape_and_scrape_timeout_spare_a_live_replica_busy_answering_users():
    """Our departure from B's "one failed scrape (timeout)" and stale rule: a LIVE replica whose users' requests
    succeed (Envoy's word) keeps its place while its /metrics times out or goes stale, for as long as a scrape stays
    fresh (9 s) since the last success; a refusal still ejects at once, busy or not; one serving nobody goes at the
    stale rule. On three CPU vLLMs in overload each API server let scrapes wait past 9 s while its engine served."""
    router, t = live_router(3)  # scraped well at t; stale after t + 9
    for name in ("r0", "r1"):
        router.replica(name).health.served(t + 8.0)  # it answered a user's request (release.py: Envoy saw it)
    r0 = router.replica("r0").health
    assert r0.scrape_deadline(t + 10.0, 2.4) == pytest.approx(7.0)  # a busy replica's scrape may wait that long
    assert [x.replica for x in router.tick(t + 9.01)] == ["r2"]
    assert router.replica("r2").state is EJECTED  # it served nobody: the stale rule, as before
    assert router.replica("r0").state is LIVE and router.replica("r1").state is LIVE
    assert router.on_scrape("r0", False, t + 12.0, slow=True) is None  # timed out, but it serves: busy
    tr = router.on_scrape("r1", False, t + 12.0)  # refused (or an error status): dead, busy or not
    assert tr is not None and tr.reason == "scrape_failed" and router.replica("r1").state is EJECTED
    router.replica("r0").health.served(t + 14.0)
    assert r0.next_due() == pytest.approx(t + 23.0)  # the brain's timer looks again then, not at every tick
    assert router.tick(t + 23.0) == [] and router.replica("r0").state is LIVE
    trs = router.tick(t + 23.01)  # nine seconds since its last success, and no scrape since t
    assert [(x.replica, x.reason) for x in trs] == [("r0", "stale_scrape")]


def test_B_stale_scrape_spares_a_replica_whose_stream_had_its_first_token():
    """A stream under way proves its replica serves before it ends: the periodic access-log entry that saw its
    first token keeps the replica LIVE as a success would."""
    router, t = live_router(2)
    d = router.select(prof(session="s"), t)
    assert d.reservation is not None
    router.touch(d.reservation, t + 8.0, first_token=True)
    assert [x.replica for x in router.tick(t + 9.5)] == [x for x in ("r0", "r1") if x != d.replica.name]
    assert d.replica.state is LIVE
    router.touch(d.reservation, t + 12.0)  # still in flight, no first token seen: no proof
    assert [x.replica for x in router.tick(t + 17.01)] == [d.replica.name]


# ----------------------------------------------------------------------------- A3: keys and pins


def test_A3_session_pin_routes_the_session_back_affinity():
    router, t = live_router(4)
    first = router.select(prof(session="s1"), t)
    router.release(first.reservation, t)
    for _ in range(5):
        d = router.select(prof(session="s1"), t)
        assert (d.replica, d.reason, d.pin_kind) == (first.replica, AFFINITY, "session")
        router.release(d.reservation, t)


def test_A3_session_pin_is_looked_up_before_prefix_pin():
    router, t = live_router(4)
    a = router.select(prof(prefix="sys"), t)  # prefix pin -> a
    router.release(a.reservation, t)
    b = router.select(prof(session="s"), t)  # session pin -> b (round-robin moves on)
    router.release(b.reservation, t)
    assert a.replica is not b.replica
    d = router.select(prof(session="s", prefix="sys"), t)
    assert d.pin_kind == "session" and d.replica is b.replica and d.reason == AFFINITY


@pytest.mark.parametrize(
    "kind,pinned_running,pinned_waiting,usable",
    [
        ("session", 0, 0, True),
        ("session", 1, 0, True),  # session slack 1: running <= min_r + 1
        ("session", 2, 0, False),
        ("session", 0, 1, False),  # a queue makes any pin unusable
        ("prefix", 0, 0, True),
        ("prefix", 1, 0, False),  # prefix slack 0
        ("prefix", 0, 1, False),
    ],
)
def test_A3_pin_usable_only_if_live_no_waiting_and_running_within_min_r_plus_slack(
    kind, pinned_running, pinned_waiting, usable
):
    router, t = live_router(3)
    p = prof(session="s") if kind == "session" else prof(prefix="sys")
    d0 = router.select(p, t)
    router.release(d0.reservation, t)
    scrape_all(router, t, {d0.replica_name: (pinned_running, pinned_waiting)})
    d = router.select(p, t)
    assert (d.replica is d0.replica) is usable
    assert d.reason == (AFFINITY if usable else LOAD)
    assert ("spill:" + kind in events_of(d)) is (not usable)


def test_A3_3_spills_in_a_row_move_the_session_pin():
    router, t = live_router(3)
    d0 = router.select(prof(session="s"), t)
    router.release(d0.reservation, t)
    scrape_all(router, t, {d0.replica_name: (2, 0)})  # gap 2: spill, not force
    seen = []
    for _ in range(3):
        d = router.select(prof(session="s"), t)
        router.release(d.reservation, t)
        seen.append(events_of(d))
    assert seen[0] == ["spill:session"] and seen[1] == ["spill:session"]
    assert seen[2] == ["spill:session", "rebind:session:spills"]
    pin = router.session_pins.get(prof(session="s").session_key, t)
    assert pin.replica is not d0.replica and pin.replica is d.replica


def test_A3_spill_counter_counts_only_spills_in_a_row():
    router, t = live_router(3)
    d0 = router.select(prof(session="s"), t)
    router.release(d0.reservation, t)
    hot = {d0.replica_name: (2, 0)}
    for loads in (hot, hot, {}, hot, hot):  # an affinity hit in the middle resets the count
        scrape_all(router, t, loads)
        d = router.select(prof(session="s"), t)
        router.release(d.reservation, t)
        assert "rebind:session:spills" not in events_of(d)
    assert router.session_pins.get(prof(session="s").session_key, t).replica is d0.replica


@pytest.mark.parametrize("kind", ["session", "prefix"])
def test_A3_force_rebind_when_running_pin_minus_min_r_at_least_3(kind):
    router, t = live_router(3)
    p = prof(session="s") if kind == "session" else prof(prefix="sys")
    d0 = router.select(p, t)
    router.release(d0.reservation, t)
    scrape_all(router, t, {d0.replica_name: (3, 0)})
    d = router.select(p, t)
    assert events_of(d) == [f"spill:{kind}", f"rebind:{kind}:force"]
    table = router.session_pins if kind == "session" else router.prefix_pins
    key = p.session_key or p.prefix_key
    assert table.get(key, t).replica is d.replica
    # the per-replica pin counts /state shows follow the move (kept, not walked)
    assert table.count_by_replica() == {d.replica_name: 1}
    table.delete(key)
    assert table.count_by_replica() == {}


def test_B_prefix_spill_second_consecutive_spill_deletes_the_prefix_pin():
    router, t = live_router(3)
    p = prof(prefix="shared system prompt")
    d0 = router.select(p, t)
    router.release(d0.reservation, t)
    scrape_all(router, t, {d0.replica_name: (1, 0)})
    d1 = router.select(p, t)
    router.release(d1.reservation, t)
    assert events_of(d1) == ["spill:prefix"]
    d2 = router.select(p, t)
    router.release(d2.reservation, t)
    assert events_of(d2) == ["spill:prefix", "unpin:prefix:spills"]
    # the key is free: the next request pins it where it lands
    d3 = router.select(p, t)
    assert "pin:prefix:new" in events_of(d3)


@pytest.mark.parametrize("how", ["ejected", "drained", "removed"])
def test_A3_a_pin_to_a_dead_replica_never_blocks_distribution(how):
    router, t = live_router(3)
    d0 = router.select(prof(session="s"), t)
    router.release(d0.reservation, t)
    if how == "ejected":
        router.on_scrape(d0.replica_name, False, t)
    elif how == "drained":
        router.drain(d0.replica_name)
    else:
        router.remove_replica(d0.replica_name)
    d = router.select(prof(session="s"), t)
    assert d.replica is not d0.replica and d.reason == LOAD
    assert events_of(d) == ["rebind:session:dead"]
    assert router.session_pins.get(prof(session="s").session_key, t).replica is d.replica


@pytest.mark.parametrize("kind,ttl", [("session", 3600.0), ("prefix", 300.0)])
def test_A3_idle_ttl_session_60_min_prefix_5_min(kind, ttl):
    router, t = live_router(4, NO_STALE)
    p = prof(session="s") if kind == "session" else prof(prefix="sys")
    table = router.session_pins if kind == "session" else router.prefix_pins
    key = p.session_key or p.prefix_key
    d0 = router.select(p, t)
    router.release(d0.reservation, t)
    assert table.get(key, t + ttl) is not None  # idle exactly TTL: still alive
    d = router.select(p, t + ttl)  # use refreshes the TTL
    router.release(d.reservation, t + ttl)
    assert d.reason == AFFINITY
    assert table.get(key, t + 2 * ttl + 0.001) is None  # idle past TTL: dead
    assert table.expired == 1


def test_A3_expired_pins_die_on_their_own_expiry_cost_is_what_expires():
    table = PinTable("session", 10.0)
    router, t = live_router(1)
    r0 = router.replica("r0")
    for i in range(1000):
        table.put(i.to_bytes(4, "big"), r0, float(i))
    assert table.expire(1000.0) == 990  # pins used at 0..989 are idle > 10 s
    assert len(table) == 10
    assert table.expire(1000.0) == 0


def test_A3_prefix_key_is_md5_of_first_4096_chars_of_system_prompt_plus_tenant():
    from extproc.core import ProfileConfig, build_profile
    import orjson

    cfg = ProfileConfig()

    def key(system: str, tenant: str | None = None) -> bytes:
        headers = {"x-warmroute-tenant": tenant} if tenant else {}
        body = orjson.dumps({"messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]})
        return build_profile(headers, body, cfg).prefix_key

    base = "S" * 4096
    assert key(base + "tail one") == key(base + "different tail")
    assert key("T" + base[1:]) != key(base)
    assert key(base, tenant="acme") != key(base, tenant="globex")
    assert len(key(base)) == 16  # an MD5 digest, never the text


# ----------------------------------------------------------------------------- A4: pipeline


def test_A4_step1_pool_ejected_gets_no_traffic():
    router, t = live_router(3)
    router.on_scrape("r1", False, t)
    for i in range(60):
        d = router.select(prof(session=f"s{i}", tokens=i * 100), t)
        assert d.replica_name != "r1"
        if i % 2:
            router.release(d.reservation, t)


def test_A4_step2_no_wait_a_replica_with_a_queue_takes_no_new_requests():
    router, t = live_router(2)
    scrape_all(router, t, {"r0": (0, 1), "r1": (5, 0)})
    for _ in range(4):
        assert router.select(prof(), t).replica_name == "r1"


def test_A4_step3_least_loaded_ties_round_robin():
    router, t = live_router(4)
    seen = []
    for _ in range(8):
        d = router.select(prof(), t)
        router.release(d.reservation, t)
        seen.append(d.replica_name)
    assert seen == names(4) * 2


def test_A4_step3_ties_prefer_live_before_probing():
    router, t = live_router(2)
    router.on_scrape("r0", False, t)
    t = scrape_until(router, t + 3, lambda: router.replica("r0").state is PROBING, loads={"r1": (0, 1)})
    # r1 LIVE has a queue (so PROBING r0 is a candidate), both run 0: tie -> LIVE wins
    for _ in range(3):
        d = router.select(prof(), t)
        assert d.replica_name == "r1"
        router.release(d.reservation, t)


def test_A4_step5_fallback_random_when_nothing_live_or_probing():
    router = Router(RouterConfig(seed=1), names(4), 0.0)
    picks = {router.select(prof(), 0.0).replica_name for _ in range(40)}
    assert len(picks) > 1 and picks <= set(names(4))
    d = router.select(prof(), 0.0)
    assert d.reason == FALLBACK and d.reservation is not None


def test_A4_step5_fallback_is_deterministic_for_a_seed():
    def picks(seed):
        router = Router(RouterConfig(seed=seed), names(4), 0.0)
        return [router.select(prof(), 0.0).replica_name for _ in range(20)]

    assert picks(3) == picks(3)
    assert len(set(picks(3))) > 1


def test_A4_step5_no_replica_known_is_no_healthy_instances():
    router = Router(RouterConfig(), [], 0.0)
    d = router.select(prof(session="s"), 0.0)
    assert (d.replica, d.reason, d.reservation) == (None, NO_HEALTHY, None)


def test_drain_takes_a_replica_out_of_new_traffic_and_pins_while_in_flight_finishes():
    router, t = live_router(2)
    d0 = router.select(prof(session="s"), t)
    router.drain(d0.replica_name)
    for i in range(5):
        d = router.select(prof(session=f"x{i}"), t)
        assert d.replica is not d0.replica
    assert d0.replica.in_flight_requests == 1
    router.release(d0.reservation, t)
    assert d0.replica.wlc_in_flight == 0
    router.drain(d0.replica_name, False)
    assert router.select(prof(), t).replica is d0.replica  # least-loaded again


def test_drain_of_every_replica_answers_no_healthy_instances():
    router, t = live_router(2)
    router.drain("r0")
    router.drain("r1")
    assert router.select(prof(), t).reason == NO_HEALTHY


# ----------------------------------------------------------------------------- B: probing traffic


def _one_live_one_probing(live_loads):
    router, t = live_router(2)
    router.on_scrape("r1", False, t)
    t = scrape_until(router, t + 3, lambda: router.replica("r1").state is PROBING, loads=live_loads)
    return router, t


def test_B_probing_is_a_candidate_only_when_no_live_replica_is_free_of_a_queue():
    router, t = _one_live_one_probing({"r0": (10, 0)})
    for _ in range(5):  # r0 is loaded but queue-free: the idle PROBING replica gets nothing
        assert router.select(prof(), t).replica_name == "r0"


def test_B_probing_holds_at_most_1_in_flight_request_while_a_live_replica_exists():
    router, t = _one_live_one_probing({"r0": (10, 2)})
    first = router.select(prof(), t)
    assert first.replica_name == "r1"
    for _ in range(4):
        assert router.select(prof(), t).replica_name == "r0"
    router.release(first.reservation, t)
    assert router.select(prof(), t).replica_name == "r1"


def test_B_with_no_live_replica_probing_replicas_are_the_pool_no_cap_no_pins():
    router = Router(RouterConfig(), names(2), 0.0)
    scrape_all(router, 0.0)
    scrape_all(router, 3.0)
    got = [router.select(prof(session=f"s{i}", prefix="p"), 3.0) for i in range(6)]
    assert {d.replica_name for d in got} == {"r0", "r1"}
    assert all(d.reason == LOAD and not d.events for d in got)
    assert max(r.in_flight_requests for r in router.replicas) == 3
    assert len(router.session_pins) == 0 and len(router.prefix_pins) == 0


# ----------------------------------------------------------------------------- B: pins, completion


def test_B_new_pins_each_key_without_a_live_pin_is_pinned_to_the_chosen_replica():
    router, t = live_router(3)
    d = router.select(prof(session="s", prefix="sys"), t)
    assert events_of(d) == ["pin:session:new", "pin:prefix:new"]
    assert router.session_pins.get(prof(session="s").session_key, t).replica is d.replica
    assert router.prefix_pins.get(prof(prefix="sys").prefix_key, t).replica is d.replica


def test_B_new_pins_a_pin_whose_replica_was_chosen_is_refreshed():
    router, t = live_router(3, NO_STALE)
    d0 = router.select(prof(session="s", prefix="sys"), t)
    router.release(d0.reservation, t)
    # 4 minutes later the session pin routes; the prefix pin on the same replica is refreshed
    d1 = router.select(prof(session="s", prefix="sys"), t + 240)
    router.release(d1.reservation, t + 240)
    assert d1.reason == AFFINITY
    assert router.prefix_pins.get(prof(prefix="sys").prefix_key, t + 240 + 299) is not None


def test_B_completion_release_is_idempotent_and_wlc_returns_to_exactly_zero():
    router, t = live_router(3)
    res = [router.select(prof(tokens=k * 137), t).reservation for k in range(300)]
    for r in res:
        assert router.release(r, t + 1) is True
    for r in res:
        assert router.release(r, t + 2) is False
    assert [r.wlc_in_flight for r in router.replicas] == [0, 0, 0]
    assert [r.in_flight_requests for r in router.replicas] == [0, 0, 0]
    assert router.open_reservations == 0


def test_B_completion_safety_timeout_releases_a_reservation_whose_end_was_never_seen():
    cfg = dataclasses.replace(NO_STALE, reservation_timeout_s=3600.0)
    router, t = live_router(1, cfg)
    d = router.select(prof(tokens=50_000), t)
    router.tick(t + 3599)
    assert router.safety_timeouts == 0 and d.replica.wlc_in_flight == 50
    router.tick(t + 3601)
    assert router.safety_timeouts == 1 and d.replica.wlc_in_flight == 0
    assert router.release(d.reservation, t + 3602) is False  # the late end changes nothing


def test_B_no_healthy_instance_gives_no_reservation():
    router = Router(RouterConfig(), [], 0.0)
    assert router.select(prof(tokens=10_000), 0.0).reservation is None


@pytest.mark.parametrize(
    "counts,routable,index",
    [
        ({"a": 5, "b": 5, "c": 5, "d": 5}, "abcd", 1.0),
        ({"a": 20}, "abcd", 4.0),  # everything on one of 4
        ({"a": 10, "b": 5, "c": 5}, "abc", 1.5),
        ({"a": 10, "x": 90}, "ab", 2.0),  # only routable replicas count
        ({}, "abcd", 1.0),
    ],
)
def test_B_imbalance_index_max_share_over_mean_share(counts, routable, index):
    assert imbalance_index(counts, list(routable)) == pytest.approx(index)


def test_config_defaults_are_spec_numbers():
    cfg = RouterConfig()
    h, p, pr = cfg.health, cfg.pins, cfg.profile
    assert (h.scrape_interval_s, h.good_scrapes_to_probe, h.probing_clean_window_s) == (3, 2, 15)
    assert (h.cooldown_base_s, h.cooldown_max_s, h.streak_reset_live_s) == (30, 300, 600)
    assert (h.stale_scrape_intervals, h.upstream_failures_to_eject) == (3, 3)
    assert (p.session_ttl_s, p.prefix_ttl_s, p.session_slack, p.prefix_slack) == (3600, 300, 1, 0)
    assert (p.session_spills_to_rebind, p.prefix_spills_to_delete, p.force_rebind_gap) == (3, 2, 3)
    assert pr.prefix_chars == 4096 and pr.chars_per_token == 4
    assert cfg.token_weight_unit == 1000 and cfg.probing_max_in_flight == 1
    assert cfg.reservation_timeout_s == 3600
    assert pr.session_headers == ("x-session-id", "x-kilo-session", "x-conversation-id")
    assert pr.session_body_fields == ("conversation_id", "thread_id")
