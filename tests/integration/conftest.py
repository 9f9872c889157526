"""Fixtures that start real Envoy + brain + mock vLLM replicas on loopback, and stop them."""

from __future__ import annotations

import os
import time

import pytest

from extproc.tools.stack.local import Stack, wait_for

# Shortened SPEC timings so that health transitions happen within seconds in tests.
FAST = {
    "health": {
        "scrape_interval_s": 0.25,
        "probing_clean_window_s": 1.0,
        "cooldown_base_s": 1.0,
        "cooldown_max_s": 4.0,
        # 2 s before a missing scrape counts as failed: a busy machine delays the 0.25 s scrapes, and an
        # ejection that only a loaded box causes would move pins a test counts on
        "stale_scrape_intervals": 8.0,
    },
    # a brain starved for a second on a busy machine (engines starting beside the tests) would fail requests open
    # to the ring hash, moving sessions and counts a test is about; what fails open on purpose fails at once
    "envoy": {"brain_health_check_interval_s": 0.5, "ext_proc_timeout_s": 3.0},
}


def quiet(stack: Stack, timeout: float = 10.0) -> None:
    """Wait until every request has been released and the scrapes show idle replicas."""
    wait_for(
        lambda: (st := stack.state())["open_reservations"] == 0
        and all(r["effective_running"] == 0 and r["wlc_in_flight"] == 0 for r in st["replicas"]),
        timeout,
        "an idle fleet",
    )


def _live_children() -> list[str]:
    """This test process's children that still run (zombies excluded), as 'pid name'."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if int(rest[1]) == os.getpid() and rest[0] != "Z":
            out.append(f"{pid} {name}")
    return out


@pytest.fixture(autouse=True, scope="module")
def every_process_a_test_starts_it_stops():
    before = set(_live_children())
    yield
    deadline = time.monotonic() + 10  # a stopped process may take a moment to be reaped
    while (left := set(_live_children()) - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes this module started are still running: {sorted(left)}"


@pytest.fixture(scope="module")
def stack():
    with Stack(4, config=FAST, mock_args=["--speedup", "20"]) as s:
        s.wait_all_live(30)
        yield s


@pytest.fixture
def own_stack():
    """A stack a test may break (kill replicas or the brain)."""
    stacks = []

    def make(n=4, config=None, mock_args=None, envoy=True):
        cfg = {k: dict(v) for k, v in FAST.items()}
        for k, v in (config or {}).items():
            cfg.setdefault(k, {}).update(v)
        s = Stack(n, config=cfg, mock_args=mock_args or ["--speedup", "20"])
        stacks.append(s)
        s.start(envoy=envoy)
        return s

    yield make
    for s in stacks:
        s.stop()


@pytest.fixture
def replica():
    """Start mock vLLM replicas alone (no brain, no Envoy): ``replica(*extra_args)``; all stopped after the test."""
    s = Stack(0)
    reps = []

    def start(*extra):
        r = s.start_replica(f"m{len(reps)}", extra=list(extra))
        reps.append(r)
        return r

    yield start
    for r in reps:
        r.proc.stop()
    s.stop()
