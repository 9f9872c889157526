"""The warm policy's state of one replica: its queue of predicted prefills, corrected by the engine's own count of
first tokens (issue 62: a prefill over early kept its predicted seconds in the queue until the request ended, and a
simulated fleet's turns were predicted 10-30 s of wait in front of an idle engine)."""

from __future__ import annotations

import pytest

from extproc.core import HealthConfig, LoadSample, RouterConfig

from ..helpers import live_router, prof

WARM = RouterConfig(policy="warm", health=HealthConfig(stale_scrape_intervals=1e9))


def _first_tokens(router, t: float, count: float) -> None:
    router.on_load("r0", LoadSample(1, 0, 0.1, prompt_requests=count), t)


def test_C3_the_engine_s_first_tokens_end_the_oldest_prefills_booked_there_and_their_ends_take_nothing_twice():
    router, t = live_router(1, WARM)
    st = router.policy.states.of(router.replicas[0])
    _first_tokens(router, t, 5)
    prefill = 60_000 / st.rates.prefill_tokens_per_s  # the prior's rate: nothing measured here
    ds = [router.select(prof(session=f"s{i}", tokens=60_000), t) for i in range(3)]
    assert st.prefill_busy_until == pytest.approx(t + 3 * prefill) and st.pending_tokens == 180_000
    # a second later the engine counts two more first tokens: the two oldest prefills are over, the third runs now
    _first_tokens(router, t + 1, 7)
    assert st.prefill_busy_until == pytest.approx(t + 1 + prefill) and st.pending_tokens == 60_000
    # what a request predicts there follows: one prefill ahead, not three
    nxt = router.select(prof(session="next", tokens=600), t + 1)
    assert nxt.predicted_ttft_s < 1.5 * prefill
    # their ends give back nothing more: the queue is the third's and the new one's
    for d in ds[:2]:
        router.release(d.reservation, t + 2)
    assert st.prefill_busy_until == pytest.approx(t + 1 + prefill + nxt.reservation.prefill_s)
    # a restarted engine's count begins again: it ends nobody's prefill; its next first token ends the oldest's
    _first_tokens(router, t + 3, 1)
    assert st.pending_tokens == 60_000 + nxt.reservation.pending_tokens
    _first_tokens(router, t + 4, 2)
    assert st.pending_tokens == nxt.reservation.pending_tokens
