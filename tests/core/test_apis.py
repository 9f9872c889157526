"""The agents' APIs: Anthropic Messages and stateful Responses read as the engine reads them, and stored responses
sent to the replica that holds them (core/apis.py, the brain's use of it)."""

from __future__ import annotations

import json

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.config import parse_config
from extproc.contract import METADATA_NAMESPACE
from extproc.core.apis import (Api, Holder, ResponseHomes, api_of, conversation_root, holder_of, mint_response_id,
                               parse_minted, replica_tag, stored_response_id, with_request_id)
from extproc.core.blocks import ChainCache
from extproc.core.config import ProfileConfig
from extproc.core.profile import build_profile, engine_model

from ..helpers import envoy_decide, live_brain

CFG = ProfileConfig()
SYSTEM = "You are a careful coding agent. Follow the repository's conventions. " * 40
TOOLS = [{"name": "read_file", "description": "read a file " * 20, "input_schema": {"type": "object"}}]


def _messages(session: str, turns: int, marked: bool = True) -> dict:
    """A Claude Code-like body: content blocks, the newest user message marked with cache_control, keys as the
    Anthropic SDK writes them (alphabetical: messages before system and tools)."""
    msgs = []
    for i in range(turns):
        block = {"type": "text", "text": f"question {i} of {session}: " + "context " * 60}
        if marked and i == turns - 1:
            block["cache_control"] = {"type": "ephemeral"}
        msgs.append({"role": "user", "content": [block]})
        if i < turns - 1:
            msgs.append({"role": "assistant", "content": [{"type": "text", "text": f"answer {i} " * 50}]})
    return {"max_tokens": 64, "messages": msgs, "metadata": {"user_id": f"user_1_session_{session}"},
            "model": "m", "system": SYSTEM, "tools": TOOLS}


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _profile(path: str, doc: dict | None, headers: dict | None = None, chains: ChainCache | None = None):
    body = orjson.dumps(doc) if doc is not None else None
    return build_profile({":path": path, **(headers or {})}, body, CFG, chains if chains is not None else ChainCache())


def test_paths_name_their_api():
    assert api_of("/v1/messages") is Api.MESSAGES and api_of("/v1/messages/count_tokens") is Api.MESSAGES
    assert api_of("/v1/responses") is Api.RESPONSES
    assert api_of("/v1/responses/resp_1") is Api.STORED_RESPONSE
    assert api_of("/v1/responses/resp_1/cancel") is Api.STORED_RESPONSE
    assert api_of("/v1/responses/a/b") is Api.OTHER and api_of("/v1/chat/completions") is Api.CHAT
    assert stored_response_id("/v1/responses/resp_1/cancel") == "resp_1"
    assert stored_response_id("/v1/responses/") is None


def test_two_messages_sessions_share_the_system_prompt_and_tools_as_the_engine_renders_them():
    a = _profile("/v1/messages", _messages("A", 1))
    b = _profile("/v1/messages", _messages("B", 1))
    system_blocks = len(SYSTEM) // 64
    # the SDK writes messages first: hashed as sent, two sessions would share nothing
    assert _common(a.blocks, b.blocks) >= system_blocks
    raw = ChainCache()
    from extproc.core.blocks import chain_seed

    ra = raw.chain(None, orjson.dumps(_messages("A", 1)), 0, chain_seed("m", None))
    rb = raw.chain(None, orjson.dumps(_messages("B", 1)), 0, chain_seed("m", None))
    assert _common(ra, rb) < system_blocks // 4


def test_a_messages_conversation_s_next_turn_extends_its_last_although_cache_control_moved():
    t1 = list(_profile("/v1/messages", _messages("A", 3)).blocks)
    t2 = list(_profile("/v1/messages", _messages("A", 4)).blocks)
    assert len(t2) > len(t1)
    # all of turn 1 but the few blocks its end wrote (closing brackets)
    assert _common(t1, t2) >= len(t1) - 2


def test_the_messages_session_is_metadata_user_id_unless_a_header_names_one():
    p = _profile("/v1/messages", _messages("A", 1))
    assert p.session_source == "body:metadata.user_id" and p.api is Api.MESSAGES
    assert p.session_key == _profile("/v1/messages", _messages("A", 2)).session_key
    assert p.session_key != _profile("/v1/messages", _messages("B", 1)).session_key
    h = _profile("/v1/messages", _messages("A", 1), {"x-session-id": "s"})
    assert h.session_source == "header:x-session-id"


def test_a_responses_follow_up_belongs_to_its_conversation_and_names_the_response_it_follows():
    first = _profile("/v1/responses", {"model": "m", "instructions": SYSTEM, "input": "hello"})
    assert first.stored_ref is None and first.session_source == "body:response"
    r1 = mint_response_id("r1", first.response_root)
    second = _profile("/v1/responses", {"model": "m", "input": "more", "previous_response_id": r1})
    assert second.stored_ref == r1 and second.session_source == "body:previous_response_id"
    assert second.session_key == first.session_key and second.response_root == first.response_root
    r2 = mint_response_id("r2", second.response_root)
    third = _profile("/v1/responses", {"model": "m", "input": "again", "previous_response_id": r2})
    assert third.session_key == second.session_key and third.response_root == conversation_root(r1)
    other = _profile("/v1/responses", {"model": "m", "input": "x", "previous_response_id": mint_response_id("r1",
                                                                                                            None)})
    assert other.session_key != second.session_key
    mine = _profile("/v1/responses", {"model": "m", "input": "x", "request_id": "client-1"})
    assert mine.response_id == "client-1"
    get = build_profile({":path": "/v1/responses/" + r2}, None, CFG)
    assert get.api is Api.STORED_RESPONSE and get.stored_ref == r2 and get.session_key == second.session_key


def test_a_minted_id_names_its_replica_by_a_hash_and_a_client_s_id_is_remembered_within_bounds():
    rid = mint_response_id("replica-a", None)
    assert "replica-a" not in rid and parse_minted(rid)[0] == replica_tag("replica-a")
    homes = ResponseHomes(max_entries=2, max_age_s=10.0)
    assert holder_of(rid, ["replica-b", "replica-a"], homes, 0.0) == "replica-a"
    assert holder_of(rid, ["replica-b"], homes, 0.0) is Holder.GONE
    assert holder_of("resp_client", ["replica-a"], homes, 0.0) is Holder.UNKNOWN
    homes.record("resp_client", "replica-a", 0.0)
    assert holder_of("resp_client", ["replica-a"], homes, 5.0) == "replica-a"
    assert holder_of("resp_client", ["replica-b"], homes, 5.0) is Holder.GONE
    assert holder_of("resp_client", ["replica-a"], homes, 11.0) is Holder.UNKNOWN  # older than max_age_s
    for k in range(3):
        homes.record(f"c{k}", "replica-a", 20.0)
    assert len(homes) == 2 and homes.get("c0", 20.0) is None


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=8).filter(lambda k: k != "request_id"),
                       st.one_of(st.integers(), st.text(max_size=20), st.lists(st.integers(), max_size=3)),
                       max_size=6),
       st.sampled_from(["", " ", "\n  "]))
def test_the_minted_id_is_written_into_any_object_and_nothing_else_changes(doc, lead):
    body = lead.encode() + json.dumps(doc).encode()
    out = with_request_id(body, "resp_x")
    assert json.loads(out) == {"request_id": "resp_x", **doc}
    assert engine_model(out) == engine_model(body)


def _brain():
    reps = [{"name": f"r{i}", "url": f"http://127.0.0.1:{8001 + i}"} for i in range(3)]
    return live_brain(parse_config({"replicas": reps}))


def _cluster(out) -> str:
    return out.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields["cluster"].string_value


def test_the_brain_names_each_new_response_after_its_replica_and_sends_what_follows_it_there():
    brain = _brain()
    created = {}
    for k in range(6):
        out = envoy_decide(brain, {":path": "/v1/responses"}, orjson.dumps({"model": "m", "input": f"conversation {k}"}))
        sent = json.loads(out.request_body.response.body_mutation.body)
        created[sent["request_id"]] = _cluster(out)
        assert sent["input"] == f"conversation {k}"
    for rid, home in created.items():
        for headers, body in (({":path": "/v1/responses"}, orjson.dumps({"model": "m", "input": "next",
                                                                          "previous_response_id": rid})),
                              ({":path": "/v1/responses/" + rid, ":method": "GET"}, None),
                              ({":path": f"/v1/responses/{rid}/cancel", ":method": "POST"}, None)):
            out = envoy_decide(brain, headers, body, "request_body" if body else "request_headers")
            assert _cluster(out) == home
            if body:  # the follow-up's own response lives there too
                assert parse_minted(json.loads(out.request_body.response.body_mutation.body)["request_id"])[0] \
                    == replica_tag(home)
    # a response that will not be stored is sent as the client wrote it
    out = envoy_decide(brain, {":path": "/v1/responses"}, orjson.dumps({"model": "m", "input": "x", "store": False}))
    assert not out.request_body.response.HasField("body_mutation")
    # a client's own id: remembered where it went
    out = envoy_decide(brain, {":path": "/v1/responses"}, orjson.dumps({"model": "m", "input": "x", "request_id": "mine"}))
    assert not out.request_body.response.HasField("body_mutation")
    home = _cluster(out)
    follow = envoy_decide(brain, {":path": "/v1/responses/mine", ":method": "GET"}, None, "request_headers")
    assert _cluster(follow) == home


def test_a_response_whose_replica_left_the_fleet_is_not_found_as_the_engine_says_it():
    brain = _brain()
    gone = mint_response_id("r9", None)
    out = envoy_decide(brain, {":path": "/v1/responses"}, orjson.dumps({"model": "m", "input": "x",
                                                                 "previous_response_id": gone}))
    assert out.immediate_response.status.code == 404
    assert json.loads(out.immediate_response.body) == {"error": {
        "message": f"Response with id '{gone}' not found.", "type": "invalid_request_error",
        "param": "response_id", "code": 404}}
    assert brain.state()["decisions_by_reason"].get("-/stored_response_gone") == 1


def test_the_brain_s_own_errors_on_the_messages_paths_are_in_anthropic_s_shape():
    reps = [{"name": "r0", "url": "http://127.0.0.1:8001", "models": ["coder"]}]
    brain = live_brain(parse_config({"replicas": reps}))
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        out = envoy_decide(brain, {":path": path}, orjson.dumps({"model": "nope", "max_tokens": 8, "messages": []}))
        assert out.immediate_response.status.code == 404
        assert json.loads(out.immediate_response.body) == {"type": "error", "error": {
            "type": "NotFoundError", "message": "The model `nope` does not exist. Valid aliases: coder."}}
    out = envoy_decide(brain, {":path": "/v1/chat/completions"}, orjson.dumps({"model": "nope", "messages": []}))
    assert json.loads(out.immediate_response.body)["error"]["param"] == "model"


def test_the_seed_policy_sends_what_follows_a_stored_response_to_its_replica_too():
    reps = [{"name": f"r{i}", "url": f"http://127.0.0.1:{8001 + i}"} for i in range(3)]
    brain = live_brain(parse_config({"replicas": reps, "routing": {"policy": "seed"}}))
    for k in range(6):
        out = envoy_decide(brain, {":path": "/v1/responses"}, orjson.dumps({"model": "m", "input": f"c{k}"}))
        rid, home = json.loads(out.request_body.response.body_mutation.body)["request_id"], _cluster(out)
        brain.router.drain(home)
        try:
            follow = envoy_decide(brain, {":path": "/v1/responses"}, orjson.dumps({"model": "m", "input": "next",
                                                                             "previous_response_id": rid}))
            assert _cluster(follow) == home
        finally:
            brain.router.drain(home, False)


def test_a_follow_up_s_chain_continues_the_conversation_the_engine_stored():
    """The body of a follow-up carries only its new input; the engine prepends the stored conversation. The chain
    (what the prefix index and the cached-token prediction read) and the token estimate continue the earlier
    turns', so the replica holding them is priced for the new part only."""
    chains = ChainCache()
    first = _profile("/v1/responses", {"model": "m", "instructions": SYSTEM, "input": "hello " * 200}, chains=chains)
    t1 = list(first.blocks)
    rid = mint_response_id("r1", first.response_root)
    new = "next step " * 60
    second = _profile("/v1/responses", {"model": "m", "instructions": SYSTEM, "input": new,
                                        "previous_response_id": rid}, chains=chains)
    assert second.blocks[:len(t1)] == t1 and len(second.blocks) > len(t1)
    alone = _profile("/v1/responses", {"model": "m", "instructions": SYSTEM, "input": new,
                                       "previous_response_id": mint_response_id("r1", None)}, chains=ChainCache())
    assert second.tokens > alone.tokens + 0.8 * first.tokens
    # with a session header the conversation is found by it
    h = {"x-session-id": "s"}
    a = _profile("/v1/responses", {"model": "m", "input": "hello " * 200}, h, chains=chains)
    b = _profile("/v1/responses", {"model": "m", "input": new, "previous_response_id": rid}, h, chains=chains)
    assert b.blocks[:len(a.blocks)] == list(a.blocks)


def test_as_an_endpoint_picker_the_brain_picks_the_replica_holding_the_response_first():
    brain = _brain()
    out = envoy_decide(brain, {":path": "/v1/responses"}, orjson.dumps({"model": "m", "input": "start"}))
    rid, home = json.loads(out.request_body.response.body_mutation.body)["request_id"], _cluster(out)
    for headers, body in (({":path": "/v1/responses/" + rid, ":method": "GET"}, None),
                          ({":path": "/v1/responses"}, orjson.dumps({"model": "m", "input": "next",
                                                                     "previous_response_id": rid}))):
        p = brain.picks.pick(headers, body, None)
        assert p.endpoints[0] == brain.endpoint_of[home]
    gone = brain.picks.pick({":path": "/v1/responses/" + mint_response_id("r9", None), ":method": "GET"}, None, None)
    assert gone.endpoints == [] and gone.immediate.status == 404


def test_two_users_identical_first_turns_are_two_conversations():
    doc = {"model": "m", "instructions": SYSTEM, "input": "hello"}
    a = _profile("/v1/responses", doc, {"x-request-id": "r-1"})
    b = _profile("/v1/responses", doc, {"x-request-id": "r-2"})
    assert a.response_root != b.response_root and a.session_key != b.session_key


# --- issue 43: stored-response ids cannot be forged ------------------------------------------------------------

def _forged(replica: str) -> str:
    """What anybody could write with the public layout: the prefix, the replica's public tag, random bits."""
    return mint_response_id(replica, None, key=b"not the fleet's key" * 2)


def test_an_id_without_the_fleet_s_mac_reaches_no_replica_its_bytes_name_and_is_not_found():
    brain = _brain()
    for target in ("r0", "r1", "r2"):
        forged = _forged(target)
        assert parse_minted(forged)[0] == replica_tag(target)  # it names the replica, in the public layout
        for headers, body in (({":path": "/v1/responses"}, orjson.dumps({"model": "m", "input": "x",
                                                                         "previous_response_id": forged})),
                              ({":path": "/v1/responses/" + forged, ":method": "GET"}, None)):
            out = envoy_decide(brain, headers, body, "request_body" if body else "request_headers")
            assert out.immediate_response.status.code == 404, target
            assert json.loads(out.immediate_response.body)["error"]["message"] == f"Response with id '{forged}' not found."
    assert brain.stats.forged_response_ids == 6 and sum(r["decisions"] for r in brain.state()["replicas"]) == 0
    # one character of a real id changed is forged too
    out = envoy_decide(brain, {":path": "/v1/responses"}, orjson.dumps({"model": "m", "input": "start"}))
    rid = json.loads(out.request_body.response.body_mutation.body)["request_id"]
    tampered = rid[:-1] + ("0" if rid[-1] != "0" else "1")
    assert holder_of(tampered, ["r0", "r1", "r2"], ResponseHomes(), 0.0, brain.response_key) is Holder.FORGED
    assert holder_of(rid, ["r0", "r1", "r2"], ResponseHomes(), 0.0, brain.response_key) == _cluster(out)


def test_a_drained_replica_gets_its_own_responses_follow_ups_and_an_ejected_one_no_forged_ids():
    brain = _brain()
    out = envoy_decide(brain, {":path": "/v1/responses"}, orjson.dumps({"model": "m", "input": "start"}))
    rid, home = json.loads(out.request_body.response.body_mutation.body)["request_id"], _cluster(out)
    brain.router.drain(home)
    follow = envoy_decide(brain, {":path": "/v1/responses"}, orjson.dumps({"model": "m", "input": "next",
                                                                     "previous_response_id": rid}))
    assert _cluster(follow) == home  # only it holds the conversation
    forged = envoy_decide(brain, {":path": "/v1/responses/" + _forged(home), ":method": "GET"}, None, "request_headers")
    assert forged.immediate_response.status.code == 404
    other = next(n for n in ("r0", "r1", "r2") if n != home)
    brain.router.on_scrape(other, False, brain.clock(), 0, 0, 0.0)  # a failed scrape: EJECTED
    assert brain.router.replica(other).state.value == "EJECTED"
    forged = envoy_decide(brain, {":path": "/v1/responses"}, orjson.dumps({"model": "m", "input": "x",
                                                                     "previous_response_id": _forged(other)}))
    assert forged.immediate_response.status.code == 404


def test_a_client_s_own_request_id_cannot_be_re_homed_by_another_client():
    brain = _brain()

    def create(tenant_headers: dict) -> str:
        out = envoy_decide(brain, {":path": "/v1/responses", **tenant_headers},
                           orjson.dumps({"model": "m", "input": "x" * 3000, "request_id": "shared-id"}))
        return _cluster(out)

    victim_home = create({})
    for _ in range(10):  # the other client sends creates under the same id; whatever replica they land on...
        create({"x-session-id": "attacker"})
    for _ in range(3):  # ...the victim's follow-ups still reach its response
        follow = envoy_decide(brain, {":path": "/v1/responses/shared-id", ":method": "GET"}, None, "request_headers")
        assert _cluster(follow) == victim_home
    homes = ResponseHomes()
    assert homes.record("x", "r0", 0.0) and not homes.record("x", "r1", 1.0) and homes.get("x", 2.0) == "r0"
    # tenants are apart: the same id in another tenant is that tenant's own
    assert homes.record("x", "r2", 1.0, tenant="t2") and homes.get("x", 2.0, tenant="t2") == "r2"
    assert homes.get("x", 2.0) == "r0"
