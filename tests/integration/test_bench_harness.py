"""The live benchmark's harness measures a contender end to end (a short run, not the benchmark)."""

from __future__ import annotations

from argparse import Namespace

import pytest

from bench.runs.live import measure, table

pytestmark = pytest.mark.integration

ARGS = Namespace(minutes=1.5, speedup=20.0, fault_speedup=20.0, warmup_min=0.5, replicas=3, sessions_per_min=8.0,
                 oneshots_per_min=8.0, projects=2, seed=3)


@pytest.mark.parametrize("contender,scenario", [("warmroute", "workload"), ("envoy_least_request",
                                                                            "replica_dies_and_returns")])
def test_the_harness_measures_a_contender(contender, scenario):
    row = measure(contender, scenario, ARGS)
    assert not row.note, row.note
    assert row.sent >= 10
    assert 0 < row.ttft_p50 <= row.ttft_p99
    assert 0.0 < row.prefix_hit <= 1.0  # the usage's cached tokens of the measured requests
    assert 0.0 < row.fleet_hit <= 1.0  # read from the replicas' own /metrics
    assert 0.0 < row.not_engine_p50 < row.ttft_p50  # the mocks say what their engine took; the rest is the path's
    assert (row.brain_ms > 0) == (contender == "warmroute")
    assert row.imbalance >= 1.0
    assert row.errors + row.lost < row.sent
    assert f"| {contender} | {scenario} |" in table([row])


def test_a_router_that_is_not_installed_is_a_row_that_says_so(monkeypatch):
    import bench.harness as h

    monkeypatch.setattr(h, "find_bin", lambda name: None)
    row = measure("vllm_router_cache_aware", "workload", ARGS)
    assert "not installed" in row.note
