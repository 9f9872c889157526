"""One counting rule for the simulator's requests and a live replay's (sim.measure.window_numbers)."""

from __future__ import annotations

from extproc.tools.workload.measure import window_numbers
from extproc.tools.workload.generate import Request


def req(arrival, ttft, e2e, prompt=1000, cached=0, out=100, error=None, engine=None):
    r = Request(0, 0, 0, prompt, 0, out, arrival)
    r.ttft, r.e2e, r.cached_tokens, r.error = ttft, e2e, cached, error
    if engine is not None:
        r.extra["engine"] = {"ttft_s": engine}
    return r


def test_the_warm_up_and_what_ends_after_the_run_are_not_counted():
    rs = [req(30, 9.0, 10.0, cached=0),  # arrived in the warm-up: neither its TTFT nor its hits count
          req(70, 0.1, 1.0, cached=500),
          req(80, 0.3, 2.0, cached=900),
          req(115, 0.2, 10.0, out=777),  # answered after the 2-minute end: its TTFT counts, its tokens do not
          req(90, None, None, error="502")]
    n = window_numbers(rs, minutes=2.0, warmup_min=1.0)
    assert n["requests"] == 4
    assert n["ttft_p50"] == 0.2 and n["ttft_p99"] == 0.3
    assert n["hits"] == (500 + 900) / 3000
    assert n["tok_s"] == 200 / 60


def test_live_wall_seconds_are_scaled_to_workload_seconds_and_the_engine_part_is_told_apart():
    # a live run at 20x: 10 ms of wall time to the first token is 0.2 s of workload time, 0.15 of it the engine's
    rs = [req(70, 0.010, 0.05, engine=0.15), req(75, 0.020, 0.05, engine=0.3)]
    n = window_numbers(rs, minutes=2.0, warmup_min=1.0, scale=20.0)
    assert abs(n["ttft_p50"] - 0.4) < 1e-9  # rank rule: the upper of two
    assert abs(n["overhead_p50"] - 0.1) < 1e-9 and n["engine_ttft_p50"] == 0.3
    assert n["tok_s"] == 200 / 60  # 70 + 1 s and 75 + 1 s end inside the window
