"""The benchmarks' harness knows when it measured the machine instead of the replicas, and lowers the pace."""

from __future__ import annotations

import asyncio
import time
from argparse import Namespace

import pytest

from bench.runs import live as bench_live
from bench.harness import EngineCounters, pace_check
from extproc.tools.workload.http_replay import _loop_lag


def test_a_client_that_lags_or_a_path_that_takes_a_quarter_of_the_ttft_is_named():
    assert pace_check(2.0, 0.001, 0.05, 5.0) is None  # 5 ms of lag, 50 ms of path: the replicas were measured
    why = pace_check(2.0, 0.05, 0.05, 5.0)  # 50 ms of wall lag at 5x: 0.25 s against a 2 s TTFT
    assert why and "client lagged 0.25 s" in why
    why = pace_check(2.0, 0.001, 0.6, 5.0)
    assert why and "0.60 s of the TTFT p50 of 2.00 s" in why
    assert pace_check(float("nan"), 1.0, 1.0, 5.0) is None  # nothing measured, nothing to judge


def test_the_client_lag_is_its_event_loop_s_own_delay():
    async def run() -> list[float]:
        lags: list[float] = []
        watch = asyncio.ensure_future(_loop_lag(lags))
        await asyncio.sleep(0.05)
        time.sleep(0.2)  # the client's loop blocked, as a client starved of CPU is
        await asyncio.sleep(0.05)
        watch.cancel()
        return lags

    assert max(asyncio.run(run())) >= 0.15


def test_a_run_that_measured_the_machine_is_run_again_at_half_the_pace_and_refused_below_the_floor(monkeypatch):
    seen = []

    def fake(contender, scenario, args, speedup=None):
        seen.append(speedup)
        return bench_live.Row(contender, scenario, speedup=speedup, pace="the client lagged" if speedup > 2 else "")

    monkeypatch.setattr(bench_live, "measure", fake)
    args = Namespace(speedup=8.0, fault_speedup=20.0, min_speedup=1.0)
    row = bench_live.measure_paced("warmroute", "workload", args)
    assert seen == [8.0, 4.0, 2.0] and row.speedup == 2.0 and not row.note
    assert row.paces == ["8x: the client lagged", "4x: the client lagged"]
    assert "(left 8x: the client lagged)" in bench_live.table([row])

    seen.clear()
    args.min_speedup = 4.0
    row = bench_live.measure_paced("warmroute", "workload", args)
    assert seen == [8.0, 4.0] and row.note.startswith("refused, it measured the machine at 4x")
    # the fault scenarios count errors: their row stays, flagged, at its pace
    seen.clear()
    row = bench_live.measure_paced("warmroute", "flapping_replica", args)
    assert seen == [20.0] and row.pace and not row.note


def test_the_engines_counters_give_the_hit_rate_and_the_busiest_share():
    a = EngineCounters(prompt=100, cached=0, queries=100, hits=40, generated=10, done=(1, 1, 1))
    b = EngineCounters(prompt=1100, cached=0, queries=1100, hits=640, generated=110, done=(7, 2, 3))
    d = b - a
    assert d.hit_rate == pytest.approx(0.6)  # the mock: prefix-cache hits over queries
    assert d.busiest_share == pytest.approx(6 / 9 * 3)
    real = EngineCounters(prompt=1000, cached=750, queries=1200, hits=750, done=(1,), has_cached=True)
    assert real.hit_rate == pytest.approx(0.75)  # vLLM 0.32: cached prompt tokens over prompt tokens
    cold = EngineCounters(prompt=1000, cached=0, queries=1200, hits=40, done=(1,), has_cached=True)
    assert (cold - EngineCounters(has_cached=True, done=(0,))).hit_rate == 0.0
