"""The core demo replays its script to the end: the dead replica gets nothing while EJECTED, nothing leaks."""

from __future__ import annotations

import io

import pytest

from extproc.tools.demo_core import run


@pytest.mark.parametrize("policy,word", [("seed", "spill:"), ("warm", "cached ")])
def test_core_demo_runs_and_every_reservation_is_released(policy, word):
    out = io.StringIO()
    router = run(out, seed=7, policy=policy)
    text = out.getvalue()
    assert f"({policy} policy)" in text
    assert router.open_reservations == 0
    assert all(r.wlc_in_flight == 0 for r in router.replicas)
    assert "r2: LIVE -> EJECTED (scrape_failed)" in text
    assert "r2: EJECTED -> PROBING (good_scrapes)" in text
    assert "affinity" in text and word in text
    # no decision line names r2 between its ejection and its return to PROBING
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if "r2: LIVE -> EJECTED" in ln)
    end = next(i for i, ln in enumerate(lines) if "r2: EJECTED -> PROBING" in ln)
    assert not [ln for ln in lines[start:end] if "-> r2 " in ln]
    # after the drain at t=150 nothing new lands on r1
    drain_at = next(i for i, ln in enumerate(lines) if "operator drains r1" in ln)
    assert not [ln for ln in lines[drain_at:] if "-> r1 " in ln]


def test_core_demo_is_deterministic_for_a_seed():
    a, b = io.StringIO(), io.StringIO()
    run(a, seed=3)
    run(b, seed=3)
    assert a.getvalue() == b.getvalue()
