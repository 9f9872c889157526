"""Issue 61, the header path at the brain: which turns the headers decide, what they book, and why the others read
their body (``extproc/brain/header_path.py``; live on Envoy in tests/integration/test_header_path.py)."""

from __future__ import annotations

import json

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2 as al

from extproc.brain.release import entry_of_proto
from extproc.config import parse_config
from extproc.contract import RESERVATION_HEADER, ROUTING_HEADER
from extproc.core.names import BodyStatus

from ..helpers import envoy_at_headers, envoy_decide, live_brain

REPLICAS = [{"name": f"r{i}", "url": f"http://127.0.0.1:{9000 + i}", "models": ["coder"]} for i in range(3)]
CFG = {"replicas": REPLICAS}


def headers(session: str | None, size: int, path: str = "/v1/chat/completions", **more) -> dict[str, str]:
    out = {":method": "POST", ":path": path, "content-length": str(size), "x-request-id": f"rid-{session}-{size}",
           **more}
    if session is not None:
        out["x-session-id"] = session
    return out


def body(turns: int, model: str = "coder") -> bytes:
    msgs = [{"role": "system", "content": "house rules " * 100}]
    msgs += [{"role": "user", "content": f"turn {i} " + "tool output " * 200} for i in range(turns)]
    return json.dumps({"model": model, "messages": msgs, "max_tokens": 8}).encode()


def first_turn(b, session: str = "s1", turns: int = 1) -> str:
    """A new session's first turn, read by its body: where it went."""
    doc = body(turns)
    out = envoy_decide(b, headers(session, len(doc)), doc)
    return out.dynamic_metadata.fields["warmroute"].struct_value.fields["cluster"].string_value


def routed(answer) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h
            in answer.request_headers.response.header_mutation.set_headers}


def test_a_turn_under_way_is_routed_to_its_home_at_its_headers_and_booked_there():
    b = live_brain(parse_config(CFG))
    home = first_turn(b)
    doc = body(2)
    out = envoy_at_headers(b, headers("s1", len(doc)))
    assert out is not None and routed(out)[ROUTING_HEADER] == home
    assert out.request_headers.response.clear_route_cache
    res = b.router.reservation(int(routed(out)[RESERVATION_HEADER].split(".")[0]))
    assert res is not None and res.replica.name == home  # booked as a body-read turn would be
    assert b.stats.bodies[BodyStatus.HEADER_PATH] == 1
    row = b.recent_decisions(last=1)[0]
    assert row["path"] == "headers" and row["reason"] == "affinity" and row["predicted_cached_tokens"] > 0
    pin = b.router.session_pins.get(next(iter(b.router.session_pins._pins)), b.clock())
    assert pin.unindexed  # the index lacks this turn's blocks: the pin says what the home holds


def test_a_header_answer_envoy_gave_up_on_is_released_when_the_same_request_s_body_is_decided():
    """Envoy's timer ran out on a busy brain's header answer: it failed open into the body call. The header route was
    never applied, so its reservation must not outlive the request (the two bookings of one request id made the id
    ambiguous, and the end released neither: one held until its safety timeout on make test's CI)."""
    b = live_brain(parse_config(CFG))
    first_turn(b)
    doc = body(2)
    h = headers("s1", len(doc))
    before = b.router.open_reservations
    assert envoy_at_headers(b, h) is not None and b.router.open_reservations == before + 1
    out = envoy_decide(b, h, doc)  # the same request id: its body's own call
    token = out.dynamic_metadata.fields["warmroute"].struct_value.fields["reservation"].string_value
    assert b.router.open_reservations == before + 1 and b.ledger.superseded_at_headers == 1
    end = al.HTTPAccessLogEntry()
    end.request.request_id = h["x-request-id"]
    end.request.request_headers[RESERVATION_HEADER] = token
    end.response.response_code.value = 200
    b.releaser.on_entry(entry_of_proto(end))
    assert b.router.open_reservations == before


def test_what_the_headers_cannot_decide_is_left_to_the_body_with_nothing_booked():
    b = live_brain(parse_config(CFG))
    first_turn(b)
    doc = body(2)
    open_before = b.router.open_reservations
    cases = {
        "new_session": headers("someone-new", len(doc)),
        "no_session": headers(None, len(doc)),
        "api": headers("s1", len(doc), "/v1/responses"),
        "size": headers("s1", 40 * len(doc)),  # grew by far more than a turn adds
        "encoded": headers("s1", len(doc), **{"content-encoding": "br"}),
    }
    for why, h in cases.items():
        before = b.stats.header_path_declined[why]
        assert envoy_at_headers(b, h) is None, why
        assert b.stats.header_path_declined[why] == before + 1, why
    small = headers("s1", len(body(1)) // 2)  # compacted: less than the last turn
    assert envoy_at_headers(b, small) is None and b.stats.header_path_declined["size"] == 2
    assert b.router.open_reservations == open_before


def test_a_home_the_cost_model_would_leave_reads_the_body_and_nothing_moves():
    b = live_brain(parse_config({**CFG, "flow_control": {"enabled": False}}))
    home = first_turn(b)
    r = b.router.find(home)
    pin_key = next(iter(b.router.session_pins._pins))
    st = b.router.policy.state_of(r)
    st.prefill_busy_until = b.clock() + 600.0  # ten minutes of prefill queued on the home
    doc = body(2)
    assert envoy_at_headers(b, headers("s1", len(doc))) is None
    assert b.stats.header_path_declined["home_declined"] == 1
    assert b.router.session_pins.get(pin_key, b.clock()).replica is r  # the body decides whether it moves


def test_flow_control_never_holds_a_turn_at_its_headers():
    b = live_brain(parse_config(CFG))
    home = first_turn(b)
    b.router.flow.hold_on_wait = True
    for r in b.router.replicas:  # every queue long: the home stays the best, and flow control would hold it
        b.router.policy.state_of(r).prefill_busy_until = b.clock() + 600.0
    doc = body(2)
    assert envoy_at_headers(b, headers("s1", len(doc))) is None and not b.held and not b.router.flow.held
    assert b.stats.header_path_declined["home_declined"] == 1
    assert b.router.session_pins.get(next(iter(b.router.session_pins._pins)), b.clock()).replica.name == home


def test_several_models_decide_at_the_headers_only_by_the_model_header_and_only_for_the_home_s_model():
    replicas = [{**REPLICAS[0]}, {**REPLICAS[1]}, {**REPLICAS[2], "models": ["chat"]}]
    b = live_brain(parse_config({**CFG, "replicas": replicas}))
    home = first_turn(b)
    doc = body(2)
    assert envoy_at_headers(b, headers("s1", len(doc))) is None and b.stats.header_path_declined["model"] == 1
    b = live_brain(parse_config({**CFG, "replicas": replicas, "profile": {"model_header": "x-model"}}))
    home = first_turn(b)
    out = envoy_at_headers(b, headers("s1", len(doc), **{"x-model": "coder"}))
    assert out is not None and routed(out)[ROUTING_HEADER] == home
    # the client changes model mid-session: its home does not serve it
    assert envoy_at_headers(b, headers("s1", len(doc), **{"x-model": "chat"})) is None
    assert b.stats.header_path_declined["model"] == 1


def test_a_fleet_with_prefill_replicas_reads_every_body_and_the_seed_policy_too():
    pd = [{**REPLICAS[0]}, {**REPLICAS[1]}, {**REPLICAS[2], "role": "prefill"}]
    b = live_brain(parse_config({**CFG, "replicas": pd, "disaggregation": {"enabled": True}}))
    first_turn(b)
    assert envoy_at_headers(b, headers("s1", len(body(2)))) is None
    assert b.stats.header_path_declined["disaggregation"] == 1
    b = live_brain(parse_config({**CFG, "routing": {"policy": "seed"}}))
    first_turn(b)
    assert envoy_at_headers(b, headers("s1", len(body(2)))) is None and b.stats.header_path_declined["policy"] == 1


def test_C4_a_body_turn_after_header_turns_counts_what_the_home_holds_by_the_pin():
    """The index lacks the header turns' blocks: without the pin's word the home would look colder than it is."""
    b = live_brain(parse_config(CFG))
    home = first_turn(b)
    for turns in range(2, 6):
        out = envoy_at_headers(b, headers("s1", len(body(turns))))
        assert out is not None
        b.router.release(b.router.reservation(int(routed(out)[RESERVATION_HEADER].split(".")[0])), b.clock())
    doc = body(6)
    envoy_decide(b, headers("s1", len(doc)), doc)
    row = b.recent_decisions(last=1)[0]
    assert row["path"] == "body" and row["replica"] == home
    assert row["predicted_cached_tokens"] >= 0.8 * len(body(5)) / 4 * 0.9  # the pin's, not the first turn's chain
    pin = b.router.session_pins.get(next(iter(b.router.session_pins._pins)), b.clock())
    assert not pin.unindexed


@pytest.mark.parametrize("turned_between", [True, False])
def test_C2_an_estimated_home_whose_cache_let_the_session_go_reads_the_body(turned_between):
    """Estimate mode: the home's index (C2's LRU over what was routed there) says whether the session is still held.
    A turn at its headers keeps its chain the newest there; other sessions' traffic past the cache's size evicts the
    oldest. Before, the pin's word alone priced the home cached whatever came since: in the simulator's overload
    (load 1.5) two long sessions on one home recomputed each other's context every turn, predicted 7-37 s, taking
    100-325 s."""
    b = live_brain(parse_config(CFG))
    home = first_turn(b)
    st = b.router.policy.state_of(b.router.find(home))
    n = len(st.index)
    st.index.resize(4 * n)

    def turn(turns: int):
        out = envoy_at_headers(b, headers("s1", len(body(turns))))
        if out is not None:
            b.router.release(b.router.reservation(int(routed(out)[RESERVATION_HEADER].split(".")[0])), b.clock())
        return out

    st.index.insert([hash(("other", i)) for i in range(n)])  # another session's chain, after this one's
    if turned_between:
        assert turn(2) is not None  # this session's turn: the newest again (its growth counted, unseen)
    st.index.insert([hash(("third", i)) for i in range(2 * n + 1)])  # past the cache: the oldest chain goes
    assert (turn(3) is not None) is turned_between
    if not turned_between:
        assert b.stats.header_path_declined["home_declined"] == 1


@pytest.mark.parametrize("held", [True, False])
def test_an_exact_home_that_evicted_the_session_s_last_block_reads_the_body(held):
    from extproc.core.engine_cache import EXACT, EngineCache

    b = live_brain(parse_config(CFG))
    home = first_turn(b)
    pol = b.router.policy
    st = pol.state_of(b.router.find(home))
    st.exact = EngineCache("vllm-none-hash", "sha256")
    st.exact.block_size, st.exact.mode = 16, EXACT
    pin = pol.session_pins.get(next(iter(pol.session_pins._pins)), b.clock())
    pin.tail = (16, 1234)
    if held:
        st.promised[1234] = b.clock() + 10
    out = envoy_at_headers(b, headers("s1", len(body(2))))
    assert (out is not None) is held


def test_a_turn_s_declared_size_decides_within_a_turn_s_growth_of_its_last_and_not_below_nine_tenths():
    from extproc.core.profile import HEADER_GROWTH_TOKENS, HEADER_SHRINK, size_decides

    assert (HEADER_GROWTH_TOKENS, HEADER_SHRINK) == (32_768, 0.9)  # docs/architecture.md's numbers
    last = 10_000
    assert size_decides(last, last + 32_768) and not size_decides(last, last + 32_769)
    assert size_decides(last, 9_000) and not size_decides(last, 8_999)
    assert not size_decides(0, 100)  # no last turn known: its body decides


def test_C3_a_prompt_beyond_what_a_replica_s_cache_holds_books_no_prefill_and_new_sessions_do_not_wait_behind_it():
    """Envoy holds a 32 MiB body the brain is not sent (the big-body route): by its size, far more tokens than a
    replica's KV cache holds, which the engine refuses before any prefill. Booked as a prefill, eight such bodies held
    every new session behind them until the engines' 400s came back (12-15 of 200 refused, deadline_unmeetable)."""
    b = live_brain(parse_config({**CFG, "replicas": REPLICAS[:2]}))
    for s in ("a", "b"):  # sessions under way on both replicas
        first_turn(b, s)
    for i in range(4):
        out = envoy_decide(b, headers(f"big-{i}", 32 << 20), None, "request_headers")
        token = out.dynamic_metadata.fields["warmroute"].struct_value.fields["reservation"].string_value
        res = b.router.reservation(int(token.split(".")[0]))
        assert res.provisional and res.prefill_s == 0 and res.pending_tokens == 0
    doc = body(1)
    for i in range(10):
        out = envoy_decide(b, headers(f"new-{i}", len(doc)), doc)
        assert out.dynamic_metadata.fields["warmroute"].struct_value.fields["cluster"].string_value in ("r0", "r1")


def test_a_new_session_its_body_would_only_be_refused_behind_the_queue_is_refused_at_its_headers():
    """Issue 59, finding 6: in a flood of small new sessions each body was read (a gRPC call) only to be refused
    ``deadline_unmeetable``, by the queue's wait alone: nothing of the body counts there, so its headers refuse it,
    exactly where its body would have been refused, and nothing is queued."""
    from extproc.answers import Answered, Held

    cfg = parse_config({**CFG, "flow_control": {"enabled": True, "hold_on_wait": True, "wait_s": 3600}})
    b = live_brain(cfg)
    for i in range(3):  # a long prefill on each replica (one-shots: no session, no context kept)
        big = json.dumps({"model": "coder", "messages": [{"role": "user", "content": f"{i} " + "x" * 2_000_000}]})
        assert not isinstance(b.decide({"x-request-id": f"big{i}", ":path": "/v1/chat/completions"}, big.encode()),
                              Held)
    doc = body(1)
    assert isinstance(b.decide(headers("first", len(doc)), doc), Held)  # the queue: one new session ahead
    assert len(b.router.flow) == 1
    hurry = headers("hurry", len(doc), **{"x-warmroute-ttft-slo-ms": "2000"})
    out = b.at_headers(hurry)
    assert isinstance(out, Answered) and out.status == 429 and out.doc["error"]["code"] == "deadline_unmeetable"
    assert b.stats.flow_refused["deadline_unmeetable"] == 1 and len(b.router.flow) == 1  # nothing queued
    # as the header call asks (its headers read once, the decision's profile kept for this refusal): the same
    from extproc.brain.header_path import Asked

    asked = Asked()
    again = b.at_headers(headers("hurry-1", len(doc), **{"x-warmroute-ttft-slo-ms": "2000"}), asked)
    assert asked.read and asked.why == "new_session" and asked.profile is not None
    assert isinstance(again, Answered) and again.doc["error"]["code"] == "deadline_unmeetable"
    # the same request read by its body: the same answer
    by_body = b.decide(headers("hurry-2", len(doc), **{"x-warmroute-ttft-slo-ms": "2000"}), doc)
    assert isinstance(by_body, Answered) and by_body.doc["error"]["code"] == "deadline_unmeetable"
    # what its body may still change, its body decides: critical work (never refused), a deadline the queue meets
    assert b.at_headers(headers("pager", len(doc), **{"x-warmroute-priority": "critical"})) is None
    assert b.at_headers(headers("patient", len(doc), **{"x-warmroute-ttft-slo-ms": "100000000"})) is None
    # nothing queued ahead: nothing refused at the headers
    assert live_brain(cfg).at_headers(hurry) is None
