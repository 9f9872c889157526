"""LoRA adapters: the engine's adapter slots as vLLM schedules them, and the brain preferring replicas that hold
a request's adapter, then those with a free slot (SPEC issue 21 "LoRA adapters")."""

from __future__ import annotations

import dataclasses

import pytest

from extproc.core import HealthConfig, LoadSample, Reason, RouterConfig
from extproc.core.cost import lora_cost
from extproc.tools.engine.model import Engine, EngineConfig, EngineRequest

from ..helpers import chain, live_router, prof

WARM = RouterConfig(policy="warm", health=HealthConfig(stale_scrape_intervals=1e9))


def run(engine: Engine, until: float) -> float:
    t = 0.0
    while engine.busy and t < until:
        dur, _, _ = engine.step(t)
        t += dur if dur > 0 else 0.001
    return t


def test_the_batch_holds_at_most_max_loras_adapters_and_a_skipped_request_keeps_its_place():
    e = Engine(EngineConfig(max_loras=1, lora_load_s=0.5))
    a = EngineRequest(1, list(range(10)), 160, 50, 0.0, lora="a")
    b = EngineRequest(2, list(range(100, 110)), 160, 50, 0.0, lora="b")
    base = EngineRequest(3, list(range(200, 210)), 160, 50, 0.0)
    a2 = EngineRequest(4, list(range(300, 310)), 160, 50, 0.0, lora="a")
    for r in (a, b, base, a2):
        e.add(r)
    dur, _, _ = e.step(0.0)
    assert {r.rid for r in e.running} == {1, 3, 4}  # b skipped: one adapter slot, taken by a; the base model runs
    assert [r.rid for r in e.waiting] == [2] and e.lora_loads == 1
    assert dur >= 0.5  # the step that brought a in paid its load
    assert e.lora_running == ["a"] and e.lora_waiting == ["b"]
    run(e, 100.0)
    assert b.finished_at is not None and b.scheduled_at >= a.finished_at and e.lora_loads == 2


def test_an_adapter_in_its_slot_loads_once():
    e = Engine(EngineConfig(max_loras=2, lora_load_s=0.5))
    for i in range(6):
        e.add(EngineRequest(i, list(range(i * 20, i * 20 + 10)), 160, 10, 0.0, lora=("a", "b")[i % 2]))
    run(e, 100.0)
    assert e.lora_loads == 2


def test_without_adapters_the_engine_schedules_as_before():
    cfg = EngineConfig()
    assert cfg.max_loras == 0
    e = Engine(cfg)
    for i in range(3):
        e.add(EngineRequest(i, list(range(i * 20, i * 20 + 10)), 160, 10, 0.0))
    run(e, 10.0)
    assert e.lora_loads == 0 and e.finished == 3


def _router():
    router, t = live_router(3, WARM)
    for name, running in (("r0", {"a"}), ("r1", set()), ("r2", {"b", "c"})):
        router.on_load(name, LoadSample(1, 0, 0.1, lora_running=frozenset(running), lora_waiting=frozenset(),
                                        max_lora=2), t)
    return router, t


def pick(router, t, adapter, session):
    p = dataclasses.replace(prof(session=session, tokens=2000, blocks=chain(session, session, 2000)), adapter=adapter)
    return router.select(p, t)


def test_C3_a_request_goes_where_its_adapter_runs_then_where_a_slot_is_free():
    router, t = _router()
    assert pick(router, t, "a", "s1").replica.name == "r0"  # running there: no load
    # d: not loaded anywhere; r0 and r1 have a free slot, r2's two slots serve running adapters
    e = router.policy
    st1, st2 = e.state_of(router.replicas[1]), e.state_of(router.replicas[2])
    assert sum(lora_cost(st2, "d", 0.03, t, e.cfg.warm)) > sum(lora_cost(st1, "d", 0.03, t, e.cfg.warm)) > 0
    assert pick(router, t, "d", "s2").replica.name in ("r0", "r1")


def test_C3_an_adapter_sent_lately_is_taken_as_still_in_its_slot():
    router, t = _router()
    first = pick(router, t, "e", "s3")
    router.release(first.reservation, t)
    st = router.policy.state_of(first.replica)
    assert lora_cost(st, "e", 0.03, t, router.policy.cfg.warm) == (0.0, 0.0)
    assert pick(router, t + 1, "e", "s4").replica is first.replica


def test_C3_a_load_is_priced_for_every_request_it_stalls():
    """The engine loads an adapter before the step that needs it: the whole batch there waits. A session's own
    replica with requests in flight loses to an idle one once the load would stall them longer than the
    session's re-prefill costs."""
    cfg = dataclasses.replace(WARM, warm=dataclasses.replace(WARM.warm, lora_load_s=2.0))
    router, t = live_router(2, cfg)
    for name in ("r0", "r1"):
        router.on_load(name, LoadSample(0, 0, 0.0, lora_running=frozenset(), lora_waiting=frozenset(), max_lora=2), t)
    first = pick(router, t, "z", "home")  # the session's context now lives where it went
    router.release(first.reservation, t)
    home = first.replica
    router.on_load(home.name, LoadSample(0, 0, 0.0, lora_running=frozenset(), lora_waiting=frozenset(), max_lora=2), t)
    router.policy.state_of(home).lora_sent.clear()  # its slot went to other adapters meanwhile
    for i in range(4):  # short base-model requests in flight there: they barely delay a prefill
        router.select(prof(session=f"o{i}", tokens=20, blocks=chain("o", f"o{i}", 20)), t, {home.name})
    e = pick(router, t + 0.1, "z", "home")
    assert e.replica is not home and e.replica.index != home.index
    est = router.policy.estimate(home, router.policy.state_of(home), 5000.0, 0.03,
                                  dataclasses.replace(prof(session="x", tokens=100), adapter="z"), None, t, None)
    assert est.stall == 2.0 * home.in_flight_requests


def test_the_simulated_fleet_keeps_each_model_in_its_pool_and_counts_adapter_loads():
    from bench.runs.fleet import ADAPTERS, MODELS, model_of
    from extproc.tools.sim.simulator import Simulation
    from extproc.tools.workload.generate import WorkloadConfig

    pools = tuple(p for p, n in MODELS.items() for _ in range(n))

    def assign(req):
        model, pool = model_of(req.sid, 1)
        return pool, (model if model in ADAPTERS else None)

    for policy in ("warmroute", "envoy_least_request"):
        sim = Simulation(policy, len(pools), WorkloadConfig(minutes=3, sessions_per_min=6, oneshots_per_min=6), seed=1,
                         engine=EngineConfig(max_loras=2, lora_load_s=1.0), pools=pools, assign=assign)
        res = sim.run()
        routed = [r for r in res.requests if r.replica is not None]
        assert routed and all(pools[r.replica] == r.pool for r in routed)
        assert any(r.adapter for r in routed) and res.lora_loads > 0


def test_the_fleet_bench_pools_seeds_and_prints_the_floor_of_adapter_loads(capsys):
    """One seed's few hundred requests move a percentile by tens of per cent: --seeds pools them; the loads of
    the pooled run are the seeds' loads summed, and never below the adapters the workload asked for."""
    from bench.runs import fleet as bench_fleet

    argv = ["--simulated", "--contenders", "envoy_least_request", "--minutes", "1", "--warmup-min", "0.2"]
    loads = []
    for seed in ("1", "2"):
        assert bench_fleet.main([*argv, "--seed", seed]) == 0
        row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| envoy_least_request"))
        loads.append(int(row.split("|")[6]))
    assert bench_fleet.main([*argv, "--seeds", "1-2"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| envoy_least_request"))
    assert "seeds 1-2, their requests pooled" in out and int(row.split("|")[6]) == sum(loads)
    floor = int(out.split("The workload asked for ")[1].split()[0])
    assert 0 < floor <= sum(loads)
    with pytest.raises(SystemExit):
        bench_fleet.main(["--seeds", "1-2"])  # pooling is the simulator's: a live run is one seed


def test_a_new_adapter_session_beside_sessions_under_way_is_not_held_for_the_adapter_s_load():
    """With flow control on, a new session waits in the router while every candidate has more than its prefill
    queued (issue 43). An adapter's load is no queue: it is paid whenever the request goes, so a new session of an
    adapter that is in no slot was held until it timed out (429 waited_too_long on the real engines)."""
    from extproc.core.flow import FlowControl

    router, t = live_router(1, WARM)
    router.flow = FlowControl()
    router.on_load("r0", LoadSample(0, 0, 0.0, lora_running=frozenset(), lora_waiting=frozenset(), max_lora=2), t)
    under_way = router.select(prof(session="chat", tokens=3000, blocks=chain("c", "chat", 3000)), t)
    router.release(under_way.reservation, t + 0.5)
    p = dataclasses.replace(prof(session="lora-b", tokens=300, blocks=chain("b", "lora-b", 300)), adapter="b")
    d = router.select(p, t + 1, hold_key="b1")
    assert d.replica is not None and d.reason is not Reason.HELD, d
