"""Passive health a client cannot drive (issue 19, part 2): users' requests eject at most the fleet's share."""

from __future__ import annotations

import dataclasses

from extproc.core import EJECTED, LIVE, HealthConfig, RouterConfig

from ..helpers import live_router, scrape_until

CFG = RouterConfig(policy="seed", health=HealthConfig(stale_scrape_intervals=1e9))


def fail(router, name, t, n=3):
    for _ in range(n):
        router.on_upstream(name, False, t)


def test_B_upstream_failures_eject_at_most_the_fleet_s_share_and_scrapes_eject_the_rest():
    router, t = live_router(4, CFG)  # 25% of 4: one replica
    fail(router, "r0", t)
    assert router.replica("r0").state is EJECTED
    fail(router, "r1", t)
    fail(router, "r2", t)
    assert router.replica("r1").state is LIVE and router.replica("r2").state is LIVE
    assert router.passive_ejections_refused >= 2
    # a replica whose scrapes fail is ejected whatever the share
    router.on_scrape("r1", False, t + 1)
    assert router.replica("r1").state is EJECTED


def test_B_upstream_failures_share_comes_back_when_the_passively_ejected_replica_does():
    router, t = live_router(4, CFG)
    fail(router, "r0", t)
    t = scrape_until(router, t + 3, lambda: router.replica("r0").state is LIVE)
    fail(router, "r1", t)
    assert router.replica("r1").state is EJECTED


def test_B_upstream_failures_share_is_a_percentage_of_the_fleet_and_at_least_one():
    cfg = dataclasses.replace(CFG, health=dataclasses.replace(CFG.health, max_passive_ejection_percent=50.0))
    router, t = live_router(8, cfg)
    for name in ("r0", "r1", "r2", "r3", "r4", "r5"):
        fail(router, name, t)
    assert sum(r.state is EJECTED for r in router.replicas) == 4
    cfg = dataclasses.replace(CFG, health=dataclasses.replace(CFG.health, max_passive_ejection_percent=0.0))
    router, t = live_router(2, cfg)
    fail(router, "r0", t)
    assert router.replica("r0").state is EJECTED  # Envoy's rule: one may always go
