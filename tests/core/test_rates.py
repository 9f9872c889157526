"""Rates learned from counters that engines move at different moments: vLLM counts prompt tokens at a request's
first token and generation tokens every step, but observes prefill and decode seconds when it finishes. While
load ramps up, a window holds more first tokens than finishes: tokens over seconds of the same window read the
replica as faster than it is. The brain pairs counters of the same requests instead."""

from __future__ import annotations

import dataclasses

import pytest

from extproc.core.load import BatchFit, LoadSample, Rates

PREFILL_S, COMPUTED, OUT, STEP_S = 0.5, 1000, 200, 0.05  # every request: 2,000 tokens/s prefill, 0.05 s a token


def _arrivals(seconds: float) -> list[float]:
    """A ramp: half a request a second at first, doubling every 20 s."""
    out, t = [], 0.0
    while t < seconds:
        out.append(t)
        t += 1.0 / (0.5 * 2 ** (t / 20))
    return out


def _scrape(arrivals: list[float], t: float) -> LoadSample:
    first = [a + PREFILL_S for a in arrivals if a + PREFILL_S <= t]
    done = [a for a in arrivals if a + PREFILL_S + OUT * STEP_S <= t]
    generated = sum(1 + min(OUT, int((t - f) / STEP_S)) for f in first)
    return LoadSample(prompt_tokens=COMPUTED * len(first), cached_tokens=0.0, computed_tokens=COMPUTED * len(first),
                      first_tokens=len(first), prompt_requests=len(first), prefill_seconds=PREFILL_S * len(done),
                      prefill_done=len(done),
                      computed_at_finish=COMPUTED * len(done), generation_tokens=generated,
                      generated_at_finish=(OUT + 1) * len(done), decode_seconds=OUT * STEP_S * len(done),
                      decode_done=len(done), requests_done=len(done))


def _learn(paired: bool, drop: tuple[str, ...] = ()) -> Rates:
    rates = Rates(5000.0, 0.03, 256.0, paired=paired)
    arrivals = _arrivals(120.0)
    t = 0.0
    while t < 120.0:
        s = _scrape(arrivals, t)
        rates.update(dataclasses.replace(s, **dict.fromkeys(drop)), t)
        t += 0.5
    return rates


@pytest.mark.parametrize("drop", [(), ("computed_at_finish",)], ids=["vllm 0.11", "vllm before 0.11"])
def test_C3_rates_learned_from_counters_of_the_same_requests_hold_through_a_ramp(drop):
    r = _learn(True, drop)
    assert r.prefill_tokens_per_s == pytest.approx(COMPUTED / PREFILL_S, rel=0.03)
    assert r.decode_s_per_token == pytest.approx(STEP_S, rel=0.03)
    assert r.output_tokens == pytest.approx(OUT + 1, rel=0.03)


def test_tokens_and_seconds_of_one_window_read_a_ramping_replica_too_fast():
    """What the brain learned before, on the same counters: the baseline the pairing is there to beat."""
    r = _learn(False)
    assert r.prefill_tokens_per_s > 1.15 * COMPUTED / PREFILL_S
    assert r.decode_s_per_token < STEP_S / 1.15


def _sglang_scrape(arrivals: list[float], t: float) -> LoadSample:
    """SGLang the other way round: prompt tokens counted when a request finishes, its prefill seconds
    (per_stage_req_latency_seconds{stage="prefill_forward"}) when its prefill ends."""
    first = [a for a in arrivals if a + PREFILL_S <= t]
    done = [a for a in arrivals if a + PREFILL_S + OUT * STEP_S <= t]
    return LoadSample(prompt_tokens=COMPUTED * len(done), cached_tokens=0.0, requests_done=len(done),
                      prompt_requests=len(done), first_tokens=len(first), prefill_seconds=PREFILL_S * len(first),
                      prefill_done=len(first))


@pytest.mark.parametrize("paired", [True, False])
def test_C3_sglang_prefill_rate_learned_from_its_prefill_stage_through_a_ramp(paired):
    rates = Rates(5000.0, 0.03, 256.0, paired=paired)
    arrivals = _arrivals(120.0)
    for i in range(240):
        rates.update(_sglang_scrape(arrivals, i * 0.5), i * 0.5)
    if paired:
        assert rates.prefill_tokens_per_s == pytest.approx(COMPUTED / PREFILL_S, rel=0.03)
    else:  # tokens lag the seconds: a ramping replica reads slow
        assert rates.prefill_tokens_per_s < COMPUTED / PREFILL_S / 1.15


def test_C3_sglang_decode_rate_learned_from_its_inter_token_latency():
    """SGLang counts generation tokens at finish and has no decode time; its inter-token latency histogram sums
    the intervals between streamed tokens over their count."""
    rates = Rates(5000.0, 0.03, 256.0)
    for i in range(60):
        rates.update(LoadSample(itl_seconds=0.02 * 400 * i, itl_tokens=400.0 * i, requests_done=2.0 * i,
                                generation_tokens=402.0 * i), float(i))
    assert rates.decode_s_per_token == pytest.approx(0.02, rel=0.02)
    assert rates.output_tokens == pytest.approx(201, rel=0.05)


def test_the_token_scale_is_the_engine_s_tokens_per_estimated_token_over_the_last_requests():
    from extproc.core.load import TokenScale

    s = TokenScale()
    engine = requests = 0
    s.update(LoadSample(prompt_tokens=0, prompt_requests=0))
    for k in range(100):  # the engine counts 1.5 of its tokens per estimated one
        s.sent(1_000 + 10 * k)
        engine += int(1.5 * (1_000 + 10 * k))
        requests += 1
        s.update(LoadSample(prompt_tokens=engine, prompt_requests=requests))
    assert s.learned and s.value == pytest.approx(1.5, rel=0.01)
    for _ in range(200):  # another tokenizer behind the same name (a new model): followed within the window
        s.sent(1_000)
        engine += 800
        requests += 1
        s.update(LoadSample(prompt_tokens=engine, prompt_requests=requests))
    assert s.value == pytest.approx(0.8, rel=0.02)
    s.update(LoadSample(prompt_tokens=0, prompt_requests=0))  # restarted: the counters begin again, the scale holds
    assert s.value == pytest.approx(0.8, rel=0.02)


def _batched(phases: list[tuple[int, float]], p0: float, kp: float, d0: float, kd: float, out: int = 20,
             per_scrape: int = 2, rates: Rates | None = None) -> Rates:
    """An engine whose speeds follow its batch, as a vLLM step's time does: each (batch, seconds) phase runs
    ``batch`` requests at once, and every finished request took p0 x (1 + kp x batch) seconds a prefill token and
    d0 x (1 + kd x batch) a decode token. ``per_scrape`` requests finish between two scrapes (0.5 s)."""
    r = rates or Rates(5000.0, 0.03, 256.0)
    done = computed = prefill_s = generated = decode_s = 0.0
    t = 0.0
    for batch, seconds in phases:
        end = t + seconds
        while t < end:
            done += per_scrape
            computed += per_scrape * COMPUTED
            prefill_s += per_scrape * COMPUTED * p0 * (1 + kp * batch)
            generated += per_scrape * (out + 1)
            decode_s += per_scrape * out * d0 * (1 + kd * batch)
            r.update(LoadSample(running=batch, prompt_tokens=computed, prompt_requests=done,
                                computed_at_finish=computed,
                                prefill_seconds=prefill_s, prefill_done=done, generated_at_finish=generated,
                                decode_seconds=decode_s, decode_done=done, requests_done=done), t)
            t += 0.5
    return r


PHASES = [(1, 30.0), (6, 30.0), (2, 30.0), (8, 30.0), (3, 30.0)]


def test_C3_rates_follow_the_batch_the_engine_runs():
    """A replica whose step time grows with its batch (as vLLM's does: a step schedules every running request) is
    priced at the batch it runs: within 5% at one request and at eight, where one rate for all batches is off by
    more than 15% at one end or the other."""
    p0, kp, d0, kd = 1 / 20_000, 0.05, 0.002, 0.15
    line = _batched(PHASES, p0, kp, d0, kd)
    one = _batched(PHASES, p0, kp, d0, kd, rates=Rates(5000.0, 0.03, 256.0, batch=False))
    for b in (1, 8):
        prefill, decode = line.at_batch(b)
        assert prefill == pytest.approx(1 / (p0 * (1 + kp * b)), rel=0.05)
        assert decode == pytest.approx(d0 * (1 + kd * b), rel=0.05)
    worst = max(abs(one.at_batch(b)[1] - d0 * (1 + kd * b)) / (d0 * (1 + kd * b)) for b in (1, 8))
    assert worst > 0.15


def test_C3_a_rate_is_not_extrapolated_past_the_batches_it_was_learned_at():
    r = _batched(PHASES, 1 / 20_000, 0.05, 0.002, 0.15)
    assert r.at_batch(40) == r.at_batch(8)
    assert r.at_batch(8)[1] > r.at_batch(1)[1]


def test_C3_samples_that_all_saw_one_batch_give_one_rate_not_a_slope():
    r = _batched([(3, 120.0)], 1 / 20_000, 0.05, 0.002, 0.15)
    assert r.decode_slope == 0.0 and r.prefill_slope == 0.0
    assert r.decode_s_per_token == pytest.approx(0.002 * 1.45, rel=0.01)


def test_C3_a_slope_of_a_tenth_of_a_percent_over_the_batches_seen_is_the_data_s_not_rounding():
    """Samples of one batch give no slope (above): their fitted slope is rounding and is set to none. That guard is
    for rounding only: a request beside others slowing each by 0.1% over the batches its samples saw (1 and 3, weighted
    by thousands of tokens) is a slope the line keeps."""
    fit = BatchFit(1e-4)
    for k in range(40):
        batch = 1.0 if k % 2 else 3.0
        fit.add(batch, 1e-4 * (1 + 0.001 * (batch - 1)), k == 0, 5_000.0)
    assert fit.c > 0.0 and fit.at(3.0) > fit.at(1.0)


def test_C3_an_engine_much_faster_than_the_prior_is_learned_as_it_is():
    """A small model decodes at ~2 ms a token where the prior says 30: a sample that far from the prior is the
    engine, not an artefact (a bound of 8x held it at 3.75 ms)."""
    r = _batched([(1, 60.0)], 1 / 40_000, 0.0, 0.002, 0.0)
    assert r.decode_s_per_token == pytest.approx(0.002, rel=0.02)
    assert r.prefill_tokens_per_s == pytest.approx(40_000 / 1, rel=0.02)


def test_C3_samples_whose_batches_barely_differ_do_not_make_a_steep_slope_of_their_noise():
    """Two batches 0.1 request apart whose times differ by 20% (noise: nothing runs beside a tenth of a request)
    would be a slope of 40% a request by least squares alone; the pull towards none keeps it a few per cent."""
    from extproc.core.load import BatchFit

    fit = BatchFit(0.001)
    for k in range(40):
        b, y = (3.0, 0.0009) if k % 2 else (3.1, 0.0011)
        fit.add(b, y, k == 0)
    assert 0.0 <= fit.slope < 0.05
    assert fit.at(3.05) == pytest.approx(0.001, rel=0.05)


def test_C3_a_sample_past_64x_of_the_prior_is_taken_as_an_artefact_and_clipped():
    r = _batched([(1, 60.0)], 1 / 40_000, 0.0, 0.0003, 0.0)  # 100x faster than the 30 ms prior: no engine is
    assert r.decode_s_per_token == pytest.approx(0.03 / 64, rel=0.01)


def test_C3_a_replica_never_measured_slows_with_its_batch_as_the_measured_ones_do():
    from extproc.core.load import effective_rates

    measured = _batched(PHASES, 1 / 20_000, 0.05, 0.002, 0.15)
    new = Rates(5000.0, 0.03, 256.0)
    now = 150.0
    _, idle = effective_rates([measured, new], now, 60.0, [0, 0])
    _, busy = effective_rates([measured, new], now, 60.0, [0, 6])
    assert busy[1] / idle[1] == pytest.approx(1 + measured.decode_slope * 6, rel=0.01)
    assert measured.decode_slope > 0.1


def test_C3_a_replica_never_measured_is_priced_as_the_slowest_measured_one_even_when_none_is_fresh():
    """A fleet whose measured replicas last sampled longer ago than warm.rate_fresh_s: the never-measured one is priced
    at the slowest measured rate, not at its prior (on a fast fleet the prior made it look 19x slower, and a turn left
    its home for a measured replica)."""
    from extproc.core.load import effective_rates

    fast, slow, never = Rates(5_000.0, 0.03, 100.0), Rates(5_000.0, 0.03, 100.0), Rates(5_000.0, 0.03, 100.0)
    fast.prefill_tokens_per_s, fast.prefill_at = 90_000.0, 0.0
    slow.prefill_tokens_per_s, slow.prefill_at = 60_000.0, 0.0
    prefill, _ = effective_rates([fast, slow, never], now=1_000.0, fresh_s=60.0)  # none sampled within 60 s
    assert prefill == [90_000.0, 60_000.0, 60_000.0]
    prefill, _ = effective_rates([never, never], now=1_000.0, fresh_s=60.0)  # nothing measured: the prior
    assert prefill == [5_000.0, 5_000.0]


def test_C3_restore_time_is_learned_from_the_connector_s_load_seconds_over_the_tokens_it_loaded():
    """Issue 63: vllm:kv_offload_load_time over prompt_tokens_by_source{external_kv_transfer}, summed over scrapes
    until 2,048 tokens are behind a sample (a load's seconds and its tokens may land in different scrapes); a
    replica without the connector's counter learns nothing; a counter reset starts again."""
    r = Rates(5000.0, 0.03, 256.0)
    assert r.restore_s_per_token is None
    plain = Rates(5000.0, 0.03, 256.0)
    for k in range(3):  # no offloading connector: P/D transfers alone, no load seconds exported
        plain.update(LoadSample(restored_tokens=5000 * k), float(k))
    assert plain.restore_s_per_token is None
    r.update(LoadSample(restored_tokens=0, restore_seconds=0.0), 0.0)
    r.update(LoadSample(restored_tokens=0, restore_seconds=0.1024), 1.0)  # the loads ended, first tokens not yet
    assert r.restore_s_per_token is None
    r.update(LoadSample(restored_tokens=1024, restore_seconds=0.1024), 2.0)  # 1,024 tokens: not enough yet
    assert r.restore_s_per_token is None
    r.update(LoadSample(restored_tokens=2048, restore_seconds=0.2048), 3.0)
    assert r.restore_s_per_token == pytest.approx(1e-4)
    r.update(LoadSample(restored_tokens=10, restore_seconds=0.001), 3.0)  # the engine restarted
    r.update(LoadSample(restored_tokens=10 + 4096, restore_seconds=0.001 + 0.8192), 4.0)
    assert r.restore_s_per_token == pytest.approx(1e-4 + 0.3 * (2e-4 - 1e-4))


def _finished(n: int, tokens_per_s: float, prompt: int = 200) -> LoadSample:
    """Counters after ``n`` finished requests of ``prompt`` computed tokens each at ``tokens_per_s``."""
    return LoadSample(prompt_tokens=prompt * n, computed_tokens=prompt * n, prompt_requests=n, first_tokens=n,
                      prefill_seconds=n * prompt / tokens_per_s, prefill_done=n, computed_at_finish=prompt * n,
                      requests_done=n)


def test_C3_a_replica_s_first_ten_requests_replace_the_prior_provisionally_and_the_next_sample_replaces_them():
    # a fast engine (50,000 tok/s): ten small requests are 0.04 s of prefill, far below a fifth of a sample's seconds
    rates = Rates(5000.0, 0.03, 256.0)
    rates.update(_finished(0, 50_000.0), 0.0)
    rates.update(_finished(9, 50_000.0), 1.0)
    assert rates.prefill_tokens_per_s == 5000.0 and rates.prefill_noise == 0.0  # nine: still the prior
    rates.update(_finished(10, 50_000.0), 2.0)
    assert rates.prefill_tokens_per_s == pytest.approx(50_000.0) and rates.prefill_at == 2.0
    assert rates.prefill_noise == pytest.approx(0.5 / 10 ** 0.5)  # ten requests' noise: ~16%
    # the engine was in fact 40,000 tok/s: a fifth of a sample's seconds replaces the provisional one, not averaged
    base = _finished(10, 50_000.0)
    more = _finished(6000, 40_000.0)
    rates.update(dataclasses.replace(more, prefill_seconds=base.prefill_seconds + more.prefill_seconds
                                     - _finished(10, 40_000.0).prefill_seconds), 3.0)
    assert rates.prefill_tokens_per_s == pytest.approx(40_000.0, rel=0.01) and rates.prefill_noise == 0.0


def test_C3_like_replicas_measured_on_a_few_requests_each_are_a_tie_not_a_difference_of_hardware():
    from extproc.core import RouterConfig

    from ..helpers import live_router, prof

    router, t = live_router(2, RouterConfig(policy="warm"))
    pol = router.policy
    for r, rate in zip(router.replicas, (10_000.0, 10_500.0)):  # 5% apart: ten requests' noise
        st = pol.states.of(r)
        st.rates.prefill_tokens_per_s, st.rates.prefill_at, st.rates.prefill_noise = rate, t, 0.16
    went = []
    for i in range(8):  # new sessions one at a time, each done before the next: nothing queued anywhere
        d = router.select(prof(session=f"s{i}", tokens=4000), t + i)
        went.append(d.replica.name)
        router.release(d.reservation, t + i + 0.5)
    assert went.count("r0") >= 3 and went.count("r1") >= 3, went  # spread, as between replicas priced alike
    for r in router.replicas:  # measured on seconds of prefill: the 5% is the hardware's, and it wins
        pol.states.of(r).rates.prefill_noise = 0.0
    went = []
    for i in range(8):
        d = router.select(prof(session=f"t{i}", tokens=4000), t + 10 + i)
        went.append(d.replica.name)
        router.release(d.reservation, t + 10 + i + 0.5)
    assert went.count("r1") >= 6, went


def test_C3_a_prefill_replica_never_measured_is_priced_as_its_measured_decode_peer_not_at_the_prior():
    """A prefill leg's replicas see few and short requests: priced among themselves, never measured, they stayed at the
    5,000 tok/s prior beside decode replicas measured at 19,000, and a 30K-token prompt was prefilled where it was
    decoded, stalling the streams there (a P/D test failed so on a loaded machine). Their decode peer's measured rate
    counts for them; a measured prefill replica keeps its own."""
    from extproc.core.load import effective_rates

    decode_peer, p0, p1 = Rates(5_000.0, 0.03, 100.0), Rates(5_000.0, 0.03, 100.0), Rates(5_000.0, 0.03, 100.0)
    decode_peer.prefill_tokens_per_s, decode_peer.prefill_at = 19_000.0, 990.0
    decode_peer.decode_s_per_token, decode_peer.decode_at = 0.004, 990.0
    prefill, decode = effective_rates([p0, p1], now=1_000.0, fresh_s=60.0, batches=[0, 0], peers=[decode_peer])
    assert prefill == [19_000.0, 19_000.0] and decode == [0.004, 0.004]
    assert effective_rates([p0, p1], now=1_000.0, fresh_s=60.0)[0] == [5_000.0, 5_000.0]  # no peer: the prior
    p1.prefill_tokens_per_s, p1.prefill_at = 30_000.0, 995.0
    prefill, _ = effective_rates([p0, p1], now=1_000.0, fresh_s=60.0, batches=[0, 0], peers=[decode_peer])
    assert prefill == [30_000.0, 30_000.0]  # a fresh prefill replica's own rate: the level the others are priced at


def test_C3_one_prefill_replica_never_measured_beside_more_measured_decode_peers_is_priced_at_their_level():
    """The peers may outnumber the replicas priced: a fleet's one prefill replica, never measured, beside two
    measured decode replicas (the real P/D test's fleet once its second decode replica has counted). Priced
    with its batch, the unmeasured branch must still run: it raised UnboundLocalError, and every disaggregated
    decision after the decode replicas were measured failed open."""
    from extproc.core.load import effective_rates

    never, d1, d2 = Rates(5_000.0, 0.03, 100.0), _batched(PHASES, 1 / 20_000, 0.05, 0.002, 0.15), \
        _batched(PHASES, 1 / 20_000, 0.05, 0.002, 0.15)
    prefill, decode = effective_rates([never], now=150.0, fresh_s=60.0, batches=[4], peers=[d1, d2])
    idle, _ = effective_rates([never], now=150.0, fresh_s=60.0, batches=[0], peers=[d1, d2])
    assert prefill[0] == idle[0] < 5_000.0 * 10  # at the measured ones' level, not at the prior
    assert decode[0] > 0


def test_C3_a_prefill_is_priced_at_the_replica_s_rate_beside_no_other_request_and_its_decode_at_its_batch():
    """vLLM computes the prompts waiting at a replica first come first served within each step's token budget
    (chunked prefill): a prompt decided beside six others waits for theirs (the queue ahead, booked when they were
    decided) and is then computed at the engine's rate. Priced at the rate the batch's samples show as well, the
    prompts sharing its steps counted twice: predictions on real vLLM in overload 0.58-1.20 MAPE. Its decode, one
    token a step of the whole batch, still slows with the batch."""
    from extproc.core.load import effective_rates

    measured = _batched(PHASES, 1 / 20_000, 0.05, 0.002, 0.15)
    assert measured.prefill_slope > 0 and measured.decode_slope > 0  # the batch's samples were slower
    (idle_p,), (idle_d,) = effective_rates([measured], 150.0, 60.0, [0])
    (busy_p,), (busy_d,) = effective_rates([measured], 150.0, 60.0, [6])
    assert busy_p == idle_p == pytest.approx(measured.prefill_tokens_per_s)
    assert busy_d == pytest.approx(idle_d * (1 + measured.decode_slope * 6), rel=0.01) and busy_d > idle_d


def test_C3_a_rate_is_the_engine_s_tokens_over_its_seconds_when_windows_cover_few_tokens_and_many():
    """Each sample is ~5 s of prefill (or 500 generated tokens) however many tokens those seconds covered: here
    windows of 500 and of 20,000 prefill tokens in 5 s alternate (2,050 tokens/s over the run), and of 500 generated
    tokens in 50 s and 5,000 in 5 s (0.01 s a token). A plain mean of each sample's seconds per token is pulled to
    the windows of few tokens (~200 tokens/s, ~0.05 s a token); each sample weighing its tokens reads the engine as it
    ran (within issue 62's 1.5x: the newest samples weigh most)."""
    r = Rates(5000.0, 0.03, 256.0)
    computed = prefill_s = done = generated = decode_s = 0.0
    for k in range(40):
        computed += 500 if k % 2 else 20_000
        prefill_s += 5.0
        generated += 500 if k % 2 else 5_000
        decode_s += 50.0 if k % 2 else 5.0
        done += 10
        r.update(LoadSample(running=2, prompt_tokens=computed, prompt_requests=done, computed_at_finish=computed,
                            prefill_seconds=prefill_s, prefill_done=done, generated_at_finish=generated + done,
                            decode_seconds=decode_s, decode_done=done, requests_done=done), 5.0 * k)
    assert 1 / 1.5 < r.prefill_tokens_per_s / (20_500 / 10.0) < 1.5
    assert 1 / 1.5 < r.decode_s_per_token / (55.0 / 5_500) < 1.5
