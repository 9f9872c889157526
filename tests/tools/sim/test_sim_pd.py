"""The simulator's disaggregated fleets (issue 48): prefill legs, the KV handed over, the peers' deciders."""

from __future__ import annotations

import pytest

from extproc.tools.sim.simulator import Fault, Simulation
from extproc.tools.workload.generate import WorkloadConfig

W = WorkloadConfig(minutes=6, sessions_per_min=3, oneshots_per_min=4, long_share=0.3)


def run(policy: str, faults=(), prefill: int = 2):
    return Simulation(policy, replicas=6, workload=W, seed=3, prefill_replicas=prefill, faults=faults).run()


@pytest.mark.parametrize("policy", ["warmroute", "llmd_pd", "dynamo_pd"])
def test_a_prefill_replica_takes_prefill_legs_and_never_a_whole_request(policy):
    res = run(policy)
    legs = [r for r in res.requests if "prefill_replica" in r.extra]
    assert legs and all(r.extra["prefill_replica"] in (0, 1) for r in legs)
    assert all(r.replica not in (0, 1) for r in res.requests if r.replica is not None)
    # a decode leg loads what its prefill leg computed: it reports the prompt cached, short of its last token
    done = [r for r in legs if r.error is None and r.e2e is not None and "prefill_failed" not in r.extra]
    assert done and all(r.cached_tokens >= r.prompt_tokens - 16 for r in done)


def test_the_same_replicas_aggregated_never_disaggregate_and_use_every_replica():
    res = run("warmroute_aggregated")
    assert not any("prefill_replica" in r.extra for r in res.requests)
    assert {r.replica for r in res.requests} >= {0, 1}


def test_a_prefill_replica_that_dies_mid_leg_leaves_its_requests_to_their_decode_replicas():
    res = run("llmd_pd", faults=(Fault(0, 120.0, 60.0), Fault(1, 120.0, 60.0)), prefill=2)
    failed = [r for r in res.requests if r.extra.get("prefill_failed")]
    assert failed and all(r.error is None for r in failed if r.e2e is not None)
    assert not [r for r in res.requests if r.error == "replica_died" and r.replica in (0, 1)]
