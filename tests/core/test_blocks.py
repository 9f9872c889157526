"""C2: the chained block hashes, the session chain cache, and the per-replica prefix index."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core import BLOCK_CHARS, ChainCache, PrefixIndex, ProfileConfig, block_hashes, build_profile, chain_seed

text = st.binary(min_size=0, max_size=6 * BLOCK_CHARS)


@settings(max_examples=300, deadline=None)
@given(common=text, a=text, b=text)
def test_two_prompts_share_block_k_exactly_when_they_share_their_first_k_plus_1_blocks(common, a, b):
    x, y = common + a, common + b
    hx, hy = block_hashes(x), block_hashes(y)
    shared = 0
    while shared < min(len(hx), len(hy)) and x[: (shared + 1) * BLOCK_CHARS] == y[: (shared + 1) * BLOCK_CHARS]:
        shared += 1
    assert hx[:shared] == hy[:shared]
    if shared < min(len(hx), len(hy)):
        assert hx[shared] != hy[shared]


def test_the_chain_is_seeded_by_model_and_tenant():
    data = b"x" * (4 * BLOCK_CHARS)
    assert block_hashes(data, chain_seed("m", "t1")) != block_hashes(data, chain_seed("m", "t2"))
    assert block_hashes(data, chain_seed("m1", None)) != block_hashes(data, chain_seed("m2", None))


@settings(max_examples=200, deadline=None)
@given(turns=st.lists(st.binary(min_size=0, max_size=3 * BLOCK_CHARS), min_size=1, max_size=6), start=st.integers(0,
                                                                                                                  10))
def test_a_session_s_cached_chain_equals_a_fresh_one_and_only_new_blocks_are_hashed(turns, start):
    cache = ChainCache()
    seed = chain_seed("m", None)
    body = b"h" * start
    for t in turns:
        body += t
        before = cache.hashed_blocks
        got = cache.chain(b"s", body, start, seed)
        assert got == block_hashes(body[start:], seed)
        assert cache.hashed_blocks - before <= len(t) // BLOCK_CHARS + 1


def test_a_rewritten_history_is_not_reused():
    cache = ChainCache()
    seed = chain_seed(None, None)
    first = b"a" * (10 * BLOCK_CHARS)
    cache.chain(b"s", first, 0, seed)
    rewritten = b"b" + first[1:] + b"c" * BLOCK_CHARS
    assert cache.chain(b"s", rewritten, 0, seed) == block_hashes(rewritten, seed)
    assert cache.reused_blocks == 0


def test_the_chain_cache_is_bounded():
    cache = ChainCache(max_sessions=3, max_blocks=50)
    for i in range(10):
        cache.chain(f"s{i}".encode(), bytes([i]) * (20 * BLOCK_CHARS), 0, 0)
    assert len(cache) <= 3 and cache._blocks <= 50


def test_the_profile_hashes_the_conversation_from_its_first_key_so_parameters_before_it_do_not_matter():
    cfg = ProfileConfig()
    msgs = [{"role": "system", "content": "S" * 500}, {"role": "user", "content": "U" * 500}]
    a = orjson.dumps({"max_tokens": 10, "model": "mock-coder-30b", "messages": msgs})
    b = orjson.dumps({"max_tokens": 99999, "model": "mock-coder-30b", "messages": msgs})
    pa = build_profile({}, a, cfg, ChainCache())
    pb = build_profile({}, b, cfg, ChainCache())
    assert pa.blocks and pa.blocks == pb.blocks
    other_model = orjson.dumps({"max_tokens": 10, "model": "n", "messages": msgs})
    assert build_profile({}, other_model, cfg, ChainCache()).blocks[0] != pa.blocks[0]


def test_without_a_chain_cache_the_profile_computes_no_blocks():
    body = orjson.dumps({"messages": [{"role": "user", "content": "x" * 1000}]})
    assert not build_profile({}, body, ProfileConfig()).blocks


def test_a_body_above_the_parse_limit_is_routed_from_headers_size_and_raw_chain():
    cfg = ProfileConfig(parse_max_bytes=1024)
    body = orjson.dumps({"messages": [{"role": "user", "content": "x" * 4000}], "conversation_id": "c"})
    p = build_profile({"x-session-id": "s"}, body, cfg, ChainCache())
    assert p.body_status == "unparsed" and p.session_key is not None and p.blocks
    assert p.tokens == pytest_approx(len(body) // 4, 8)


def pytest_approx(x, tol):
    class _A:
        def __eq__(self, other):
            return abs(other - x) <= tol
    return _A()


def test_the_index_holds_what_was_routed_and_forgets_the_least_recently_used():
    idx = PrefixIndex(capacity_blocks=100)
    a, b, c = ([hash((n, i)) for i in range(40)] for n in "abc")
    idx.insert(a)
    idx.insert(b)
    assert idx.match(a) == 40 and idx.match(b) == 40
    assert idx.match(a[:10] + [1, 2, 3]) == 10  # a shared prefix, then a new turn
    idx.insert(a)  # a is used again: b is now the oldest
    idx.insert(c)
    assert len(idx) <= 100
    assert idx.match(a) == 40 and idx.match(c) == 40 and idx.match(b) == 0


def test_C2_a_chain_touched_at_its_headers_is_the_most_recently_used_and_its_unseen_growth_fills_the_cache():
    """Turns decided at their headers add no hashes: a touch keeps their session's chain the newest and counts what
    they added, so the LRU estimate lets go of what the engine lets go of (issue 62: two 250K-token sessions on one
    300K-token home were both priced cached turn after turn, each recomputing the other's eviction)."""
    idx = PrefixIndex(capacity_blocks=100)
    a, b, c = ([hash((n, i)) for i in range(40)] for n in "abc")
    idx.insert(a)
    idx.insert(b)
    assert idx.touch(id(a), a[-1], 0)  # a's session turned at its headers: b is now the oldest
    idx.insert(c)
    assert idx.match(a) == 40 and idx.match(c) == 40 and idx.match(b) == 0
    assert idx.touch(id(c), c[-1], 10)  # c grew by 10 blocks unseen: 40 + 50 held, room for 10 more
    idx.insert(d := [hash(("d", i)) for i in range(20)])  # 110 > 100: the oldest (a) goes
    assert idx.match(a) == 0 and idx.match(c) == 40 and idx.match(d) == 20
    assert not idx.touch(id(a), a[-1], 0)  # gone: a touch says so and brings nothing back
    idx.insert(copy := list(c))  # the same blocks again in another request (no session header): they are its now
    idx.insert(x := [hash(("x", i)) for i in range(15)])
    assert idx.touch(id(c), c[-1], 10)  # the session's turn takes its blocks back, the newest: after the copy and x
    idx.insert([hash(("f", i)) for i in range(36)])  # 121: d goes, then the copy (nothing of its own left), then x
    assert idx.match(c) == 40 and idx.match(d) == 0 and idx.match(x) == 0 and id(copy) not in idx._batches
    idx.settle(id(c), c[-1])  # c read whole again: its growth is counted by the blocks a newer chain holds
    idx.insert(e := [hash(("e", i)) for i in range(20)])  # 40 + 36 + 20 fit once the 10 unseen are settled
    assert idx.match(c) == 40 and idx.match(e) == 20


def test_C2_a_turn_at_its_headers_takes_back_its_blocks_past_the_head_that_another_request_stamped(monkeypatch):
    """Past the head a touch re-stamps anyway (512 blocks, here 4), a chain that another request carried since (the same
    conversation without the session header, a retry) is the session's again: it is not evicted with that request's."""
    from extproc.core import prefix_index

    monkeypatch.setattr(prefix_index, "_HEAD_BLOCKS", 4)
    idx = PrefixIndex(capacity_blocks=100)
    c = [hash(("c", i)) for i in range(40)]
    idx.insert(c)
    idx.insert(list(c))  # the copy stamps every block of c
    idx.insert(x := [hash(("x", i)) for i in range(15)])
    assert idx.touch(id(c), c[-1], 0)
    idx.insert([hash(("f", i)) for i in range(46)])  # 101: the copy (nothing of its own left), then x, go
    assert idx.match(c) == 40 and idx.match(x) == 0


def test_C2_a_turn_at_its_headers_keeps_the_system_prompt_its_session_shares_with_others():
    """The head a session shares (a project's system prompt) was stamped by whichever chain carried it last: a touch
    that left it there lost it with that chain, while the engine kept it for the sessions that use it (one-shots then
    priced it uncached, up to 24x their first token)."""
    idx = PrefixIndex(capacity_blocks=100)
    head = [hash(("system", i)) for i in range(10)]
    a = head + [hash(("a", i)) for i in range(20)]
    x = head + [hash(("x", i)) for i in range(20)]
    idx.insert(a)
    idx.insert(x)  # the head is x's now
    assert idx.touch(id(a), a[-1], 0)  # a's turn at its headers reads the head too
    idx.insert([hash(("y", i)) for i in range(61)])  # past the cache: x, the oldest, goes
    assert idx.match(x) == 10 and idx.match(a) == 30


def test_the_index_shrinks_to_a_smaller_exported_cache_and_clears_on_restart():
    idx = PrefixIndex(capacity_blocks=1000)
    for n in range(10):
        idx.insert([hash((n, i)) for i in range(50)])
    idx.resize(120)
    assert len(idx) <= 120
    idx.clear()
    assert len(idx) == 0 and idx.match([hash((9, i)) for i in range(50)]) == 0


def test_a_long_history_edited_or_shifted_anywhere_in_a_sampled_window_is_not_reused():
    from extproc.core.blocks import _CHECK_WINDOW, _CHECK_WINDOWS

    seed = chain_seed("m", None)
    body = bytes(range(256)) * 400  # 1,600 blocks: checked by sampled windows
    for where in (0, len(body) // 2 - (len(body) // 2) % 64, len(body) - 70):
        cache = ChainCache()
        cache.chain(b"s", body, 0, seed)
        edited = bytearray(body + b"more" * 100)
        edited[where] ^= 0xFF
        before = cache.reused_blocks
        got = cache.chain(b"s", bytes(edited), 0, seed)
        assert got == block_hashes(bytes(edited), seed)
        if where < len(body) - 4 * BLOCK_CHARS:
            assert cache.reused_blocks == before
        else:  # within the last blocks, which a next turn may rewrite: what comes before the edit is kept, no more
            assert 0 < cache.reused_blocks - before <= where // BLOCK_CHARS
    assert len(body) // BLOCK_CHARS > (_CHECK_WINDOWS + 2) * _CHECK_WINDOW
    # a shift (a message inserted early) moves every later byte: caught however few windows are read
    cache = ChainCache()
    cache.chain(b"s", body, 0, seed)
    shifted = body[:1000] + b"x" + body[1000:]
    assert cache.chain(b"s", shifted, 0, seed) == block_hashes(shifted, seed)


def test_C2_a_next_turn_that_rewrites_only_the_previous_bodys_json_tail_reuses_its_chain_but_the_last_blocks():
    import orjson

    from extproc.core.blocks import _verify

    seed = chain_seed("m", None)
    size = 20_000
    while len(a := orjson.dumps({"messages": [{"role": "user", "content": "x" * size}], "stream": True})) % 64 != 5:
        size += 1  # the closing '}],"stream":true}' reaches into the last full block, which the next turn rewrites
    b = orjson.dumps({"messages": [{"role": "user", "content": "x" * size}, {"role": "assistant",
                                                                             "content": "y" * 900}],
                      "stream": True})
    cache = ChainCache()
    old = list(cache.chain(b"s", a, 0, seed))
    assert not _verify(old, b, 0, seed), "the whole previous chain no longer matches"
    reused = cache.reused_blocks
    assert cache.chain(b"s", b, 0, seed) == block_hashes(b, seed)
    assert cache.reused_blocks - reused >= len(old) - 4  # all but its tail, instead of hashing from the start


def test_the_chain_cache_counts_exactly_what_it_holds_through_turns_and_follow_ups():
    cache = ChainCache(max_sessions=4, max_blocks=400)
    rng = __import__("random").Random(3)
    texts = {k: b"" for k in range(6)}
    for step in range(200):
        k = rng.randrange(6)
        key = f"s{k}".encode()
        new = bytes([k + 1]) * rng.randrange(0, 5 * BLOCK_CHARS)
        if rng.random() < 0.3:
            cache.follow(key, new, 0)
        else:
            texts[k] += new
            cache.chain(key, texts[k], 0, 0)
        assert cache.blocks == sum(len(c) for _, c in cache._entries.values()), step
        assert len(cache) <= 4 and cache.blocks <= 400


def test_a_follow_up_chain_stops_at_its_bound_like_a_conversation_s():
    cache = ChainCache()
    for _ in range(10):
        chain, before = cache.follow(b"s", b"y" * (10 * BLOCK_CHARS), 0, max_len=25)
    assert len(chain) == 25 and before == 25


def test_C2_a_settle_for_a_chain_whose_id_is_now_another_s_settles_nothing():
    """A pin's mark names its chain by the list's id, which an evicted chain's successor may reuse: settling it by
    that id alone would forget the unseen growth of whichever chain holds the id now."""
    idx = PrefixIndex(capacity_blocks=100)
    idx.insert(c := [hash(("c", i)) for i in range(40)])
    assert idx.touch(id(c), c[-1], 10)  # 50 held: 40 known, 10 grown since, hashes unknown
    idx.settle(id(c), hash("another chain's last block"))
    idx.insert([hash(("e", i)) for i in range(55)])  # 105 with c's growth still counted: c, the oldest, goes
    assert idx.match(c) == 0
