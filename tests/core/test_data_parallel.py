"""A replica with several data-parallel engines (vLLM --data-parallel-size, SGLang --dp): one front end, each
engine its own scheduler and KV cache. The brain prices each engine and, by default, names the chosen one in
X-data-parallel-rank; where it may not, it predicts the front end's own choice."""

from __future__ import annotations

import dataclasses

from extproc.brain.decide import route_answer
from extproc.contract import ANSWER_DP_RANK, DP_RANK_HEADER, METADATA_NAMESPACE
from extproc.core import HealthConfig, LoadSample, RouterConfig, WarmConfig
from extproc.picker.front import destination_answer

from ..helpers import chain, live_router, prof

WARM = RouterConfig(policy="warm", health=HealthConfig(stale_scrape_intervals=1e9))


def _engines(*per: tuple[int, int, float], cache: int = 16 * 5000) -> LoadSample:
    engines = tuple(LoadSample(r, w, kv, cache_tokens=cache) for r, w, kv in per)
    return LoadSample(sum(e.running for e in engines), sum(e.waiting for e in engines),
                      max(e.kv_usage for e in engines), cache_tokens=cache * len(engines), engines=engines)


def _one_dp_replica(cfg=WARM, engines=2):
    router, t = live_router(1, cfg)
    router.on_load("r0", _engines(*[(0, 0, 0.0)] * engines), t)
    return router, t


def turn(router, t, session, tokens=8_000):
    """A turn of a session with a system prompt of its own (no hit anywhere else)."""
    return router.select(prof(session=session, tokens=tokens, blocks=chain(session, session, tokens)), t)


def test_C2_each_engine_has_its_own_cache_of_its_own_size():
    router, t = _one_dp_replica()
    subs = router.policy.states.engines["r0"]
    assert [s.index.capacity for s in subs] == [5000, 5000]  # not one cache of 10,000 blocks
    assert router.policy.engine_count("r0") == 2


def test_C4_a_session_stays_on_its_engine_and_a_second_one_takes_the_other():
    router, t = _one_dp_replica()
    a = turn(router, t, "a")
    b = turn(router, t, "b")
    assert a.steer and b.steer and {a.engine, b.engine} == {0, 1}  # the idle engine, not the busy one
    router.release(a.reservation, t + 1)
    router.release(b.reservation, t + 1)
    again = turn(router, t + 5, "a", 9_000)
    assert again.engine == a.engine and again.cached_tokens >= 7_900  # its context is in that engine's cache
    # what one engine holds is no hit on the other
    other = router.policy.states.engines["r0"][1 - a.engine]
    assert other.index.match(chain("a", "a", 8_000)) < 50


def test_C3_each_engine_s_queue_is_its_own():
    router, t = _one_dp_replica()
    router.on_load("r0", _engines((8, 30, 0.9), (1, 0, 0.1)), t)
    assert turn(router, t, "new").engine == 1


def test_without_steering_the_engine_is_the_front_end_s_choice():
    cfg = dataclasses.replace(WARM, warm=WarmConfig(steer_data_parallel=False))
    router, t = _one_dp_replica(cfg)
    # vLLM's front end: the least waiting x 4 + running. Engine 0: 4 x 1 + 0 = 4; engine 1: 0 + 3 = 3
    router.on_load("r0", _engines((0, 1, 0.2), (3, 0, 0.2)), t)
    d = turn(router, t, "x")
    assert d.engine == 1 and not d.steer


def test_the_answer_names_the_engine_when_it_steers():
    out = route_answer("r0", "7.abc", "request_body", 1)
    headers = {h.header.key: h.header.raw_value.decode() or h.header.value
               for h in out.request_body.response.header_mutation.set_headers}
    assert headers[DP_RANK_HEADER] == "1"
    assert out.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields[ANSWER_DP_RANK].string_value == "1"
    none = route_answer("r0", "7.abc", "request_body")
    assert DP_RANK_HEADER not in {h.header.key for h in none.request_body.response.header_mutation.set_headers}
    assert ANSWER_DP_RANK not in none.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields
    picked = destination_answer(["10.0.0.1:8000"], None, "request_headers", 0)
    assert DP_RANK_HEADER in {h.header.key for h in picked.request_headers.response.header_mutation.set_headers}


def test_a_replica_that_drops_to_one_engine_is_priced_whole_again():
    router, t = _one_dp_replica()
    router.on_load("r0", LoadSample(0, 0, 0.0, cache_tokens=16 * 5000), t + 1)
    assert router.policy.engine_count("r0") == 1
    d = turn(router, t + 1, "z")
    assert d.engine is None and not d.steer


def test_steering_keeps_a_session_on_its_engine_where_the_front_end_would_move_it():
    """Its cache is on one engine; the front end's rule (least waiting x 4 + running) would send the next turn to
    the other. Steered, the brain names the engine that holds the context."""
    router, t = _one_dp_replica()
    a = turn(router, t, "a")
    router.release(a.reservation, t + 1)
    busy = [(0, 0, 0.1), (0, 0, 0.1)]
    busy[a.engine] = (3, 0, 0.2)  # running 3 there, nothing on the other: the front end picks the other
    router.on_load("r0", _engines(*busy), t + 2)
    again = turn(router, t + 5, "a", 9_000)
    assert again.engine == a.engine and again.steer and again.cached_tokens >= 7_900
    unsteered = dataclasses.replace(WARM, warm=WarmConfig(steer_data_parallel=False))
    router2, t2 = _one_dp_replica(unsteered)
    first = turn(router2, t2, "a")
    router2.release(first.reservation, t2 + 1)
    busy = [(0, 0, 0.1), (0, 0, 0.1)]
    busy[first.engine] = (3, 0, 0.2)
    router2.on_load("r0", _engines(*busy), t2 + 2)
    moved = turn(router2, t2 + 5, "a", 9_000)
    assert moved.engine != first.engine and not moved.steer and moved.cached_tokens == 0


def test_the_picker_names_no_engine_when_a_fallback_does_not_have_it():
    """The gateway retries on the fallbacks with the same headers: a rank one of them lacks would be refused."""
    from extproc.config import parse_config

    from ..helpers import live_brain

    cfg = parse_config({"replicas": [{"name": f"r{i}", "url": f"http://127.0.0.{i + 1}:8000"} for i in range(2)],
                        "brain": {"protocol": "endpoint-picker", "picker_fallbacks": 1}})
    brain = live_brain(cfg)
    t = brain.clock()
    body = b'{"messages": [{"role": "user", "content": "hi"}]}'
    brain.router.on_load("r0", _engines((0, 0, 0.0), (0, 0, 0.0)), t)
    brain.router.on_load("r1", _engines((0, 0, 0.0), (0, 0, 0.0)), t)
    picks = [brain.picks.pick({"x-session-id": f"s{i}"}, body, None) for i in range(4)]
    assert {p.dp_rank for p in picks} == {0, 1}  # both have two engines: the rank is named
    brain.router.on_load("r1", LoadSample(0, 0, 0.0, cache_tokens=16 * 5000), t)  # r1: one engine now
    alone = [brain.picks.pick({"x-session-id": f"u{i}"}, body, ["127.0.0.1:8000"]) for i in range(4)]
    assert {p.dp_rank for p in alone} == {0, 1}  # no fallback: the engine chosen is named, whichever it is
    seen = set()
    for i in range(12):
        p = brain.picks.pick({"x-session-id": f"v{i}"}, body, None)
        if len(p.endpoints) == 2 and p.endpoints[0] == "127.0.0.1:8000":
            # r1, the fallback, has engine 0 only: r0's engine 1 may not be named
            assert p.dp_rank == (None if p.reservation.engine == 1 else 0)
            seen.add(p.reservation.engine)
    assert seen == {0, 1}
