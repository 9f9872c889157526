"""The warm policy's state of one replica: its queue of predicted prefills, corrected by the engine's own count of
first tokens (issue 62: a prefill over early kept its predicted seconds in the queue until the request ended, and a
simulated fleet's turns were predicted 10-30 s of wait in front of an idle engine)."""

from __future__ import annotations

import pytest

from extproc.core import HealthConfig, LoadSample, RouterConfig

from ..helpers import live_router, prof

WARM = RouterConfig(policy="warm", health=HealthConfig(stale_scrape_intervals=1e9))


def _first_tokens(router, t: float, count: float) -> None:
    router.on_load("r0", LoadSample(1, 0, 0.1, first_tokens=count), t)


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


def test_C3_a_request_ended_before_its_first_token_was_counted_is_not_matched_with_another_s_first_token():
    router, t = live_router(1, WARM)
    st = router.policy.states.of(router.replicas[0])
    _first_tokens(router, t, 0)
    prefill = 60_000 / st.rates.prefill_tokens_per_s
    failed, waiting = (router.select(prof(session=s, tokens=60_000), t) for s in ("failed", "waiting"))
    router.release(failed.reservation, t + 0.5)  # a reset before its first token: the engine will never count it
    assert st.prefill_busy_until == pytest.approx(t + 0.5 + prefill)
    _first_tokens(router, t + 1, 1)  # the one first token counted is the second request's
    assert st.prefill_busy_until == pytest.approx(t + 1) and st.pending_tokens == 0
    assert not waiting.reservation.released


def test_C3_first_tokens_count_from_the_next_scrape_after_an_ejection_or_a_count_that_is_no_number():
    router, t = live_router(1, WARM)
    r0 = router.replicas[0]
    st = router.policy.states.of(r0)
    _first_tokens(router, t, 0)
    router.select(prof(session="a", tokens=60_000), t)
    router.policy.on_health(r0, True)  # ejected: what it was booked is gone, the count begins again
    assert not st.queued and st.first_tokens is None
    _first_tokens(router, t + 1, float("nan"))  # a broken exporter: no count, nothing queued against it
    router.select(prof(session="b", tokens=60_000), t + 1)
    assert st.first_tokens is None and not st.queued


def test_C3_a_replica_s_queue_of_first_tokens_to_come_is_bounded(monkeypatch):
    import extproc.core.warm_replica as wr

    monkeypatch.setattr(wr, "MAX_QUEUED", 5)
    router, t = live_router(1, WARM)
    st = router.policy.states.of(router.replicas[0])
    _first_tokens(router, t, 0)
    for i in range(9):  # an engine whose counter stopped moving: its queue holds no more than the bound
        router.select(prof(session=f"s{i}", tokens=600), t)
    assert len(st.queued) == 5


def test_C3_a_first_token_far_past_its_prediction_teaches_no_first_token_overhead():
    router, t = live_router(1, WARM)
    st = router.policy.states.of(router.replicas[0])
    d = router.select(prof(session="q", tokens=600), t)
    predicted = d.reservation.predicted_ttft_s
    for observed, learned in ((predicted + 0.03, 1), (predicted + 1.5, 0), (4 * predicted + 0.02, 1)):
        before = len(st.overhead.samples)
        router.first_token_observed(d.reservation, observed, t + 1)
        # 30 ms is an API server's own work; 1.5 s past a prediction is a queue the model did not see; a slow
        # prediction's few tenths over it still teach (3x, and at least 1 s: QUEUED, QUEUED_S)
        assert len(st.overhead.samples) - before == learned, (observed, predicted)
