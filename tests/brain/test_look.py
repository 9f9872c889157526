"""Issue 43, a flood of new sessions: the look at a large body's headers before the brain reads it, and how far behind
the
brain reads (``extproc/brain/intake.py``)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.config.core.v3 import base_pb2

from extproc import answers
from extproc.answers import Placed
from extproc.brain import decide as dc
from extproc.brain.intake import READ_BYTES_PER_S, Intake
from extproc.core.flow import FLOOD_S
from extproc.config import parse_config
from extproc.contract import LOOK_METADATA, RESERVATION_HEADER, TIME_ATTRIBUTE

from ..helpers import envoy_decide, envoy_look, live_brain


class Clock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_the_backlog_is_what_was_let_through_and_not_read_yet_at_the_rate_one_core_reads():
    clock = Clock()
    i = Intake(5.0, clock)
    assert i.behind_s() == 0.0
    for k in range(10):
        i.let_through(f"r{k}", 1 << 20)
    assert i.behind_s() == pytest.approx(10 * (1 << 20) / READ_BYTES_PER_S)
    i.let_through("r0", 1 << 20)  # the same request twice counts once
    assert i.behind_s() == pytest.approx(10 * (1 << 20) / READ_BYTES_PER_S)
    for k in range(10):  # the bodies arrive and are read
        i.opened(("call", k))
        i.read(("call", k), f"r{k}")
        i.closed(("call", k))
    assert i.behind_s() == 0.0 and i.looked_bytes == 0 and not i.unread
    assert i.own_s(1 << 20) == pytest.approx((1 << 20) / READ_BYTES_PER_S)


def test_a_call_opened_and_not_read_is_a_measured_delay_and_a_slow_upload_counts_one_timer_at_most():
    clock = Clock()
    i = Intake(5.0, clock)
    i.opened("a")
    clock.t += 2.0
    assert i.behind_s() == pytest.approx(2.0)  # Envoy sent it 2 s ago and the brain has not read it
    i.closed("a")  # Envoy gave up on it
    assert i.behind_s() == 0.0
    i.let_through("slow", 32 << 20)  # a client uploading slowly: its body is not on its way to the brain yet
    assert i.behind_s() > 0.5
    clock.t += 5.1
    assert i.behind_s() == 0.0 and i.looked_bytes == 0


def test_how_late_a_look_is_read_is_measured_above_the_least_seen_whatever_the_clocks_skew():
    clock, wall = Clock(), Clock(1_796_302_184.5)
    i = Intake(5.0, clock, wall)
    at = "2026-12-03T12:49:44.248107+00:00"  # 1_796_302_184.248107: 0.25 s before the wall clock (the skew)
    assert i.late_s(at) == 0.0
    wall.t += 1.5  # read 1.5 s later than the first
    assert i.late_s("2026-12-03T12:49:44.248107123+00:00") == pytest.approx(1.5, abs=1e-3)  # nanoseconds too
    assert i.late_s(None) == 0.0 and i.late_s("not a time") == 0.0
    clock.t += 200  # a minute on: the least seen is kept one minute more ...
    wall.t += 10
    assert i.late_s(at) == pytest.approx(11.5, abs=1e-3)
    clock.t += 200  # ... then forgotten: a clock that moved is learned as the new skew
    assert i.late_s(at) == 0.0
    # issue 59: Envoy looks once it holds the whole body; the upload's own time (its milliseconds, set by Envoy) is
    # the client's, not the brain's: a look 3 s after the first byte whose upload took 3 s is not late
    wall.t += 3.0
    assert i.late_s(at, "3000") == pytest.approx(0.0, abs=1e-3)
    assert i.late_s(at, None) == pytest.approx(3.0, abs=1e-3)
    assert i.late_s(at, "-5") == i.late_s(at, "²") == pytest.approx(3.0, abs=1e-3)  # not a duration: none


CFG = {"replicas": [{"name": f"r{i}", "url": f"http://127.0.0.1:{8000 + i}"} for i in range(2)]}
BIG = 200_000


def _body(session_text: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": session_text * 2000}]}).encode()


def _headers(session: str, **more) -> dict[str, str]:
    return {":method": "POST", ":path": "/v1/chat/completions", "content-length": str(BIG), "x-session-id": session,
            "x-request-id": f"rid-{session}", **more}


def test_behind_a_burst_a_new_session_is_refused_before_its_upload_and_a_session_under_way_is_not():
    b = live_brain(parse_config(CFG))
    assert envoy_look(b, _headers("new"), 0.0) is None  # not behind: let it come
    first = b.look_bound_s(b.clock())  # none under way: half Envoy's first timer (5 s)
    # behind by less than a quarter of the bound: nothing changes
    assert envoy_look(b, _headers("new"), 0.2 * first) is None and b.router.flow.flooded_until == float("-inf")
    # by more: let through, but a burst: flow control's flood mode starts before any is refused (issue 59)
    assert envoy_look(b, _headers("new"), 0.3 * first) is None and b.router.flow.flooded_until == b.clock() + FLOOD_S
    assert envoy_look(b, _headers("new"), 2.6) is not None  # none under way: half Envoy's first timer (5 s) is the bound
    assert b.router.flow.flooded_until > b.clock()
    envoy_decide(b, _headers("mine"), _body("my context "))  # a session's first turn
    t = b.clock()
    envoy_decide(b, _headers("mine"), _body("my context "))  # its next turn: a session under way, with a predicted TTFT
    assert b._turn_at == t and b._turn_ttft_s > 0
    bound = b.look_bound_s(t)  # a turn of the session under way, at least half Envoy's configured timer
    assert bound == pytest.approx(min(2.5, max(b._turn_ttft_s, 0.5)))
    assert b.state()["flow_control"]["look_bound_s"] == pytest.approx(bound, abs=1e-4)
    behind = bound * 1.5
    out = envoy_look(b, _headers("someone-new"), behind)
    assert out is not None and out.immediate_response.status.code == 429
    headers = {h.header.key: h.header.raw_value.decode() or h.header.value for h
               in out.immediate_response.headers.set_headers}
    assert headers[answers.DROPPED_REASON_HEADER] == "router_behind" and int(headers["retry-after"]) >= 1
    assert json.loads(out.immediate_response.body)["error"]["code"] == "router_behind"
    assert envoy_look(b, _headers("mine"), behind) is None  # its turn is never refused
    assert envoy_look(b, _headers("someone-new", **{"x-warmroute-priority": "critical"}), behind) is None  # nor critical work
    assert envoy_look(b, _headers("someone-new"), bound * 0.9) is None  # behind by less: it comes
    assert b.stats.flow_refused["router_behind"] == 2


def test_without_flow_control_nothing_is_refused_at_the_look():
    b = live_brain(parse_config({**CFG, "flow_control": {"enabled": False}}))
    assert envoy_look(b, _headers("new"), 600.0) is None


class Ctx:
    def __init__(self, msgs, metadata=()):
        self.msgs, self.written, self.metadata = list(msgs), [], tuple(metadata)

    def invocation_metadata(self):
        return self.metadata

    async def read(self):
        return self.msgs.pop(0) if self.msgs else grpc.aio.EOF

    async def write(self, m):
        self.written.append(m)


def _look_request(request_time: str | None = None) -> ep.ProcessingRequest:
    req = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key="x-request-id", raw_value=b"r1"),
        base_pb2.HeaderValue(key="content-length", raw_value=str(BIG).encode())])))
    if request_time is not None:
        req.attributes["envoy.filters.http.ext_proc"].fields[TIME_ATTRIBUTE].string_value = request_time
    return req


def test_the_look_is_answered_at_once_and_the_body_it_let_through_is_counted_until_it_is_read():
    seen = []

    def look(headers, wait_s, backlog_s=None, new_session=False):
        seen.append((headers["x-request-id"], wait_s, backlog_s))
        return None

    decided = Placed("r0", "1.abc")
    intake = Intake(5.0, Clock())
    front = dc.ExternalProcessor(lambda h, b, phase: decided, 2 * 2**20, look=look, intake=intake)
    ctx = Ctx([_look_request("2026-12-03T12:49:44.248107+00:00")], [LOOK_METADATA])
    asyncio.run(front.Process(None, ctx))
    assert [m.WhichOneof("response") for m in ctx.written] == ["request_headers"]  # let through, no decision
    # its own read time; nothing ahead of it: no backlog (its own size never makes a burst: flood mode)
    assert seen == [("r1", pytest.approx(BIG / READ_BYTES_PER_S), 0.0)]
    assert intake.looked_bytes == BIG and front.open_calls == 0  # a look is no call the brain decides
    body = ep.ProcessingRequest(request_body=ep.HttpBody(body=b"{}" * 10, end_of_stream=True))
    body.attributes["envoy.filters.http.ext_proc"].fields["request.headers['x-request-id']"].string_value = "r1"
    ctx = Ctx([body])
    asyncio.run(front.Process(None, ctx))
    assert ctx.written == [dc.envoy_answer(decided, "request_body")] and intake.looked_bytes == 0 \
        and not intake.unread

    refuse = answers.too_many("router_behind", 3)
    front.look = lambda headers, wait_s, backlog_s=None, new_session=False: refuse
    ctx = Ctx([_look_request()], [LOOK_METADATA])
    asyncio.run(front.Process(None, ctx))
    assert ctx.written == [dc.envoy_answer(refuse, "request_headers")] and intake.looked_bytes == 0  # no body comes


def test_the_bound_is_the_quickest_turn_lately_so_a_burst_s_own_queues_do_not_loosen_it():
    # a floor below any turn here; flow control off so that the burst is placed, not held (the bound is kept either way)
    b = live_brain(parse_config({**CFG, "envoy": {"ext_proc_timeout_s": 0.002}, "flow_control": {"enabled": False}}))
    envoy_decide(b, _headers("mine"), _body("my context "))
    envoy_decide(b, _headers("mine"), _body("my context "))
    quick = b._turn_ttft_s
    assert quick > 0
    for k in range(6):  # new sessions' prefills queue on both replicas (nothing is released)
        envoy_decide(b, _headers(f"burst-{k}"), _body(f"burst {k} ") * 10)
    envoy_decide(b, _headers("mine"), _body("my context "))  # its next turn is predicted behind them
    assert b.recent_decisions(last=1)[0]["predicted_ttft_s"] > 2 * quick
    assert b._turn_ttft_s == pytest.approx(quick)  # what look_bound_s reads


def test_with_flow_control_envoy_waits_at_least_five_seconds_for_the_brain_s_first_answer():
    from extproc.envoy_config import bootstrap

    def timeouts(doc: dict) -> dict[str, str]:
        hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        out = {}
        for f in hcm["http_filters"]:
            tc = f["typed_config"]
            tc = tc.get("extension_config", {}).get("typed_config", tc)
            if "message_timeout" in tc:
                out[f["name"]] = tc["message_timeout"]
        return out

    assert set(timeouts(bootstrap(parse_config(CFG))).values()) == {"5.000s"}
    assert set(timeouts(bootstrap(parse_config({**CFG, "flow_control": {"enabled": False}}))).values()) == {"1.000s"}


def test_a_held_request_is_offered_again_on_an_access_log_entry_only_when_that_entry_freed_something():
    """A flood's refusals end in access-log entries that release nothing: woken by each, the flow loop priced up to 32
    held requests every 10 ms, a third of the brain's time while the turns under way waited behind it."""
    from extproc.brain.server import FlowWaits

    from .test_service import entry, headers_of

    b = live_brain(parse_config(CFG))
    waits = FlowWaits(b)
    placed = headers_of(envoy_decide(b, _headers("s1", **{"x-request-id": "q1"}), _body("s1")))
    b.held["somebody-held"] = object()  # a request waiting in flow control: what the loop is woken for
    b.router.offer(b.clock())  # the loop's offer: nothing changed since it
    assert not b.router.offer_due
    waits.on_log_entry(entry("refused-at-the-look", code=429, details="ext_proc_local_reply"))
    assert not waits.woken.is_set()
    waits.on_log_entry(entry("q1", placed[RESERVATION_HEADER]))  # its reservation released: room freed
    assert b.router.offer_due and waits.woken.is_set()
    del b.held["somebody-held"]


def test_a_request_s_own_size_refuses_it_alone_and_only_other_bodies_waiting_start_flood_mode():
    """Issue 59, finding 1's rule kept by the burst trigger: a request's own size (at a header call only declared)
    may refuse that request, but flood mode (which changes where everybody's new sessions go) starts only on other
    bodies the brain measures waiting: one big body is no burst."""
    b = live_brain(parse_config(CFG))
    bound = b.look_bound_s(b.clock())
    assert b.look(_headers("new"), 60.0, backlog_s=0.0) is not None  # a 2 GB declaration: refused
    assert b.router.flow.flooded_until == float("-inf")
    assert b.look(_headers("new"), 0.9 * bound, backlog_s=0.0) is None  # its own body alone: no burst
    assert b.router.flow.flooded_until == float("-inf")
    # others' bodies wait past a quarter of the bound: a burst, this one let through
    assert b.look(_headers("new"), 0.9 * bound, backlog_s=0.3 * bound) is None
    assert b.router.flow.flooded_until == b.clock() + FLOOD_S


def test_a_header_call_passes_its_own_declared_size_to_the_look_as_no_backlog():
    """The header path's look (before the upload): the request's declared size may refuse it, but only bodies the
    brain measures waiting are a backlog (flood mode's burst: a declaration must not start it for everybody)."""
    from extproc.contract import HEADER_PATH_METADATA

    seen = []

    def look(headers, wait_s, backlog_s=None, new_session=False):
        seen.append((wait_s, backlog_s))
        return None

    intake = Intake(5.0, Clock())
    front = dc.ExternalProcessor(lambda h, b, phase: None, 2 * 2**20, look=look, intake=intake,
                                 at_headers=lambda headers, asked: None)
    asyncio.run(front.Process(None, Ctx([_look_request()], [HEADER_PATH_METADATA])))
    assert seen == [(pytest.approx(BIG / READ_BYTES_PER_S), 0.0)]


def test_header_calls_announce_their_bodies_at_a_call_s_cost_so_a_burst_is_refused_before_its_bodies_come():
    """Issue 59, finding 6: 2,000 new sessions at once each made a header call the brain answered "go on" before any
    of their bodies came; each body was then read (or looked at) to be refused, while the turns under way waited
    behind those calls. Every body a header call lets on is now announced at a call's cost: once the announced calls
    pass the look's bound, the rest of the burst is refused at its header call, small bodies too."""
    from extproc.brain.intake import CALL_BYTES

    b = live_brain(parse_config(CFG))
    intake = Intake(5.0, b.clock)
    front = dc.ExternalProcessor(b.decide, 2 * 2**20, look=b.look, intake=intake, at_headers=b.at_headers)

    def small(k):
        return {**_headers(f"burst-{k}"), "content-length": "8000", "x-request-id": f"r{k}"}

    assert CALL_BYTES == 32 * 1024  # docs/routing.md's number: ~1 ms of a call at the intake's 32 MiB/s
    outs = [front.at_header_call(small(k)) for k in range(4000)]  # 2,560 fit in this idle brain's bound (2.5 s)
    refused = [o for o in outs if o is not None]
    assert refused and all(o.status == 429 and o.doc["error"]["code"] == "router_behind" for o in refused)
    let_on = outs.index(refused[0])
    # as many as the brain reads within the look's bound, at a call's cost each (never their declared 8,000 bytes)
    assert let_on == pytest.approx(b.look_bound_s(b.clock()) * READ_BYTES_PER_S / CALL_BYTES, abs=2)
    assert b.router.flow.flooded_until > b.clock()  # the burst started flood mode
    for k in range(let_on):  # their bodies come and are read: the backlog is gone
        intake.opened(("call", k))
        intake.read(("call", k), f"r{k}")
        intake.closed(("call", k))
    assert front.at_header_call(small(9999)) is None
    # a larger body announced at its header call counts its bytes once the look sees it, not twice
    intake.let_through("big", CALL_BYTES)
    intake.let_through("big", BIG)
    assert intake.looked_bytes == BIG + CALL_BYTES  # 9999's call and the big body


def test_declarations_that_never_come_cost_a_call_each_for_a_timer_s_length():
    """Issue 59, finding 1 again: 8 held-open declarations of 2 MiB refused 60% of new sessions when the look counted
    their size. Announced at their header call they count a call each, and only for the timer's length."""
    from extproc.brain.intake import CALL_BYTES

    clock = Clock()
    i = Intake(5.0, clock)
    for k in range(8):
        i.let_through(f"declared-{k}", CALL_BYTES)
    assert i.behind_s() == pytest.approx(8 * CALL_BYTES / READ_BYTES_PER_S) and i.behind_s() < 0.01
    clock.t += 5.1
    assert i.behind_s() == 0.0


def test_an_announced_body_that_will_never_be_read_stops_counting_at_once():
    """A body announced at its header call and then refused at its look, or decided on its headers (the big-body
    route: Envoy never sends it), is not left counting as the backlog for a timer's length."""
    from extproc.brain.intake import CALL_BYTES

    refusal = answers.too_many("router_behind", 5)
    intake = Intake(5.0, Clock())
    front = dc.ExternalProcessor(lambda h, b, phase: None, 2 * 2**20, look=lambda *a, **k: refusal, intake=intake)
    intake.let_through("r1", CALL_BYTES)  # what the header call announced
    asyncio.run(front.Process(None, Ctx([_look_request()], [LOOK_METADATA])))
    assert intake.looked_bytes == 0 and not intake.looked

    big = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key="x-request-id", raw_value=b"r2"),
        base_pb2.HeaderValue(key="content-length", raw_value=str(32 << 20).encode())])))
    decided = dc.ExternalProcessor(lambda h, b, phase: Placed("r0", "1.x"), 2 * 2**20, intake=intake)
    intake.let_through("r2", CALL_BYTES)
    asyncio.run(decided.Process(None, Ctx([big])))
    assert intake.looked_bytes == 0 and not intake.looked


def test_in_a_burst_at_their_header_calls_new_sessions_are_refused_in_their_api_s_shape_and_a_turn_under_way_is_not():
    """The header call reads its headers once for the decision and both refusals after it (``header_path.Asked``):
    the look, told the session is new, refuses it without reading its profile again; a session under way is never
    refused, whatever its turn's size; the look's 429 speaks the path's API (Anthropic's on Messages: it spoke
    OpenAI's there), and each wait is rendered as its own Retry-After."""
    b = live_brain(parse_config(CFG))
    intake = Intake(5.0, b.clock)
    front = dc.ExternalProcessor(b.decide, 2 * 2**20, look=b.look, intake=intake, at_headers=b.at_headers)
    envoy_decide(b, _headers("mine"), _body("my context "))  # a session under way
    intake.let_through("burst", 200 * READ_BYTES_PER_S)  # 200 s of reading announced: far behind
    chat = front.at_header_call({**_headers("new-chat"), "content-length": "8000"})
    messages = front.at_header_call({**_headers("new-messages"), ":path": "/v1/messages", "content-length": "8000"})
    assert chat is not None and chat.status == 429 and chat.doc["error"]["code"] == "router_behind"
    assert messages is not None and messages.status == 429
    assert messages.doc["type"] == "error" and messages.doc["error"]["type"] == "rate_limit_error"  # Anthropic's
    assert front.at_header_call({**_headers("mine"), "content-length": "8000"}) is None  # read by its body: not refused
    assert b.stats.header_path_declined["new_session"] == 2
    later = front.at_header_call({**_headers("new-later"), "content-length": "8000"})
    intake.let_through("more", 100 * READ_BYTES_PER_S)
    longer = front.at_header_call({**_headers("new-longer"), "content-length": "8000"})
    assert int(dict(later.headers)["retry-after"]) < int(dict(longer.headers)["retry-after"])
    from extproc.brain.header_door import respond

    assert respond(later) != respond(longer) and respond(later) == respond(later)
    assert b"retry-after: %d\r\n" % int(dict(longer.headers)["retry-after"]) in respond(longer)
