"""The vLLM engine model: prefix caching, KV accounting, queueing, chunked prefill, preemption."""

from __future__ import annotations

import random

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.tools.engine.model import BLOCK, Engine, EngineConfig, EngineRequest


def req(rid, shared_blocks, own_blocks, max_tokens=20, t=0.0, salt=0):
    blocks = list(range(1000, 1000 + shared_blocks)) + [(salt << 32) | (rid << 16) | j for j in range(own_blocks)]
    return EngineRequest(rid, blocks, len(blocks) * BLOCK, max_tokens, t)


def drain(e: Engine, t: float = 0.0, horizon: float = 0.0) -> float:
    while e.busy:
        d, _, _ = e.step(t, horizon)
        assert d > 0
        t += d
    return t


def test_a_warm_prefix_is_not_prefilled_again():
    e = Engine()
    a = req(1, 300, 20)
    e.add(a)
    t = drain(e)
    b = req(2, 300, 20)
    e.add(b)
    drain(e, t)
    assert a.cached_tokens == 0
    assert b.cached_tokens == 300 * BLOCK  # the shared system prompt hit; its own blocks did not
    assert (b.first_token_at - t) < (a.first_token_at - 0) / 3  # prefill only the uncached part
    assert e.prefix_queries == 2 * 320 * BLOCK and e.prefix_hits == 300 * BLOCK


def test_every_block_comes_back_when_requests_finish():
    e = Engine(EngineConfig(kv_tokens=20_000))
    rng = random.Random(1)
    t = 0.0
    for i in range(60):
        e.add(req(i, rng.choice([0, 50, 100]), rng.randrange(1, 60), rng.randrange(1, 80), t))
        if i % 7 == 0:
            t = drain(e, t, horizon=0.5)
    drain(e, t, horizon=0.5)
    assert e.used_blocks == 0
    assert e.free_blocks + len(e.cached) == e.cfg.num_blocks
    assert e.finished == 60


def test_requests_queue_when_max_num_seqs_is_reached():
    e = Engine(EngineConfig(max_num_seqs=2))
    for i in range(5):
        e.add(req(i, 0, 2, max_tokens=50, salt=i))
    e.step(0.0)
    assert (e.num_running, e.num_waiting) == (2, 3)


def test_chunked_prefill_respects_the_token_budget():
    e = Engine(EngineConfig(max_num_batched_tokens=512))
    big = req(1, 0, 200)  # 3200 tokens
    e.add(big)
    d, first, _ = e.step(0.0)
    assert big.computed == 512 and not first
    steps = 1
    while not big.first_token_at:
        e.step(0.0)
        steps += 1
    assert steps == -(-3200 // 512)


def test_preemption_when_kv_runs_out_sends_the_newest_back_to_the_queue():
    e = Engine(EngineConfig(kv_tokens=64 * BLOCK, max_num_seqs=8))
    for i in range(3):
        e.add(req(i, 0, 20, max_tokens=200, salt=i))  # 3 x 20 blocks fit; growth does not
    drain(e)
    assert e.preemptions >= 1
    assert e.finished == 3 and e.used_blocks == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 80), st.integers(1, 40), st.integers(1, 120)), min_size=1, max_size=25),
       st.integers(4_000, 40_000))
def test_kv_accounting_holds_for_any_mix(items, kv):
    e = Engine(EngineConfig(kv_tokens=kv, max_num_seqs=6))
    for i, (shared, own, out) in enumerate(items):
        if (shared + own + out // BLOCK + 2) * BLOCK > kv:
            continue  # a request larger than the whole cache cannot run on this replica
        e.add(req(i, shared, own, out))
    t = 0.0
    while e.busy:
        d, _, _ = e.step(t, 0.3)
        t += d
        assert 0 <= e.used_blocks <= e.cfg.num_blocks
        assert e.used_blocks + e.free_blocks + len(e.cached) == e.cfg.num_blocks
    assert e.used_blocks == 0


def test_decode_steps_get_slower_with_batch_and_context():
    one = Engine()
    one.add(req(1, 0, 4, max_tokens=100))
    one.step(0.0)
    d1, _, _ = one.step(0.0)
    many = Engine()
    for i in range(32):
        many.add(req(i, 0, 500, max_tokens=100, salt=i))
    while any(r.first_token_at is None for r in many.running) or many.waiting:
        many.step(0.0)
    d32, _, _ = many.step(0.0)
    assert d32 > d1


def _arrive_during_decode(horizon: float) -> tuple[float, int]:
    """One request decoding alone; a second arrives 0.05 s later (mid-run when steps are batched)."""
    e = Engine()
    a = req(1, 0, 10, max_tokens=400)
    b = req(2, 0, 30, t=0.05)
    e.add(a)
    t, added = 0.0, False
    while e.busy:
        if not added and t >= b.arrival:
            e.add(b)
            added = True
        d, _, _ = e.step(t, horizon)
        if not added and t + d > b.arrival:  # the arrival falls inside this step (or run of steps)
            end = e.cut_run(b.arrival)
            d = end - t if end is not None else d
            e.add(b)
            added = True
        t += d
    return b.first_token_at, a.generated


def test_a_request_arriving_during_a_run_of_decode_steps_is_admitted_at_the_next_step():
    # vLLM admits a new request at the next step boundary; the simulator's batched decode steps must not make
    # it wait for the whole run (which made co-located sessions look slower than they are)
    exact_first, exact_generated = _arrive_during_decode(horizon=0.0)
    batched_first, batched_generated = _arrive_during_decode(horizon=0.2)
    assert batched_first == pytest.approx(exact_first, abs=1e-9)
    assert batched_generated == exact_generated == 400


def test_a_request_is_not_admitted_by_a_step_that_starts_before_it_arrived():
    """A mock whose engine clock runs behind the wall clock catches up before it admits later arrivals: no request
    is scheduled, nor gets a first token, before it arrived."""
    e = Engine(EngineConfig())
    e.add(req(1, 0, 4, max_tokens=50, t=0.0))
    e.add(req(2, 0, 4, max_tokens=5, t=1.0))  # arrives at 1.0 s, while the engine is at 0
    t, admitted = 0.0, {}
    while e.busy:
        d, first, _ = e.step(t)
        if d == 0:  # nothing has arrived yet: an idle engine waits for the next arrival, as the mock's driver does
            t = e.waiting[0].arrival
            continue
        for r in e.running:
            admitted.setdefault(r.rid, r.scheduled_at)
        for r in first:
            assert r.first_token_at >= r.arrival
        t += d
    assert admitted[1] == 0.0 and admitted[2] >= 1.0


def test_eviction_takes_a_finished_context_s_tail_before_its_head():
    """vLLM frees a request's blocks tail first (``single_type_kv_cache_manager.free``), so a cache short of room
    evicts the end of a context and keeps the prefix its next turn can still hit (a prefix hit stops at its first
    missing block)."""
    e = Engine(EngineConfig(kv_tokens=100 * BLOCK))
    a = req(1, 0, 60, max_tokens=1)
    e.add(a)
    t = drain(e)
    e.add(req(2, 0, 70, max_tokens=1, salt=1))  # needs 30 of a's 60 cached blocks
    t = drain(e, t)
    again = EngineRequest(3, a.blocks, len(a.blocks) * BLOCK, 1, t)
    e.add(again)
    drain(e, t)
    assert again.cached_tokens >= 25 * BLOCK, again.cached_tokens  # its head survived


def test_a_cpu_tier_keeps_what_the_gpu_evicts_and_restores_it_faster_than_computing_it():
    """Issue 63: a prompt whose blocks the GPU evicted but the CPU tier kept is restored past its GPU hit (counted
    as cached, as vLLM's usage counts loaded tokens; timed in kv_offload_load_time), and its first token comes
    sooner than on the same engine without the tier."""
    def run(cpu_tier_tokens):
        e = Engine(EngineConfig(kv_tokens=600 * BLOCK, cpu_tier_tokens=cpu_tier_tokens))
        a = req(1, 400, 0)
        e.add(a)
        t = drain(e)
        e.add(req(2, 0, 500, t=t))  # 500 blocks of its own: most of a's cached blocks leave the GPU
        t = drain(e, t)
        b = req(3, 400, 0, t=t)
        e.add(b)
        drain(e, t)
        return e, b, b.first_token_at - t

    plain, b0, ttft0 = run(0)
    tiered, b1, ttft1 = run(100_000)
    gpu_hit = b0.cached_tokens
    assert gpu_hit < 200 * BLOCK and not plain.cpu and plain.restored_tokens_total == 0
    assert b1.cached_tokens == 400 * BLOCK - 1 and b1.restored_tokens == b1.cached_tokens - gpu_hit
    assert tiered.restored_tokens_total == b1.restored_tokens
    assert tiered.restore_seconds_total == pytest.approx(b1.restored_tokens * tiered.cfg.restore_s_per_token)
    assert ttft1 < 0.5 * ttft0


def test_the_cpu_tier_holds_at_most_its_size_least_recently_used_out():
    e = Engine(EngineConfig(kv_tokens=100 * BLOCK, cpu_tier_tokens=30 * BLOCK))
    t = 0.0
    for i in range(5):
        e.add(req(i, 0, 60, t=t, salt=i))
        t = drain(e, t)
    assert len(e.cpu) == 30
    newest = [h for h in req(3, 0, 60, salt=3).blocks]
    assert any(h in e.cpu for h in newest) and not any(h in e.cpu for h in req(0, 0, 60, salt=0).blocks)
