"""The seed's four incidents, in the simulator with the real core: each reproduced with its rule
switched off and prevented with it on. Thresholds come from the numbers these seeds print
(noted per test); the simulator is deterministic for a seed."""

from __future__ import annotations

from collections import Counter

from extproc.core import HealthConfig, RouterConfig
from extproc.tools.sim.policies import Warmroute
from extproc.tools.sim.simulator import Fault, Simulation
from extproc.tools.workload.generate import WorkloadConfig


def test_incident_1_crystallization_one_shared_system_prompt_stays_balanced():
    # 30 minutes of agent sessions that all share one system prompt (one project).
    w = WorkloadConfig(minutes=30, sessions_per_min=1.5, projects=1)
    seed_v1 = Simulation("warmroute_seed_pins_forever", seed=3, workload=w).run().summary()
    spec = Simulation("warmroute_seed", seed=3, workload=w).run().summary()
    # measured: pins that live forever and never move -> max share 1.00, imbalance 4.0 (all on one of 4);
    # with TTL + spill/rebind -> max share 0.27, imbalance 1.41 mean / 2.0 worst minute
    assert seed_v1["max_share"] >= 0.9 and seed_v1["imbalance_mean"] >= 3.5
    assert spec["max_share"] <= 0.35 and spec["imbalance_mean"] <= 1.6


def test_incident_2_wlc_blind_spot_a_burst_between_scrapes_spreads():
    # background sessions make scraped loads unequal; 8 requests arrive at one instant between scrapes
    w = WorkloadConfig(minutes=3, sessions_per_min=6, oneshots_per_min=0)

    def burst(policy):
        r = Simulation(policy, seed=2, workload=w, bursts=((100.5, 8),)).run()
        return Counter(q.replica for q in r.requests if q.oneshot)

    on, off = burst("warmroute_seed"), burst("warmroute_seed_no_wlc")
    assert sum(on.values()) == sum(off.values()) == 8
    # measured (seed 2): without the in-flight term the whole burst lands on the two replicas that
    # looked least loaded at the last scrape (4 + 4); with it, it reaches a third replica (4 + 2 + 2) as
    # soon as the reserved weight outgrows the stale view (the exact rule is tests/core/test_spread.py)
    assert len(off) <= 2
    assert len(on) >= 3 and max(on.values()) <= max(off.values())


def test_incident_3_no_user_request_is_the_probe_of_a_dead_replica_recovery_by_scrapes_alone():
    w = WorkloadConfig(minutes=12, sessions_per_min=2)
    dead = (Fault(1, start=300, duration=120),)

    def run(policy):
        return Simulation(policy, seed=4, workload=w, faults=dead).run()

    rr, wr = run("envoy_round_robin"), run("warmroute_seed")
    # a request "probes" the dead replica when it is sent there and has to be retried elsewhere
    probes = lambda r: sum(1 for q in r.requests if q.retries and 303 < q.arrival < 420)  # noqa: E731
    assert probes(rr) >= 10  # measured 23: round-robin keeps sending users into the dead replica
    assert probes(wr) == 0 and wr.to_ejected == 0
    lost = Counter(q.error for q in wr.requests if q.error)
    assert set(lost) <= {"replica_died"} and lost["replica_died"] <= 5  # only what was running on it at death
    r1 = [(t.new.value, t.reason) for t in wr.transitions if t.replica == "r1" and t.at >= 300]
    assert r1 == [("EJECTED", "upstream_failures"), ("PROBING", "good_scrapes"), ("LIVE", "clean_window")]
    back = [t.at for t in wr.transitions if t.replica == "r1" and t.new.value == "PROBING" and t.at >= 300][0]
    assert 420 < back <= 420 + 2 * 3 + 0.01  # two good scrapes after it came back, no user request needed


FLAP = (Fault(2, start=120, duration=5, every=15, until=1200), Fault(2, start=2100, duration=10))


def test_incident_4_flap_cooldown_grows_30_60_120_240_300_and_the_streak_resets_after_600s_live():
    r = Simulation("warmroute_seed", seed=5, workload=WorkloadConfig(minutes=40, sessions_per_min=2), faults=FLAP).run()
    ejections = [t for t in r.transitions if t.replica == "r2" and t.new.value == "EJECTED"]
    cooldowns = [t.cooldown_s for t in ejections]
    assert cooldowns[:6] == [30, 60, 120, 240, 300, 300]
    # the flapping stopped at 20 min; LIVE again, then >= 600 s continuous LIVE before the kill at 35 min
    assert ejections[-1].at == 2100 and ejections[-1].cooldown_s == 30
    assert r.pins_on_non_live == 0  # no pin ever landed on the replica while it was PROBING


def test_incident_4_flap_with_a_short_fixed_cooldown_and_no_hysteresis_loses_more_requests():
    loose = RouterConfig(health=HealthConfig(cooldown_base_s=5, cooldown_max_s=5, good_scrapes_to_probe=1,
                                             probing_clean_window_s=0))
    w = WorkloadConfig(minutes=22, sessions_per_min=2)

    def lost(cfg):
        r = Simulation(Warmroute(4, 5, cfg, core_policy="seed"), seed=5, workload=w, faults=FLAP[:1]).run()
        return sum(1 for q in r.requests if q.error == "replica_died")

    spec, seed_v1 = lost(RouterConfig()), lost(loose)
    # measured: 23 requests die under the flapping replica with SPEC's rules, several times more without them
    assert seed_v1 >= 2 * spec


def test_the_same_seed_gives_the_same_result():
    w = WorkloadConfig(minutes=5, sessions_per_min=3)
    a = Simulation("warmroute", seed=9, workload=w).run().summary()
    b = Simulation("warmroute", seed=9, workload=w).run().summary()
    c = Simulation("warmroute", seed=10, workload=w).run().summary()
    assert a == b and a != c


def test_batched_decode_steps_time_requests_as_single_steps_would(monkeypatch):
    # the simulator repeats pure-decode steps up to a horizon for speed; a request arriving meanwhile must be
    # admitted at the next step boundary, as vLLM does, or co-located sessions pay up to the horizon each turn
    import extproc.tools.sim.simulator as simulator

    def ttfts(horizon):
        monkeypatch.setattr(simulator, "DECODE_HORIZON_S", horizon)
        w = WorkloadConfig(minutes=4, sessions_per_min=3, oneshots_per_min=6)
        return [(r.replica, r.ttft) for r in Simulation("warmroute", replicas=2, workload=w, seed=3).run().requests]

    batched, single = ttfts(0.2), ttfts(0.0)
    assert len(batched) == len(single) > 100
    assert [r for r, _ in batched] == [r for r, _ in single]
    # only the KV read growing by a token per step differs (measured 2.4 ms at most; up to 1.5 s without the cut)
    assert max(abs(a - b) for (_, a), (_, b) in zip(batched, single) if a is not None and b is not None) < 0.02


def test_no_policy_beats_the_ttft_floor_and_the_oracle_comes_close():
    from extproc.tools.sim.simulator import ttft_floor

    w = WorkloadConfig(minutes=6, sessions_per_min=1, oneshots_per_min=3)
    p50 = {}
    for policy in ("warmroute", "envoy_ring_hash", "oracle", "envoy_round_robin"):
        res = Simulation(policy, replicas=4, workload=w, seed=4).run()
        floor = ttft_floor(res.requests, res.fastest)
        done = [r for r in res.requests if r.ttft is not None]
        assert len(done) > 50 and all(r.ttft >= floor[r.rid] - 1e-9 for r in done)
        s = res.summary()
        p50[policy] = s["ttft_p50"] / s["ttft_floor_p50"]
        if policy == "envoy_ring_hash":  # it never moves a session, so its busiest session bounds each minute
            assert s["imbalance_mean"] >= s["imbalance_floor_mean"] > 1.0
            assert s["imbalance_max"] >= s["imbalance_floor_max"]
    # measured: oracle 1.02, round-robin 2.9 (it prefills the system prompt on every replica, again and again)
    assert p50["oracle"] < 1.1 < 2 < p50["envoy_round_robin"]


def test_the_simulator_drives_the_real_core():
    from extproc.core import Router

    sim = Simulation("warmroute", seed=1, workload=WorkloadConfig(minutes=1))
    assert isinstance(sim.policy.router, Router)


# ---- the same four guarantees on the cost-based policy (SPEC C5: "the four guarantees of A6 tested on
# this policy too"); numbers are what these seeds print, thresholds the seed's alert lines


def test_incident_1_on_warm_one_shared_system_prompt_never_crystallizes():
    w = WorkloadConfig(minutes=30, sessions_per_min=1.5, projects=1)
    warm = Simulation("warmroute_warm", seed=3, workload=w).run().summary()
    # measured: max share 0.39, imbalance 1.78 mean / 2.61 worst minute (pins-forever: 1.00 and 4.0); without the
    # fit rule the interference term made it 0.43 (warm.py)
    assert warm["max_share"] <= 0.4
    assert warm["imbalance_mean"] <= 2.0 and warm["imbalance_max"] < 3.0


def test_incident_2_on_warm_a_burst_between_scrapes_spreads():
    w = WorkloadConfig(minutes=3, sessions_per_min=6, oneshots_per_min=0)
    r = Simulation("warmroute_warm", seed=2, workload=w, bursts=((100.5, 8),)).run()
    got = Counter(q.replica for q in r.requests if q.oneshot)
    # measured 4 + 3 + 1: the predicted prefill of each reserved request is work ahead of the next
    assert sum(got.values()) == 8 and len(got) >= 3 and max(got.values()) <= 4


def test_incident_3_on_warm_no_user_request_probes_a_dead_replica():
    w = WorkloadConfig(minutes=12, sessions_per_min=2)
    r = Simulation("warmroute_warm", seed=4, workload=w, faults=(Fault(1, start=300, duration=120),)).run()
    assert sum(1 for q in r.requests if q.retries and 303 < q.arrival < 420) == 0 and r.to_ejected == 0
    r1 = [(t.new.value, t.reason) for t in r.transitions if t.replica == "r1" and t.at >= 300]
    # ejected by whichever comes first, a failed scrape or 3 failed requests; back by scrapes alone
    assert [s for s, _ in r1] == ["EJECTED", "PROBING", "LIVE"]
    assert r1[1:] == [("PROBING", "good_scrapes"), ("LIVE", "clean_window")]


def test_incident_4_on_warm_the_flapping_replica_s_cooldown_grows_and_it_takes_no_pin():
    r = Simulation("warmroute_warm", seed=5, workload=WorkloadConfig(minutes=40, sessions_per_min=2), faults=FLAP).run()
    ejections = [t for t in r.transitions if t.replica == "r2" and t.new.value == "EJECTED"]
    assert [t.cooldown_s for t in ejections][:6] == [30, 60, 120, 240, 300, 300]
    assert r.pins_on_non_live == 0
