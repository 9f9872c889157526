"""A big fleet's decision (issue 33, item 9): who holds a chain (``Holders``), and the shortlist that a fleet of
SHORTLIST_FROM candidates or more prices instead of every candidate, checked against full pricing on the
simulator's workloads."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.shortlist import agreement, tracing
from extproc.core.prefix_index import _SAMPLE, Holders, PrefixIndex
from extproc.core.warm import SHORTLIST_FROM
from extproc.tools.sim.simulator import Simulation
from extproc.tools.workload.generate import WorkloadConfig

from ..helpers import chain, live_router, prof
from ..core.test_warm import WARM


def _truth(indexes: list[PrefixIndex]) -> dict[int, int]:
    want: dict[int, int] = {}
    for ix in indexes:
        for h in ix._stamp_of:
            if not h & _SAMPLE:
                want[h] = want.get(h, 0) | ix.bit
    return want


_OPS = st.lists(st.tuples(st.sampled_from(["turn", "turn", "turn", "new", "clear", "resize", "close"]),
                          st.integers(0, 2), st.integers(0, 5), st.integers(1, 90)), max_size=60)


@settings(max_examples=60, deadline=None)
@given(_OPS, st.integers(0, 2**32))
def test_holders_name_exactly_the_indexes_holding_each_sampled_block(ops, seed):
    """Turns extending shared chains, new chains, evictions (small caches), resets and dropped indexes: the map
    always says which index holds which sampled block, nothing more, nothing less."""
    rng = random.Random(seed)
    hs = Holders()
    indexes = [PrefixIndex(rng.choice([40, 120, 400]), hs) for _ in range(3)]
    systems = [[rng.getrandbits(64) for _ in range(30)] for _ in range(2)]
    sessions = [list(systems[k % 2]) for k in range(6)]  # each session's chain, extended turn by turn
    for op, i, k, n in ops:
        ix = indexes[i]
        if op == "turn":
            sessions[k].extend(rng.getrandbits(64) for _ in range(n))
            ix.insert(sessions[k])
        elif op == "new":
            sessions[k] = list(systems[k % 2]) + [rng.getrandbits(64) for _ in range(n)]
            ix.insert(sessions[k])
        elif op == "clear":
            ix.clear()
        elif op == "resize":
            ix.resize(n)
        else:
            ix.close()
            indexes[i] = PrefixIndex(rng.choice([40, 120, 400]), hs)  # its bit is reused
        assert hs.of == _truth(indexes)
        assert len({ix.bit for ix in indexes}) == 3


def test_levels_name_the_holders_deepest_first():
    hs = Holders()
    a, b, c, d = (PrefixIndex(10_000, hs) for _ in range(4))
    rng = random.Random(7)
    ch = [rng.getrandbits(64) for _ in range(400)]
    a.insert(ch[:400])
    b.insert(ch[:250])
    c.insert(ch[:250])
    d.insert(ch[:40])
    other = [rng.getrandbits(64) for _ in range(100)]
    levels = hs.levels(ch)
    assert [mask for mask, _ in levels] == [a.bit, b.bit | c.bit, d.bit]
    depths = [depth for _, depth in levels]
    # sampled blocks are one in eight: a depth is known to within the gap to the next sampled block
    assert 400 - 40 < depths[0] <= 400 and 250 - 40 < depths[1] <= 250 and depths[2] <= 40
    assert hs.levels(other) == []
    d.close()
    assert [mask for mask, _ in hs.levels(ch)] == [a.bit, b.bit | c.bit]
    late = PrefixIndex(10_000)  # an index from before the fleet grew big enough to keep the map
    late.insert(ch[:300])
    hs.track(late)
    assert [mask for mask, _ in hs.levels(ch)] == [a.bit, late.bit, b.bit | c.bit]
    assert hs.of == _truth([a, b, c, late])


def _agreement(n: int, load: float, seed: int, minutes: float, speeds=None) -> list:
    sim = Simulation("warmroute", replicas=n, workload=WorkloadConfig(minutes=minutes).at_load(load), seed=seed,
                     replica_speeds=speeds)
    policy = sim.policy.router.policy
    verify = agreement(policy)
    sim.run()
    return verify


@pytest.mark.parametrize("n, load, seeds, speeds", [
    (48, 12.0, (3,), None),
    # three speeds, loaded: six seeds pooled, since one seed's share moves by ~1% (0.5-1.3% not chosen alike over
    # seeds 1-6, 0.8-0.9% on the whole, before and after the prefill was priced at no batch and the samples weighed
    # by their tokens; seeds 4 and 5 alone 1.1% with the weights)
    (40, 14.0, (1, 2, 3, 4, 5, 6), tuple([1.0, 1.0, 0.7, 0.7, 0.4, 0.4][i % 6] for i in range(40))),
])
def test_C3_a_big_fleet_s_shortlist_chooses_what_full_pricing_chooses_on_the_simulator_s_workloads(n, load, seeds,
                                                                                                   speeds):
    """Every shortlisted decision is priced once more over every candidate, under the same view of the fleet."""
    verify = [x for seed in seeds for x in _agreement(n, load, seed, 3.0, speeds)]
    assert len(verify) > 300
    same = sum(short == full for short, full, _, _ in verify) / len(verify)
    tied = sum(t for _, _, t, _ in verify) / len(verify)
    assert same >= 0.99 and tied >= 0.99, (same, tied)


def test_C3_a_small_fleet_prices_every_candidate_as_always():
    router, t = live_router(SHORTLIST_FROM - 1, WARM)
    verify, trace = agreement(router.policy), tracing(router.policy)
    d = router.select(prof(session="s", tokens=4000, blocks=chain("sys", "s", 4000)), t)
    assert d.replica is not None and verify == []
    assert len(trace) == SHORTLIST_FROM - 1


def test_a_big_fleet_prices_a_shortlist_that_follows_the_pool_and_the_session():
    router, t = live_router(60, WARM)
    pol = router.policy
    trace = tracing(pol)
    first = router.select(prof(session="s", tokens=8000, blocks=chain("sys", "s", 8000)), t)
    assert 0 < len(trace) < 40  # a shortlist, not the 60
    router.release(first.reservation, t + 1)
    # many other conversations in flight elsewhere: the session's next turn still finds its replica
    held = [router.select(prof(session=f"o{i}", tokens=3000, blocks=chain(f"p{i}", f"o{i}", 3000)), t + 2)
            for i in range(40)]
    nxt = router.select(prof(session="s", tokens=9000, blocks=chain("sys", "s", 9000)), t + 3)
    assert nxt.replica is first.replica and nxt.cached_tokens >= 7900
    router.release(nxt.reservation, t + 3)
    # drained: the pool changed, the view with it
    router.drain(first.replica.name)
    again = router.select(prof(session="s", tokens=9100, blocks=chain("sys", "s", 9100)), t + 4)
    assert again.replica is not first.replica
    for d in held:
        router.release(d.reservation, t + 5)


def test_the_requests_sampled_blocks_remembered_are_bounded(monkeypatch):
    import extproc.core.prefix_index as pi

    monkeypatch.setattr(pi, "_MAX_ANCHORS", 200)
    hs = Holders()
    rng = random.Random(3)
    chains = [[rng.getrandbits(64) for _ in range(400)] for _ in range(30)]  # ~50 sampled blocks each
    for c in chains:
        assert hs.anchors(c) == [(i, h) for i, h in enumerate(c) if not h & _SAMPLE]
    assert hs._anchored == sum(len(v[2]) for v in hs._anchors.values()) <= 200
    assert len(hs._anchors) < 30
