"""The request profile: keys from headers and body, token estimate, and bad bodies that never raise."""

from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core import ProfileConfig, build_profile, hash_key
from extproc.core.profile import (
    BODY_ABSENT,
    BODY_EMPTY,
    BODY_NOT_JSON,
    BODY_NOT_OBJECT,
    BODY_OK,
    BODY_TOO_LARGE,
)

CFG = ProfileConfig()
SYS = "You are a careful coding agent. " * 10


def body(**doc) -> bytes:
    return orjson.dumps(doc)


def skey(v, tenant=None):
    return hash_key("session", tenant, v)


def pkey(v, tenant=None):
    return hash_key("prefix", tenant, v[:4096])


@pytest.mark.parametrize(
    "headers,doc,session,source",
    [
        ({"x-session-id": "h1"}, {}, "h1", "header:x-session-id"),
        ({"x-kilo-session": "h2"}, {}, "h2", "header:x-kilo-session"),
        ({"x-conversation-id": "h3"}, {}, "h3", "header:x-conversation-id"),
        # the configured header order decides
        ({"x-kilo-session": "b", "x-session-id": "a"}, {}, "a", "header:x-session-id"),
        # a header wins over the body
        ({"x-session-id": "h"}, {"conversation_id": "c"}, "h", "header:x-session-id"),
        ({}, {"conversation_id": "c1"}, "c1", "body:conversation_id"),
        ({}, {"thread_id": "t1"}, "t1", "body:thread_id"),
        ({}, {"metadata": {"thread_id": "m1"}}, "m1", "body:metadata.thread_id"),
        ({}, {"conversation_id": 42}, "42", "body:conversation_id"),
        ({"x-session-id": ""}, {}, None, None),  # an empty header is no key
        ({}, {"conversation_id": ""}, None, None),
        ({}, {"conversation_id": True}, None, None),
        ({}, {"metadata": "nope"}, None, None),
    ],
)
def test_session_key_from_configurable_headers_or_body(headers, doc, session, source):
    p = build_profile(headers, body(**doc), CFG)
    assert p.session_key == (skey(session) if session else None)
    assert p.session_source == source


def test_session_header_list_is_configurable():
    cfg = ProfileConfig(session_headers=("x-agent-run",))
    assert build_profile({"x-agent-run": "r"}, None, cfg).session_key == skey("r")
    assert build_profile({"x-session-id": "r"}, None, cfg).session_key is None


@pytest.mark.parametrize(
    "doc,system",
    [
        ({"messages": [{"role": "system", "content": SYS}, {"role": "user", "content": "u"}]}, SYS),
        ({"messages": [{"role": "developer", "content": SYS}]}, SYS),
        ({"messages": [{"role": "user", "content": "u"}, {"role": "system", "content": SYS}]}, SYS),
        # content as a list of parts
        ({"messages": [{"role": "system", "content": [{"type": "text", "text": SYS[:50]}, {"type": "text",
                                                                                           "text": SYS[50:]}]}]}, SYS),
        ({"prompt": SYS}, SYS),  # /v1/completions
        ({"prompt": [SYS, "other"]}, SYS),
        ({"instructions": SYS, "input": "hi"}, SYS),  # Responses API
        ({"input": [{"role": "developer", "content": [{"type": "input_text", "text": SYS}]}]}, SYS),
        ({"system": SYS, "messages": [{"role": "user", "content": "u"}]}, SYS),  # Anthropic-style
        ({"messages": [{"role": "user", "content": "u"}]}, None),
        ({"prompt": [1, 2, 3]}, None),  # token ids: no text to hash
    ],
)
def test_prefix_key_from_the_system_prompt_of_each_api(doc, system):
    p = build_profile({}, body(**doc), CFG)
    assert p.body_status == BODY_OK
    assert p.prefix_key == (pkey(system) if system else None)


def test_prefix_key_includes_the_tenant_from_the_trusted_header():
    doc = body(messages=[{"role": "system", "content": SYS}])
    a = build_profile({"x-warmroute-tenant": "acme"}, doc, CFG)
    b = build_profile({"x-warmroute-tenant": "globex"}, doc, CFG)
    assert a.prefix_key == pkey(SYS, "acme") != b.prefix_key


def test_token_estimate_is_characters_over_4_of_the_text_the_model_reads():
    doc = {
        "messages": [
            {"role": "system", "content": "s" * 4000},
            {"role": "user", "content": [{"type": "text", "text": "u" * 2000}, {"type": "image_url",
                                                                                "image_url": {"url": "x" * 9999}}]},
            {"role": "assistant", "content": "a" * 2000},
        ]
    }
    assert build_profile({}, body(**doc), CFG).tokens == 2000
    assert build_profile({}, body(prompt="p" * 400_000), CFG).tokens == 100_000


@pytest.mark.parametrize(
    "raw,status",
    [
        (None, BODY_ABSENT),
        (b"", BODY_EMPTY),
        (b"{not json", BODY_NOT_JSON),
        (b"\xff\xfe\x00garbage", BODY_NOT_JSON),
        (b"[1, 2, 3]", BODY_NOT_OBJECT),
        (b'"just a string"', BODY_NOT_OBJECT),
        (b"null", BODY_NOT_OBJECT),
    ],
)
def test_a_malformed_body_yields_a_profile_without_body_keys_plus_the_reason(raw, status):
    p = build_profile({"x-session-id": "kept"}, raw, CFG)
    assert p.body_status == status
    assert p.prefix_key is None
    assert p.session_key == skey("kept")  # header keys survive a bad body


def test_a_gigantic_body_is_routed_by_headers_only():
    cfg = ProfileConfig(max_body_bytes=1024)
    big = body(messages=[{"role": "system", "content": "x" * 5000}], conversation_id="c")
    p = build_profile({}, big, cfg)
    assert (p.body_status, p.session_key, p.prefix_key) == (BODY_TOO_LARGE, None, None)
    assert p.tokens == len(big) // 4  # the estimate still weighs it


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=30),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.sampled_from(["messages", "role", "content", "text", "prompt", "input", "instructions", "system",
                         "metadata", "conversation_id", "thread_id", "tools", "type", "x"]),
        children, max_size=5),
    max_leaves=25,
)


@settings(max_examples=400, deadline=None)
@given(doc=json_values)
def test_any_json_document_gives_a_profile_and_never_raises(doc):
    raw = json.dumps(doc).encode()  # stdlib: it also writes integers beyond 64 bits
    p = build_profile({}, raw, CFG)
    assert p.body_status in (BODY_OK, BODY_NOT_OBJECT)
    assert p.tokens >= 0


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=200))
def test_any_bytes_give_a_profile_and_never_raise(raw):
    p = build_profile({"x-session-id": "s"}, raw, CFG)
    assert p.session_key is not None


def test_no_prompt_text_in_the_profile():
    secret = "TOP-SECRET-PROMPT-TEXT"
    p = build_profile({"x-session-id": secret}, body(messages=[{"role": "system", "content": secret}]), CFG)
    assert secret.encode() not in repr(p).encode() and secret not in repr(p)


def test_a_body_envoy_left_compressed_is_counted_and_routed_by_headers():
    from extproc.core.config import ProfileConfig
    from extproc.core.names import BodyStatus
    from extproc.core.profile import build_profile

    p = build_profile({"x-session-id": "s", "content-encoding": "br"}, b"\x1b\x00 opaque bytes", ProfileConfig())
    assert p.body_status is BodyStatus.ENCODED and p.session_key is not None and p.prefix_key is None
    p = build_profile({"content-encoding": "identity"}, b'{"messages": []}', ProfileConfig())
    assert p.body_status is BodyStatus.OK


def test_a_chat_body_s_first_bytes_give_the_chain_its_whole_body_gives_and_its_declared_size_prices_it():
    """Issue 61 item 4: what the endpoint picker decides on a body's first bytes (``partial_reach`` of them) is
    routed as its whole body would be: the same block chain (it reads no further), with the model the front resolved
    (the body names it last) in its seed."""
    from extproc.core.blocks import ChainCache
    from extproc.core.names import BodyStatus
    from extproc.core.profile import BODY_MODEL_KEY, BODY_PARTIAL_KEY, partial_reach

    whole = orjson.dumps({"messages": [{"role": "system", "content": SYS},
                                       {"role": "user", "content": "line of code\n" * 100_000}], "model": "coder"})
    reach = partial_reach(CFG)
    assert len(whole) > reach + 100_000
    hdrs = {":path": "/v1/chat/completions", "x-session-id": "s", "content-length": str(len(whole))}
    full = build_profile(hdrs, whole, CFG, ChainCache())
    part = build_profile({**hdrs, BODY_PARTIAL_KEY: "1", BODY_MODEL_KEY: "coder"}, whole[:reach], CFG, ChainCache())
    assert part.blocks and list(part.blocks) == list(full.blocks)
    assert part.body_status is BodyStatus.PARTIAL and part.deferred and part.provisional
    assert part.session_key == full.session_key and part.model == "coder"
    assert part.tokens == min(int(len(whole) / CFG.chars_per_token), CFG.max_prompt_tokens)
    # fewer bytes than a call hashes (chain_step_bytes: a long conversation is covered over its first turns) would
    # route it by less than its whole body says
    shorter = build_profile({**hdrs, BODY_PARTIAL_KEY: "1", BODY_MODEL_KEY: "coder"}, whole[:CFG.chain_step_bytes // 2],
                            CFG, ChainCache())
    assert list(shorter.blocks) != list(full.blocks)
    other = build_profile({**hdrs, BODY_PARTIAL_KEY: "1"}, whole[:reach], CFG, ChainCache())
    assert not set(other.blocks) & set(full.blocks)  # the model seeds the chain: without it nothing would match
    # a session's later turns: its chain grows by chain_step_bytes a turn to chain_max_bytes, all within the reach
    whole_chains, part_chains = ChainCache(), ChainCache()
    for _ in range(CFG.chain_max_bytes // CFG.chain_step_bytes + 1):
        full = build_profile(hdrs, whole, CFG, whole_chains)
        part = build_profile({**hdrs, BODY_PARTIAL_KEY: "1", BODY_MODEL_KEY: "coder"}, whole[:reach], CFG, part_chains)
        assert list(part.blocks) == list(full.blocks)
    assert len(full.blocks) == CFG.chain_max_bytes // 64


@pytest.mark.parametrize("path,doc,place", [
    ("/v1/messages", {"model": "m", "max_tokens": 9, "messages": [], "metadata": {"user_id": "user_abc_session_42"}},
     "metadata.user_id"),
    ("/v1/chat/completions", {"model": "m", "messages": [], "conversation_id": "conv-7", "metadata": {"thread_id": "t"}},
     "conversation_id"),
    ("/v1/chat/completions", {"model": "m", "messages": [], "metadata": {"thread_id": "t-9"}}, "metadata.thread_id"),
    ("/v1/responses", {"model": "m", "input": "hi", "session_id": "vllm-session"}, "session_id"),
])
def test_a_body_too_big_for_the_brain_keeps_the_session_its_parse_would_give(path, doc, place):
    """A body past envoy.brain_body_max_bytes reaches the brain as headers, its model and (now) its session fields as
    Envoy read them: Claude Code's metadata.user_id on a 4 MB turn used to route it as a one-shot, off its session."""
    from extproc.core.profile import BODY_MODEL_KEY, BODY_SESSION_PREFIX, envoy_session_places

    parsed = build_profile({":path": path}, orjson.dumps(doc), CFG)
    assert parsed.session_key is not None and parsed.session_source == "body:" + place
    # what Envoy's json_to_metadata reads, by the rules rendered from the same places
    read = {}
    for name, keys, _ in envoy_session_places(CFG.session_body_fields):
        v = doc
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        if isinstance(v, str):
            read[BODY_SESSION_PREFIX + name] = v
    big = build_profile({":path": path, "content-length": str(8 << 20), BODY_MODEL_KEY: "m", **read}, None, CFG)
    assert (big.session_key, big.session_source) == (parsed.session_key, parsed.session_source)
    # a session header still comes first
    assert build_profile({":path": path, "content-length": "9999999", "x-session-id": "h", **read}, None,
                         CFG).session_source == "header:x-session-id"


def test_an_api_s_own_session_field_counts_for_that_api_only():
    from extproc.core.profile import BODY_SESSION_PREFIX

    read = {BODY_SESSION_PREFIX + "metadata.user_id": "u", BODY_SESSION_PREFIX + "session_id": "s",
            "content-length": str(8 << 20)}
    assert build_profile({":path": "/v1/chat/completions", **read}, None, CFG).session_key is None
    assert build_profile({":path": "/v1/messages", **read}, None, CFG).session_source == "body:metadata.user_id"
    assert build_profile({":path": "/v1/responses", **read}, None, CFG).session_source == "body:session_id"

