"""vLLM's block hash reproduced, and one engine's residency believed only where its events prove the hash (issue 45).
The fixture is what a real vLLM 0.32 published for one prompt (``tests/fixtures/vllm-0.32/kv-events.bin``: msgpack
payloads, each after its 4-byte length; the prompt's tokens from its /tokenize)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.shortlist import tracing
from extproc.brain.kv_events import BadBatch, decode_batch, endpoint_for
from extproc.core.engine_cache import (
    ESTIMATED,
    EXACT,
    Cleared,
    EngineCache,
    Removed,
    Stored,
    chain,
    external,
    none_hash,
)

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.32"


def recorded(name: str = "kv-events.bin") -> list[list]:
    """Each payload of a fixture after its 4-byte length, decoded."""
    data = (FIX / name).read_bytes()
    out, i = [], 0
    while i < len(data):
        n = int.from_bytes(data[i:i + 4], "big")
        out.append(decode_batch(data[i + 4:i + 4 + n])[1])
        i += 4 + n
    return out


def test_the_real_engine_s_published_hashes_are_the_chain_of_its_tokens():
    [[stored], *_] = recorded()
    tokens = json.loads((FIX / "kv-events-prompt.json").read_text())["tokens"]
    assert isinstance(stored, Stored) and stored.block_size == 128 and stored.parent is None
    digests = chain(tokens, stored.block_size, none_hash())
    assert [external(d) for d in digests] == list(stored.hashes)  # 5 full blocks of the 708-token prompt
    cache = EngineCache()
    cache.apply([stored], 0.0)
    assert cache.mode == EXACT and cache.verified == 5 and cache.mismatched == 0
    assert cache.cached_tokens([external(d) for d in digests]) == 640
    assert cache.cached_tokens([external(d) for d in digests[:2]] + [123]) == 256


def test_an_engine_with_another_seed_is_estimated_at_its_first_event_and_says_why():
    [[stored], *_] = recorded()
    cache = EngineCache(seed="42")  # as if the engines ran with PYTHONHASHSEED and the brain did not know it
    cache.apply([stored], 0.0)
    assert cache.mode == ESTIMATED and cache.mismatched == 1 and "PYTHONHASHSEED" in cache.reason
    again = Stored(stored.hashes, None, stored.tokens, stored.block_size)
    cache.apply([again], 1.0)
    assert cache.mode == ESTIMATED, "one mismatch is enough: an engine does not change its hash"


def synth(tokens, bs=4, parent_digest=None, cache_root=None, **kw):
    root = cache_root or none_hash()
    ds = chain(tokens, bs, root, parent_digest)
    return ds, Stored(tuple(external(d) for d in ds), external(parent_digest) if parent_digest else None,
                      tuple(tokens), bs, **kw)


def test_residency_follows_stores_removals_and_clears_and_a_chain_continues_from_its_parent():
    cache = EngineCache()
    a, ev_a = synth(list(range(12)))
    b, ev_b = synth(list(range(100, 108)), parent_digest=a[-1])
    cache.apply([ev_a, ev_b], 0.0)
    assert cache.exact and cache.verified == 5
    whole = [external(d) for d in a + b]
    assert cache.cached_tokens(whole) == 20
    cache.apply([Removed((external(a[1]),))], 1.0)
    assert cache.cached_tokens(whole) == 4, "a prefix stops at the first block the engine lost"
    cache.apply([Cleared()], 2.0)
    assert cache.cached_tokens(whole) == 0 and cache.exact


def test_what_makes_no_hit_is_not_resident_and_an_unknown_parent_is_not_a_mismatch():
    cache = EngineCache()
    a, ev = synth(list(range(8)), medium="CPU")
    cache.apply([ev], 0.0)
    _, sw = synth(list(range(8)), kind="sliding_window")
    cache.apply([sw], 0.0)
    assert cache.cached_tokens([external(d) for d in a]) == 0 and cache.resident() == {"GPU": 0, "CPU": 2}
    orphan_parent = none_hash("elsewhere")
    o, ev = synth(list(range(8)), parent_digest=orphan_parent)
    cache.apply([ev], 1.0)
    assert cache.unverifiable == 2 and cache.mismatched == 0 and cache.mode == ESTIMATED
    assert "no KV events" in cache.reason


def test_lost_events_forget_residency_until_a_store_verifies_again():
    cache = EngineCache()
    a, ev = synth(list(range(8)))
    cache.apply([ev], 0.0)
    cache.lost("batches 3-5 missed")
    assert cache.mode == ESTIMATED and cache.cached_tokens([external(d) for d in a]) == 0 and "3-5" in cache.reason
    cache.apply([ev], 1.0)
    assert cache.exact


def test_lora_and_cache_salt_keys_are_tagged_again_as_vllm_hashes_them():
    toks = list(range(8))
    keys = [(("lora", "a", "/adapters/a"), ("cache_salt", "s")), (("lora", "a", "/adapters/a"),)]
    ds = chain(toks, 4, none_hash(), extra=keys)
    ev = Stored(tuple(external(d) for d in ds), None, tuple(toks), 4, lora_name="a", extra_keys=(("a", "s"), ("a",)))
    known = EngineCache(lora_paths={"a": "/adapters/a"})
    known.apply([ev], 0.0)
    assert known.exact and known.verified == 2
    unknown = EngineCache()
    unknown.apply([ev], 0.0)
    assert unknown.unverifiable == 2 and unknown.mismatched == 0
    # the brain's own chain for an adapter's request is what the engine published, and it is held there
    from extproc.brain.engine_tokens import block_hashes

    mine = block_hashes(toks, 4, none_hash(), "s", ("lora", "a", "/adapters/a"))
    assert mine == ev.hashes and known.cached_tokens(mine) == 8
    assert known.cached_tokens(block_hashes(toks, 4, none_hash(), "s")) == 0  # the base model's: not these blocks


def test_an_adapter_is_priced_exactly_with_the_path_its_replicas_list():
    from extproc.core.models import ModelCatalog

    cat = ModelCatalog()
    cat.configure({"r0": None, "r1": None})
    base = {"id": "m", "root": "/models/m"}
    cat.learned("r0", [base, {"id": "a", "parent": "m", "root": "/adapters/a"}])
    cat.learned("r1", [base, {"id": "a", "parent": "m", "root": "/adapters/a"}, {"id": "b", "parent": "m",
                                                                                 "root": "/x"}])
    assert cat.adapter_of("a") == ("m", "/adapters/a") and cat.adapter_of("m") is None
    assert cat.adapter_paths("r1") == {"a": "/adapters/a", "b": "/x"}
    cat.learned("r0", [base, {"id": "a", "parent": "m", "root": "/elsewhere/a"}])
    assert cat.adapter_of("a") is None  # two paths, two chains: left to the estimate


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50_000), min_size=0, max_size=90), st.integers(1, 9), st.integers(0, 3))
def test_a_chain_cut_anywhere_and_published_in_pieces_verifies_whole(tokens, bs, cut):
    digests = chain(tokens, bs, none_hash())
    pieces = [digests[:cut], digests[cut:]]
    cache = EngineCache()
    parent = None
    for piece in pieces:
        if not piece:
            continue
        start = digests.index(piece[0])
        cache.apply([Stored(tuple(external(d) for d in piece), external(parent) if parent else None,
                            tuple(tokens[start * bs:(start + len(piece)) * bs]), bs)], 0.0)
        parent = piece[-1]
    assert cache.mismatched == 0 and cache.cached_tokens([external(d) for d in digests]) == len(digests) * bs
    assert cache.exact == bool(digests)


def test_both_wire_forms_decode_and_garbage_is_refused():
    enc = msgspec.msgpack.encode
    maps = enc([1.0, [{"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": [1] * 8,
                       "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None},
                      {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}, {"type": "AllBlocksCleared"}], 0])
    arrays = enc([1.0, [["BlockStored", [1, 2], None, [1] * 8, 4, None, "GPU", None], ["BlockRemoved", [2], "GPU"],
                        ["AllBlocksCleared"]], None])
    for payload in (maps, arrays):
        ts, evs, _ = decode_batch(payload)
        assert [type(e) for e in evs] == [Stored, Removed, Cleared] and evs[0].hashes == (1, 2)
    for bad in (b"\xc1", enc({"x": 1}), enc([1.0, [{"type": "BlockStored", "block_hashes": "no"}]]),
                enc([1.0, [["BlockStored", [1], None, ["t"], 4]]])):
        with pytest.raises(BadBatch):
            decode_batch(bad)


def test_a_replica_s_answer_sends_the_brain_only_to_that_replica():
    assert endpoint_for("tcp://*:5557", "http://10.0.0.7:8000") == "tcp://10.0.0.7:5557"
    assert endpoint_for("tcp://10.0.0.7:5557", "http://10.0.0.7:8000") == "tcp://10.0.0.7:5557"
    assert endpoint_for("tcp://[::]:5557", "http://[fd00::7]:8000") == "tcp://[fd00::7]:5557"
    assert endpoint_for("ipc:///run/vllm/kv.pub", "http://127.0.0.1:8000") == "ipc:///run/vllm/kv.pub"
    for elsewhere in ("tcp://10.1.1.1:5557", "ipc:///run/vllm/kv.pub", "tcp://*:99999", "tcp://*:x", "inproc://a",
                      "tcp://169.254.169.254:80"):
        assert endpoint_for(elsewhere, "http://10.0.0.7:8000") is None, elsewhere


def test_achieved_and_reachable_cached_tokens_are_counted_per_replica():
    """What the chosen replica's engine held of a prompt, beside the most any exact replica held of it."""
    from extproc.brain.brain import Brain
    from extproc.config import parse_config
    from extproc.core.decision import Decision
    from extproc.core.names import Reason
    from extproc.core.profile import RequestProfile

    b = Brain(parse_config({"replicas": [{"name": "r0", "url": "http://127.0.0.1:1"},
                                         {"name": "r1", "url": "http://127.0.0.1:2"}]}))
    tokens = list(range(40))
    digests, ev = synth(tokens)  # 10 blocks of 4
    held = {"r0": 3, "r1": 7}
    for name, n in held.items():
        part = Stored(ev.hashes[:n], None, ev.tokens[:n * 4], 4)
        assert b.router.policy.apply_events(name, 0, [part], 0.0, b.exact._make)
    prompt = (4, ev.hashes)
    assert b.router.policy.cached_on("r0", prompt) == 12
    assert b.router.policy.cached_on("r1", prompt) == 28
    assert b.router.policy.cached_on("r1", (16, ev.hashes)) is None  # another block size: not exact
    b.exact.observe(RequestProfile(engine_hashes=prompt), Decision(b.router.replica("r0"), Reason.LOAD))
    b.exact.observe(RequestProfile(engine_hashes=prompt), Decision(b.router.replica("r1"), Reason.LOAD))
    assert (b.stats.exact_achieved["r0"], b.stats.exact_reachable["r0"]) == (12, 28)
    assert (b.stats.exact_achieved["r1"], b.stats.exact_reachable["r1"]) == (28, 28)
    assert b.exact.replica_view("r0")["cached_tokens"] == {"achieved": 12, "reachable": 28}


def test_an_exact_engine_is_priced_by_what_it_holds_in_its_own_tokens():
    """The warm policy's price: on an exact engine the prompt is the engine's tokens and its cached part the
    engine's own word; the other replica, without events, is priced by the estimate as before."""
    from extproc.core import RouterConfig

    from ..helpers import live_router
    from extproc.core.profile import RequestProfile

    router, t = live_router(2, RouterConfig())
    tokens = list(range(2000))
    digests = chain(tokens, 128, none_hash())  # 15 full blocks
    held = Stored(tuple(external(d) for d in digests[:10]), None, tuple(tokens[:1280]), 128)
    assert router.policy.apply_events("r1", 0, [held], t, EngineCache)
    prof = RequestProfile(tokens=1000, engine_tokens=2000, engine_hashes=(128, tuple(external(d) for d in digests)))
    d = router.select(prof, t)
    assert d.replica.name == "r1" and d.cached_tokens == 1280 and d.prompt_tokens == 2000, d


def test_sessions_over_a_prefix_an_exact_engine_holds_count_it_once_in_the_working_set():
    """Issue 46, on the engine's own word: sessions whose prompts start with the blocks the engine's events say it
    holds (a system prompt) share them; flow control's working set counts them once for all, the engine's block
    hash naming the prefix, while the routing terms keep each session's whole context."""
    from extproc.core import RouterConfig, hash_key

    from ..helpers import live_router
    from extproc.core.profile import RequestProfile

    router, t = live_router(2, RouterConfig())
    system = list(range(1280))  # 10 blocks of 128
    held = chain(system, 128, none_hash())
    for name in ("r0", "r1"):
        assert router.policy.apply_events(name, 0, [Stored(tuple(external(d) for d in held), None,
                                                                  tuple(system), 128)], t, EngineCache)
    pol = router.policy
    for i in range(3):
        tokens = system + [100_000 * (i + 1) + j for j in range(720)]
        hashes = tuple(external(d) for d in chain(tokens, 128, none_hash()))
        prof = RequestProfile(hash_key("session", None, f"s{i}"), None, 1000, "ok", engine_tokens=2000,
                              engine_hashes=(128, hashes))
        d = router.select(prof, t + i)
        assert d.cached_tokens == 1280 and d.prefix == hashes[9], d
        router.release(d.reservation, t + i + 0.5)
    states = [pol.state_of(r) for r in router.replicas]
    sharing = sum(1 for s in states if s.active_tokens)
    # each replica holding sessions counts the 1,280 once beside their own 720 each; the whole count, 2,000 each
    assert sum(s.active_tokens for s in states) == 3 * 720 + sharing * 1280
    assert sum(s.active_whole for s in states) == 3 * 2000


def test_a_prefix_sent_to_an_exact_engine_counts_there_until_its_events_can_have_come():
    """Between a request's decision and the engine's BlockStored for it, a request with the same prefix would see
    nothing held: the blocks sent count as held until the sent request's predicted prefill ends + PROMISE_SLACK_S,
    then only the engine's word counts."""
    from extproc.core import RouterConfig

    from ..helpers import live_router
    from extproc.core.profile import RequestProfile
    from extproc.core.warm import PROMISE_SLACK_S

    router, t = live_router(2, RouterConfig())
    other = tuple(range(9000, 9128))
    for name in ("r0", "r1"):  # both engines exact, neither holding the prompt
        ev = Stored((external(chain(other, 128, none_hash())[0]),), None, other, 128)
        assert router.policy.apply_events(name, 0, [ev], t, EngineCache)
    tokens = list(range(2000))
    hashes = tuple(external(d) for d in chain(tokens, 128, none_hash()))
    prof = RequestProfile(tokens=1000, engine_tokens=2000, engine_hashes=(128, hashes))
    first = router.select(prof, t)
    assert first.cached_tokens == 0
    st = router.policy.state_of(first.replica)
    assert st.exact_cached(hashes, t + 0.1) == len(hashes) * 128  # promised, no event yet
    due = st.promised[hashes[0]]
    assert due == pytest.approx(first.reservation.booking.prefill_end + PROMISE_SLACK_S)
    router.release(first.reservation, t + 0.2)
    assert st.exact_cached(hashes, due + 0.01) == 0  # no event came: the promise is gone


def test_more_resident_blocks_than_any_cache_holds_means_removals_were_missed(monkeypatch):
    import extproc.core.engine_cache as ec

    monkeypatch.setattr(ec, "MAX_BLOCKS", 5)
    cache = EngineCache()
    _, first = synth(list(range(16)))  # 4 blocks: within the bound
    cache.apply([first], 0.0)
    assert cache.exact and len(cache.gpu) == 4
    _, more = synth(list(range(100, 108)))  # 2 more: past it
    cache.apply([more], 1.0)
    assert not cache.exact and cache.gpu == {} and "removals were missed" in cache.reason


def test_a_publisher_s_tiers_are_bounded_in_media_and_blocks_and_an_overflow_forgets_only_that_tier(monkeypatch):
    """One replica's events cannot grow the brain by a dictionary per medium they name, nor a tier past MAX_BLOCKS;
    a tier forgotten for its size leaves the GPU's blocks and the engine's proof as they were."""
    import extproc.core.engine_cache as ec

    monkeypatch.setattr(ec, "MAX_BLOCKS", 5)
    cache = EngineCache()
    _, gpu = synth(list(range(16)))
    cache.apply([gpu], 0.0)
    cache.apply([Stored((1000 + k,), None, (), 0, medium=f"TIER{k}") for k in range(10)], 1.0)
    assert len(cache.tiers) == ec.MAX_MEDIA and cache.ignored == 10 - ec.MAX_MEDIA
    cache.apply([Stored(tuple(range(2000, 2006)), None, (), 0, medium="TIER0")], 2.0)  # 7 blocks on TIER0: past 5
    assert "TIER0" not in cache.tiers and cache.exact and len(cache.gpu) == 4


def test_an_offloading_connector_s_tiers_are_held_per_medium_and_restorable_past_the_gpu_s_hit():
    """vLLM's own offload events (engines/offload_events.py): CPU chunks that overlap announce a block twice and it
    stays until both are evicted; a placeholder chunk is a residency claim; a REMOTE tier's copy is not this
    engine's."""
    meta = json.loads((FIX / "kv-events-offload.json").read_text())
    bs, tokens = meta["block_size"], meta["tokens"]
    hashes = [external(d) for d in chain(tokens, bs, none_hash())]
    gpu, cpu, placeholder, remote, gpu_evicts, cpu_evicts = recorded("kv-events-offload.bin")
    cache = EngineCache()
    cache.apply(gpu, 0.0)
    assert cache.exact and cache.cached_tokens(hashes) == 8 * bs
    cache.apply(cpu, 1.0)
    assert cache.resident() == {"GPU": 8, "CPU": 8} and cache.tiers["CPU"][hashes[5]] == 2
    cache.apply(placeholder, 2.0)
    assert cache.resident()["CPU"] == 9 and cache.exact, "a chunk without tokens is believed, never a mismatch"
    cache.apply(remote, 3.0)
    assert cache.remote == 8 and cache.resident()["CPU"] == 9
    cache.apply(gpu_evicts, 4.0)
    assert cache.cached_tokens(hashes) == 4 * bs and cache.restorable(hashes, 4, "CPU") == 4
    cache.apply(cpu_evicts, 5.0)
    assert cache.restorable(hashes, 4, "CPU") == 2, "block 5 was announced by two chunks: one eviction keeps it"
    assert cache.restorable(hashes, 4, "STORAGE") == 0 and cache.view()["resident_by_medium"] == {"GPU": 4, "CPU": 7}
    cache.apply([Cleared()], 6.0)
    assert cache.resident() == {"GPU": 0}


def _tiered(router, name, hashes, tokens, gpu, cpu, t, locality="LOCAL", medium="CPU"):
    """Replica ``name``'s engine: the prompt's first ``gpu`` blocks of 128 on the GPU, blocks ``gpu``..``cpu`` on an
    offloaded tier (an offloading connector's stores)."""

    evs = [Stored(hashes[:gpu], None, tuple(tokens[:gpu * 128]), 128)]
    if cpu > gpu:
        evs.append(Stored(hashes[gpu:cpu], hashes[gpu - 1] if gpu else None, tuple(tokens[gpu * 128:cpu * 128]), 128,
                          medium=medium, locality=locality))
    assert router.policy.apply_events(name, 0, evs, t, EngineCache)


def test_C3_a_prefix_an_offloaded_tier_holds_is_priced_as_its_restore_never_above_computing_it():
    """Issue 63: past the GPU's hit, the run a local CPU tier holds is restored, not computed: at
    warm.restore_cost_prior of its prefill until the replica's counters time restores, then at what they measured,
    never above computing it. A REMOTE tier's copy and a medium not in warm.offload_tiers count as nothing; a
    tier-blind brain (offload_tiers: []) prices it all as computed."""
    import dataclasses

    from extproc.core import RouterConfig
    from extproc.core.profile import RequestProfile

    from ..helpers import live_router

    tokens = list(range(4000))
    hashes = tuple(external(d) for d in chain(tokens, 128, none_hash()))  # 31 full blocks
    prof = RequestProfile(tokens=2000, engine_tokens=4000, engine_hashes=(128, hashes))

    def priced(cfg=None, locality="LOCAL", medium="CPU", restore_s=None):
        cfg = cfg if cfg is not None else RouterConfig()
        router, t = live_router(2, cfg)
        _tiered(router, "r0", hashes, tokens, 2, 2, t)  # r0: 2 blocks on the GPU, nothing offloaded
        _tiered(router, "r1", hashes, tokens, 2, 30, t, locality, medium)  # r1: 2 on the GPU, 28 more offloaded
        st = router.policy.state_of(router.replica("r1"))
        st.rates.restore_s_per_token = restore_s
        rate = st.rates.prefill_tokens_per_s
        return router.select(prof, t), rate

    d, rate = priced()
    assert d.replica.name == "r1" and d.cached_tokens == 256 and d.restored_tokens == 28 * 128 and \
        d.restored_from == "CPU", d
    r0_prefill = (4000 - 256) / rate
    prior = RouterConfig().warm.restore_cost_prior
    want = (4000 - 256 - 28 * 128) / rate + 28 * 128 * prior / rate
    assert d.predicted_ttft_s == pytest.approx(want, rel=0.05) and d.predicted_ttft_s < 0.7 * r0_prefill
    # measured restores: their time, never more than computing
    fast, _ = priced(restore_s=0.01 / rate)
    assert fast.predicted_ttft_s < d.predicted_ttft_s
    slow, _ = priced(restore_s=5.0 / rate)
    # as dear as computing: r1 is no cheaper than r0 (either may be chosen), whichever tokens it restores
    assert slow.predicted_ttft_s == pytest.approx(r0_prefill, rel=0.05)
    for kw in ({"locality": "REMOTE"}, {"medium": "STORAGE"},
               {"cfg": dataclasses.replace(RouterConfig(), warm=dataclasses.replace(RouterConfig().warm,
                                                                                       offload_tiers=()))}):
        blind, _ = priced(**kw)
        assert blind.restored_tokens == 0 and blind.predicted_ttft_s == pytest.approx(r0_prefill, rel=0.05), kw


def test_restores_are_counted_per_tier_in_state_and_metrics():
    from prometheus_client import generate_latest

    from extproc.core.replica import LIVE

    from ..helpers import scrape_all

    from extproc.brain.brain import Brain
    from extproc.config import parse_config
    from extproc.core.profile import RequestProfile

    b = Brain(parse_config({"replicas": [{"name": "r0", "url": "http://127.0.0.1:1"}]}))
    tokens = list(range(4000))
    hashes = tuple(external(d) for d in chain(tokens, 128, none_hash()))
    now = 0.0
    while b.router.replica("r0").state is not LIVE:  # start-up: two good scrapes and 15 s
        scrape_all(b.router, now)
        now += 3.0
    _tiered(b.router, "r0", hashes, tokens, 2, 30, now)
    prof = RequestProfile(tokens=2000, engine_tokens=4000, engine_hashes=(128, hashes))
    d = b.router.select(prof, now)
    b.exact.observe(prof, d)
    view = b.exact.replica_view("r0")
    assert view["resident_by_medium"] == {"GPU": 2, "CPU": 28} and view["restored_tokens"] == {"CPU": d.restored_tokens}
    assert d.restored_tokens == 28 * 128
    text = generate_latest(b.registry).decode()
    assert 'warmroute_exact_resident_blocks{medium="CPU",replica="r0"} 28.0' in text
    assert "warmroute_restore_seconds_per_token{" not in text  # not measured yet: no sample
    st = b.router.policy.state_of(b.router.replica("r0"))
    st.rates.restore_s_per_token = 2e-5
    assert 'warmroute_restore_seconds_per_token{replica="r0"} 2e-05' in generate_latest(b.registry).decode()
    assert f'warmroute_exact_restored_tokens_total{{medium="CPU",replica="r0"}} {28 * 128}.0' in text


@pytest.mark.parametrize("tier", ["none", "small", "large"])
def test_flow_control_holds_a_turn_that_would_evict_active_contexts_unless_an_offloaded_tier_keeps_them(tier):
    """Issue 63: where every cache is taken by the active sessions' contexts, a new session waits in the router lest
    their next turns compute them again; an engine whose offloaded tier already holds as much as those contexts gives
    them back at a restore's price, so the turn is held only while it does not fit beside what runs. A tier that
    holds less would lose them too: held."""
    import dataclasses

    from extproc.core import Reason, RouterConfig, hash_key
    from extproc.core.flow import FlowControl
    from extproc.core.profile import RequestProfile

    from ..helpers import live_router

    cfg = RouterConfig()
    router, t = live_router(2, dataclasses.replace(cfg, warm=dataclasses.replace(cfg.warm, cache_tokens=30_000)))
    router.flow = FlowControl()

    def turn(name, n):
        tokens = [hash(name) % 1000 * 100_000 + j for j in range(n)]
        hashes = tuple(external(d) for d in chain(tokens, 128, none_hash()))
        return RequestProfile(hash_key("session", None, name), None, n // 2, "ok", engine_tokens=n,
                              engine_hashes=(128, hashes)), tokens, hashes

    for k, r in enumerate(router.replicas):  # an active session of 25K tokens on each, its turn over
        p, tokens, hashes = turn(f"s{k}", 25_000)
        evs = [Stored(hashes[:1], None, tuple(tokens[:128]), 128)]  # the engine: exact
        if tier != "none":  # its offloaded tier: one block of the context, or all of it and an earlier prompt's
            n = 1 if tier == "small" else len(hashes)
            evs.append(Stored(hashes[:n], None, tuple(tokens[:n * 128]), 128, medium="CPU"))
            if tier == "large":
                _, earlier, more = turn(f"earlier{k}", 2048)
                evs.append(Stored(more, None, tuple(earlier), 128, medium="CPU"))
        assert router.policy.apply_events(r.name, 0, evs, t, EngineCache)
        d = router.select(p, t, only=[r.name])
        assert d.replica is r
        router.release(d.reservation, t + 1.0)
    p, _, _ = turn("new", 10_000)
    d = router.select(p, t + 2.0, hold_key="new")
    if tier == "large":
        assert d.replica is not None and d.reason is not Reason.HELD, d
    else:
        assert d.reason is Reason.HELD and d.replica is None


def test_C3_a_context_an_offloaded_tier_would_keep_risks_its_restore_not_its_recompute():
    """Issue 63: where the active sessions and this turn do not fit together, the cost model prices the eviction of
    the cached context at its recompute; on an engine whose tier holds as much as the contexts under way, at its
    restore (warm.restore_cost_prior of it until measured). The other replica's price does not move."""
    import dataclasses

    from extproc.core import RouterConfig, hash_key
    from extproc.core.profile import RequestProfile

    from ..helpers import live_router

    cfg = RouterConfig()
    cfg = dataclasses.replace(cfg, warm=dataclasses.replace(cfg.warm, cache_tokens=30_000))

    def turn(name, n):
        tokens = [hash(name) % 1000 * 100_000 + j for j in range(n)]
        hashes = tuple(external(d) for d in chain(tokens, 128, none_hash()))
        return RequestProfile(hash_key("session", None, name), None, n // 2, "ok", engine_tokens=n,
                              engine_hashes=(128, hashes)), tokens, hashes

    def costs(tier: bool) -> dict[str, float]:
        router, t = live_router(2, cfg)
        first, tokens, hashes = turn("s", 21_000)
        for r in router.replicas:
            evs = [Stored(hashes[:1], None, tuple(tokens[:128]), 128)]  # exact; r0 holds the session's 20K below
            if tier and r.name == "r0":  # a tier holding 51K tokens of older prompts: more than the contexts here
                _, old, old_h = turn("old", 400 * 128)
                evs.append(Stored(old_h, None, tuple(old), 128, medium="CPU"))
            assert router.policy.apply_events(r.name, 0, evs, t, EngineCache)
        for name, n in (("o", 15_000), ("s", 20_000)):  # two sessions under way on r0, their turns over
            p, tk, hs = turn(name, n) if name != "s" else (None, tokens[:n], hashes[:n // 128])
            if p is None:
                p = RequestProfile(first.session_key, None, n // 2, "ok", engine_tokens=n, engine_hashes=(128, hs))
            d = router.select(p, t, only=["r0"])
            router.release(d.reservation, t + 0.5)
        assert router.policy.apply_events("r0", 0, [Stored(hashes[1:156], hashes[0], tuple(tokens[128:156 * 128]),
                                                                  128)], t + 1, EngineCache)
        trace = tracing(router.policy)
        router.select(first, t + 2.0)
        return {name: cost for name, cost, *_ in trace}

    blind, tiered = costs(False), costs(True)
    assert tiered["r1"] == pytest.approx(blind["r1"])
    assert tiered["r0"] < blind["r0"] - 0.3 * 156 * 128 / RouterConfig().warm.prefill_tokens_per_s, (blind, tiered)
