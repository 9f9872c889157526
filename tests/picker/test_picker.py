"""The endpoint-picker protocol (GIE 004) as a gateway drives it, against a real Brain: each case of the
protocol, the order of the answers, and release without an access log."""

from __future__ import annotations

import asyncio

import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm

from extproc.brain.brain import Brain
from extproc.config import ConfigError, parse_config
from extproc.contract import (
    DESTINATION_HEADER,
    DESTINATION_NAMESPACE,
    DESTINATION_SERVED_KEY,
    PICKER_BODY_CHUNK,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
)
from extproc.core import EJECTED
from extproc.core.names import BodyStatus
from extproc.core.profile import BODY_ABSENT
from extproc.picker import EndpointPicker

from ..helpers import live_brain

N = 4
CFG = parse_config({"replicas": [{"name": f"r{i}", "url": f"http://127.0.0.{i + 1}:8000"} for i in range(N)],
                    "brain": {"protocol": "endpoint-picker", "picker_fallbacks": 2}})
ENDPOINTS = [f"127.0.0.{i + 1}:8000" for i in range(N)]
BODY = orjson.dumps({"model": "mock-coder-30b", "messages": [{"role": "system", "content": "sys " * 200},
                                                {"role": "user", "content": "hi"}]})


class Ctx:
    """A gateway's side of one ext_proc stream: the messages it sends, the answers it gets."""

    def __init__(self, msgs):
        self.msgs = list(msgs)
        self.out: list[ep.ProcessingResponse] = []

    async def read(self):
        return self.msgs.pop(0) if self.msgs else grpc.aio.EOF

    async def write(self, msg):
        self.out.append(msg)


def headers(pairs: dict[str, str], end: bool = False, subset=None, served=None) -> ep.ProcessingRequest:
    req = ep.ProcessingRequest()
    for k, v in pairs.items():
        req.request_headers.headers.headers.add(key=k, raw_value=v.encode())
    req.request_headers.end_of_stream = end
    if subset is not None:
        f = req.metadata_context.filter_metadata[SUBSET_NAMESPACE].fields[SUBSET_KEY]
        if isinstance(subset, str):
            f.string_value = subset
        else:
            f.list_value.values.extend([])
            for s in subset:
                f.list_value.values.add().string_value = s
    return req


def body(data: bytes, end: bool) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=data, end_of_stream=end))


def response(status: int = 200, served: str | None = None, chunks=(b"data: x\n\n",)) -> list[ep.ProcessingRequest]:
    rh = ep.ProcessingRequest()
    rh.response_headers.headers.headers.add(key=":status", raw_value=str(status).encode())
    if served:
        rh.metadata_context.filter_metadata[DESTINATION_NAMESPACE].fields[DESTINATION_SERVED_KEY].string_value = served
    out = [rh]
    for i, c in enumerate(chunks):
        out.append(ep.ProcessingRequest(response_body=ep.HttpBody(body=c, end_of_stream=i == len(chunks) - 1)))
    return out


def request(data: bytes = BODY, hdrs=None, subset=None, pieces: int = 3) -> list[ep.ProcessingRequest]:
    step = max(1, len(data) // pieces + 1)
    parts = [data[i:i + step] for i in range(0, len(data), step)] or [b""]
    return [headers({":method": "POST", ":path": "/v1/chat/completions", **(hdrs or {})}, subset=subset),
            *(body(p, i == len(parts) - 1) for i, p in enumerate(parts))]


def run(brain: Brain, msgs) -> list[ep.ProcessingResponse]:
    ctx = Ctx(msgs)
    front = EndpointPicker(brain.picks.pick, brain.picks.end, brain.cfg.envoy.brain_body_max_bytes, brain.clock)
    asyncio.run(front.Process(None, ctx))
    return ctx.out


def picked(out: list[ep.ProcessingResponse]) -> tuple[str, str]:
    """(header value, metadata value) of the headers answer."""
    first = out[0]
    assert first.WhichOneof("response") == "request_headers"
    hdr = {h.header.key: h.header.raw_value.decode() for h
           in first.request_headers.response.header_mutation.set_headers}
    meta = first.dynamic_metadata.fields[DESTINATION_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value
    assert first.request_headers.response.clear_route_cache
    return hdr[DESTINATION_HEADER], meta


@pytest.fixture
def brain():
    return live_brain(CFG)


def test_header_and_metadata_agree_and_list_the_pick_then_ordered_fallbacks(brain):
    out = run(brain, request())
    value, meta = picked(out)
    assert value == meta
    listed = value.split(",")
    assert len(listed) == 3 and len(set(listed)) == 3 and set(listed) <= set(ENDPOINTS)
    # the body comes back after the headers answer, whole, in order, ending the stream
    echoed = b"".join(o.request_body.response.body_mutation.streamed_response.body for o in out[1:])
    assert echoed == BODY
    assert out[-1].request_body.response.body_mutation.streamed_response.end_of_stream
    # the fallbacks are the least loaded others: load one up and it leaves the fallbacks
    loaded = ENDPOINTS[0] if listed[0] != ENDPOINTS[0] else ENDPOINTS[1]
    brain.router.replica(brain.releaser.by_address[loaded]).wlc_milli += 10**9
    for s in range(5):
        again = picked(run(brain, request(hdrs={"x-session-id": f"other{s}"})))[0].split(",")
        assert loaded not in again[1:], again


def test_a_big_body_goes_back_in_chunks_of_at_most_62000_bytes(brain):
    big = orjson.dumps({"model": "mock-coder-30b", "messages": [{"role": "user", "content": "x" * 200_000}]})
    out = run(brain, request(big, pieces=2))
    chunks = [o.request_body.response.body_mutation.streamed_response.body for o in out[1:]]
    assert max(len(c) for c in chunks) <= PICKER_BODY_CHUNK and len(chunks) >= 4
    assert b"".join(chunks) == big
    hdr = {h.header.key: h.header.raw_value.decode() for h
           in out[0].request_headers.response.header_mutation.set_headers}
    assert hdr["content-length"] == str(len(big))


def test_a_body_past_the_brain_limit_is_decided_on_headers_and_streamed_on():
    cfg = parse_config({**{"replicas": [{"name": f"r{i}", "url": f"http://127.0.0.{i + 1}:8000"} for i in range(N)]},
                        "brain": {"protocol": "endpoint-picker"}, "envoy": {"brain_body_max_bytes": 4096}})
    b = live_brain(cfg)
    big = b"{" + b" " * 20_000 + b"}"
    out = run(b, request(big, pieces=10))
    assert out[0].WhichOneof("response") == "request_headers"
    assert b"".join(o.request_body.response.body_mutation.streamed_response.body for o in out[1:]) == big
    assert {k: v for k, v in b.stats.bodies.items() if v} == {BODY_ABSENT: 1}  # decided on headers: never parsed


def test_the_subset_hint_is_honoured_as_a_list_and_as_a_comma_separated_string(brain):
    allowed = ENDPOINTS[2:]
    for subset in (allowed, ",".join(allowed)):
        for s in range(6):
            value, _ = picked(run(brain, request(hdrs={"x-session-id": f"s{s}"}, subset=subset)))
            assert set(value.split(",")) <= set(allowed), value


def test_no_eligible_endpoint_in_the_subset_is_a_503(brain):
    for subset in ([], ["10.9.9.9:8000"], "10.9.9.9:8000"):
        out = run(brain, request(subset=subset))
        assert len(out) == 1 and out[0].immediate_response.status.code == 503
        assert orjson.loads(out[0].immediate_response.body)["error"]["code"] == "no_eligible_endpoint"
    for r in brain.router.replicas[2:]:
        brain.router.drain(r.name)
    out = run(brain, request(subset=ENDPOINTS[2:]))  # known, but none ready
    assert out[0].immediate_response.status.code == 503


def test_no_healthy_instance_is_an_immediate_503_with_an_openai_error_and_retry_after(brain):
    for r in brain.router.replicas:
        brain.router.drain(r.name)
    out = run(brain, request())
    assert out[0].immediate_response.status.code == 503
    err = orjson.loads(out[0].immediate_response.body)["error"]
    assert err["type"] == "service_unavailable" and err["code"] == "no_healthy_instances"
    hdrs = {h.header.key: h.header.raw_value for h in out[0].immediate_response.headers.set_headers}
    assert hdrs["retry-after"] == b"5"
    assert brain.router.open_reservations == 0


def test_a_body_that_does_not_parse_is_routed_by_headers_never_a_5xx(brain):
    out = run(brain, request(b'{"messages": [', hdrs={"x-session-id": "s"}))
    value, meta = picked(out)
    assert value == meta and value.split(",")[0] in ENDPOINTS


def test_a_request_without_a_body_is_answered_on_its_headers(brain):
    out = run(brain, [headers({":method": "GET", ":path": "/v1/models"}, end=True)])
    assert picked(out)[0].split(",")[0] in ENDPOINTS


def test_completion_a_reservation_is_released_at_the_response_end_or_a_stream_reset(brain):
    """SPEC B Completion, without an access log: the front sees the response end, or the stream's."""
    out = run(brain, [*request(), *response(chunks=(b"a", b"b", b"c"))])
    assert brain.router.open_reservations == 0 and brain.stats.releases_by_response == 1
    # the response passes through unchanged, chunk by chunk
    echoed = [o.response_body.response.body_mutation.streamed_response.body for o in out if o.HasField("response_body")]
    assert echoed == [b"a", b"b", b"c"]
    run(brain, request())  # the gateway's stream ends before any response: the client went away
    assert brain.router.open_reservations == 0 and brain.stats.releases_by_response == 2


class QueueCtx(Ctx):
    """A stream whose messages arrive when the test puts them (EOF only when it says so)."""

    def __init__(self):
        super().__init__([])
        self.q: asyncio.Queue = asyncio.Queue()

    async def read(self):
        return await self.q.get()


def test_a_reservation_is_held_until_the_response_ends(brain):
    async def scenario():
        ctx = QueueCtx()
        front = EndpointPicker(brain.picks.pick, brain.picks.end, 1 << 20, brain.clock)
        task = asyncio.ensure_future(front.Process(None, ctx))
        resp = response(chunks=(b"a", b"b"))
        for m in [*request(), *resp[:2]]:
            ctx.q.put_nowait(m)
        while len([o for o in ctx.out if o.HasField("response_body")]) < 1:
            await asyncio.sleep(0.001)
        held = brain.router.open_reservations
        ctx.q.put_nowait(resp[2])
        await asyncio.wait_for(task, 5)
        return held

    assert asyncio.run(scenario()) == 1
    assert brain.router.open_reservations == 0


def test_a_retry_elsewhere_counts_against_the_chosen_endpoint(brain):
    seen = []
    brain.router.on_upstream = lambda n, ok, now: seen.append((n, ok))

    async def scenario():
        ctx = QueueCtx()
        task = asyncio.ensure_future(EndpointPicker(brain.picks.pick, brain.picks.end, 1 << 20,
                                                    brain.clock).Process(None, ctx))
        for m in request():
            ctx.q.put_nowait(m)
        while not ctx.out:
            await asyncio.sleep(0.001)
        listed = picked(ctx.out)[0].split(",")
        for m in response(served=listed[1]):  # the first refused; the gateway's retry took the second
            ctx.q.put_nowait(m)
        await asyncio.wait_for(task, 5)
        return listed

    listed = asyncio.run(scenario())
    by = brain.releaser.by_address
    assert seen == [(by[listed[0]], False), (by[listed[1]], True)]


def test_upstream_failures_seen_on_user_responses_count_against_the_endpoint_that_served(brain):
    """SPEC B Eject: a 502/503/504 from the replica is an upstream failure; a 4xx is the request's own."""
    seen = []
    brain.router.on_upstream = lambda n, ok, now: seen.append((n, ok))
    out = run(brain, [*request(), *response(status=503)])
    name = brain.releaser.by_address[picked(out)[0].split(",")[0]]
    assert seen == [(name, False)]
    seen.clear()
    run(brain, [*request(), *response(status=400)])  # the request's own fault: the replica is fine
    assert [ok for _, ok in seen] == [True]


def test_a_buffered_gateway_is_answered_on_the_body_message(brain):
    first = headers({":method": "POST", ":path": "/v1/chat/completions"})
    first.protocol_config.request_body_mode = pm.ProcessingMode.BUFFERED
    out = run(brain, [first, body(BODY, True)])
    assert out[0].WhichOneof("response") == "request_headers" and not out[0].request_headers.response.clear_route_cache
    assert out[1].request_body.response.clear_route_cache
    hdr = {h.header.key: h.header.raw_value.decode() for h in out[1].request_body.response.header_mutation.set_headers}
    assert hdr[DESTINATION_HEADER].split(",")[0] in ENDPOINTS


def test_a_config_with_a_host_name_is_refused_in_picker_mode():
    with pytest.raises(ConfigError, match=r"replicas\[0\]\.url: brain.protocol endpoint-picker"):
        parse_config({"replicas": [{"name": "a", "url": "http://vllm-0:8000"}],
                      "brain": {"protocol": "endpoint-picker"}})
    with pytest.raises(ConfigError, match=r"^brain.protocol: expected one of"):
        parse_config({"brain": {"protocol": "epp"}})


def test_an_ejected_endpoint_is_never_listed(brain):
    r = brain.router.replicas[1]
    for _ in range(10):
        brain.router.on_scrape(r.name, False, brain.clock())
    assert r.health.state is EJECTED
    for s in range(8):
        value, _ = picked(run(brain, request(hdrs={"x-session-id": f"e{s}"})))
        assert ENDPOINTS[1] not in value.split(",")


def test_bodies_held_across_streams_are_bounded_together_and_returned_when_streams_end(brain):
    """Streams that never end each held up to the body limit with no overall bound: past buffered_max_bytes a body
    is decided on its headers and streamed on, and what a stream held is no longer counted once it ends."""
    front = EndpointPicker(brain.picks.pick, brain.picks.end, 1 << 20, brain.clock, buffered_max_bytes=100_000)

    async def scenario():
        never_end = [Ctx([*request(BODY)[:1], body(b"x" * 40_000, False)]) for _ in range(2)]
        for c in never_end:
            c.msgs.append(None)  # a stream left open: read() waits on a future that never comes
        waits = []

        async def stalled_read(ctx):
            msg = ctx.msgs.pop(0)
            if msg is None:
                await asyncio.Event().wait()
            return msg

        for c in never_end:
            c.read = (lambda c=c: stalled_read(c))
            waits.append(asyncio.ensure_future(front.Process(None, c)))
        for _ in range(50):
            await asyncio.sleep(0)
        assert front.buffered == 80_000 and all(not c.out for c in never_end)  # held, undecided
        third = Ctx([*request(BODY)[:1], body(b"y" * 40_000, False), body(b"z", True)])
        await front.Process(None, third)
        assert third.out[0].WhichOneof("response") == "request_headers"  # decided early: the bound was reached
        for w in waits:
            w.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        assert front.buffered == 0

    asyncio.run(scenario())


def test_a_subset_hint_is_read_up_to_its_bound_and_a_status_that_is_no_number_is_no_crash(brain):
    from extproc.picker.front import MAX_SUBSET, subset_of

    huge = headers({":method": "POST"}, subset=[f"10.0.{i // 250}.{i % 250}:8000" for i in range(MAX_SUBSET * 3)])
    assert len(subset_of(huge)) == MAX_SUBSET
    out = run(brain, request(BODY) + [_status("²")])  # "²".isdigit() is True, int("²") raises
    assert out and out[0].WhichOneof("response") == "request_headers"
    assert brain.router.open_reservations == 0  # the stream's end released it, whatever the status said


def _status(code: str) -> ep.ProcessingRequest:
    rh = ep.ProcessingRequest()
    rh.response_headers.headers.headers.add(key=":status", raw_value=code.encode())
    rh.response_headers.end_of_stream = True
    return rh


def test_with_flow_control_a_saturated_pick_waits_until_a_response_ends_and_a_gateway_gone_leaves_the_queue():
    from extproc.brain.server import FlowWaits

    cfg = parse_config({"replicas": [{"name": f"r{i}", "url": f"http://127.0.0.{i + 1}:8000"} for i in range(2)],
                        "brain": {"protocol": "endpoint-picker"}, "flow_control": {"enabled": True,
                                                                                   "hold_on_wait": True,
                                                                                   "wait_s": 3600}})
    brain = live_brain(cfg)
    waits = FlowWaits(brain)

    def big(i):
        return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": f"big{i} " + "x" * 2_000_000}]})

    async def until(cond, what: str) -> None:
        deadline = asyncio.get_running_loop().time() + 10
        while not cond():
            assert asyncio.get_running_loop().time() < deadline, what
            await asyncio.sleep(0.001)

    async def scenario():
        front = EndpointPicker(brain.picks.pick, brain.picks.end, 1 << 24, brain.clock, wait=waits.wait,
                               cancel=waits.cancel, hold_s=3605)
        busy = [QueueCtx() for _ in range(2)]
        tasks = [asyncio.ensure_future(front.Process(None, c)) for c in busy]
        for i, c in enumerate(busy):  # a long prefill on each replica
            for m in request(big(i)):
                c.q.put_nowait(m)
        await until(lambda: all(c.out for c in busy), "both long requests picked")
        small, gone = QueueCtx(), QueueCtx()
        held = asyncio.ensure_future(front.Process(None, small))  # noqa: F841 (held: a task nobody holds may be collected)
        left = asyncio.ensure_future(front.Process(None, gone))
        for c, who in ((small, b"small"), (gone, b"gone")):
            for m in request(orjson.dumps({"model": "m", "messages": [{"role": "user", "content": who.decode()}]})):
                c.q.put_nowait(m)
        await until(lambda: len(brain.router.flow) == 2, "two picks held")
        waits.let_go()
        assert small.out == []  # still saturated: no pick yet (full duplex: the gateway has no message timer to move)
        left.cancel()  # the gateway closed that stream: it leaves the queue at once
        await until(lambda: len(brain.router.flow) == 1, "the closed stream out of the queue")
        for m in response(served=picked(busy[0].out)[0].split(",")[0]):  # one long response ends
            busy[0].q.put_nowait(m)
        await asyncio.wait_for(tasks[0], 5)
        waits.let_go()
        await until(lambda: any(o.HasField("request_headers") for o in small.out), "the held pick answered")
        return picked([o for o in small.out if o.HasField("request_headers")])[0], busy

    endpoint, busy = asyncio.run(scenario())
    assert endpoint.split(",")[0] == picked(busy[0].out)[0].split(",")[0]  # where the room was
    assert len(brain.router.flow) == 0 and brain.stats.flow_released["standard"] == 1


def test_a_held_pick_placed_as_the_gateway_leaves_gives_its_reservation_back():
    from extproc.brain.server import FlowWaits

    cfg = parse_config({"replicas": [{"name": "r0", "url": "http://127.0.0.1:8000"}],
                        "brain": {"protocol": "endpoint-picker"}, "flow_control": {"enabled": True,
                                                                                   "hold_on_wait": True,
                                                                                   "wait_s": 3600}})
    brain = live_brain(cfg)
    waits = FlowWaits(brain)
    big = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "big " + "x" * 2_000_000}]})
    small = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "small"}]})

    async def scenario():
        front = EndpointPicker(brain.picks.pick, brain.picks.end, 1 << 24, brain.clock, wait=waits.wait,
                               cancel=waits.cancel, hold_s=3605)
        first = brain.picks.pick({":path": "/v1/chat/completions"}, big, None)
        ctx = QueueCtx()
        task = asyncio.ensure_future(front.Process(None, ctx))
        for m in request(small):
            ctx.q.put_nowait(m)
        deadline = asyncio.get_running_loop().time() + 10
        while len(brain.router.flow) < 1:
            assert asyncio.get_running_loop().time() < deadline, "the pick held"
            await asyncio.sleep(0.001)
        brain.router.release(first.reservation, brain.clock())
        waits.let_go()  # placed: its answer is ready ...
        assert brain.router.open_reservations == 1
        task.cancel()  # ... and the gateway closes the stream before the front takes it
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert brain.router.open_reservations == 0 and len(brain.router.flow) == 0


def test_a_turn_under_way_is_picked_at_its_headers_and_its_body_passes_through_unread():
    """Issue 61 in the full-duplex shape: the pick comes before any body chunk, the body is echoed as it comes, and the
    turn's work is booked only once its body has passed (an upload held open books nothing)."""
    cfg = parse_config({"replicas": [{"name": f"r{i}", "url": f"http://127.0.0.{i + 1}:8000",
                                      "models": ["mock-coder-30b"]}
                                     for i in range(N)], "brain": {"protocol": "endpoint-picker"}})
    b = live_brain(cfg)
    front = EndpointPicker(b.picks.pick, b.picks.end, b.cfg.envoy.brain_body_max_bytes, b.clock,
                           arrived=lambda res: b.router.arrived(res, b.clock()),
                           pick_at_headers=b.picks.pick_at_headers)

    seen: list[float] = []  # the home's booked work when the gateway has sent all it will

    class Open(Ctx):
        async def read(self):
            if not self.msgs:
                seen.append(b.router.policy.state_of(b.router.replica(b.releaser.by_address[first])).work_s)
            return await super().read()

    def turn(data: bytes, upload_ends: bool = True) -> tuple[list[ep.ProcessingResponse], Ctx]:
        msgs = request(data, {"x-session-id": "agent", "content-length": str(len(data))}, pieces=4)
        ctx = Open(msgs if upload_ends else msgs[:3])
        asyncio.run(front.Process(None, ctx))
        return ctx.out, ctx

    first = ENDPOINTS[0]

    out, _ = turn(BODY)  # a new session: its body decides
    first = picked(out)[0].split(",")[0]
    assert b.recent_decisions(last=1)[0]["path"] == "body"
    longer = orjson.dumps({"model": "mock-coder-30b", "messages": [{"role": "system", "content": "sys " * 200},
                                                                  {"role": "user", "content": "hi"},
                                                                  {"role": "assistant", "content": "yes"},
                                                                  {"role": "user", "content": "more " * 50}]})
    out, _ = turn(longer)
    assert picked(out)[0].split(",")[0] == first and b.recent_decisions(last=1)[0]["path"] == "headers"
    hdr = {h.header.key for h in out[0].request_headers.response.header_mutation.set_headers}
    assert "content-length" not in hdr  # the body is the client's, as it comes
    assert b"".join(o.request_body.response.body_mutation.streamed_response.body for o in out[1:]) == longer
    assert seen[-1] > 0  # its body passed: its work was booked on its home
    idle = b.router.policy.state_of(b.router.replica(b.releaser.by_address[first])).work_s
    out, ctx = turn(longer, upload_ends=False)  # the upload never ends: routed, and nothing booked meanwhile
    assert b.recent_decisions(last=1)[0]["path"] == "headers" and seen[-1] == idle


def _early_front(b: Brain) -> EndpointPicker:
    return EndpointPicker(b.picks.pick, b.picks.end, b.cfg.envoy.brain_body_max_bytes, b.clock,
                          arrived=lambda res: b.router.arrived(res, b.clock()), early_reach=b.picks.early_reach)


def _one_model_fleet(**extra) -> Brain:
    return live_brain(parse_config({"replicas": [{"name": f"r{i}", "url": f"http://127.0.0.{i + 1}:8000",
                                                  "models": ["mock-coder-30b"]} for i in range(N)],
                                    "brain": {"protocol": "endpoint-picker"},
                                    "envoy": {"brain_body_max_bytes": 8192}, **extra}))


def _agent_body(system: str, words: int, model: str = "mock-coder-30b") -> bytes:
    # the model last, as the OpenAI SDK writes it: nothing after the first bytes is needed to route it
    return orjson.dumps({"messages": [{"role": "system", "content": system},
                                      {"role": "user", "content": "read this file " + "token " * words}],
                         "model": model})


def test_a_body_past_the_brain_limit_is_decided_on_its_first_bytes_by_its_prefix_and_the_rest_passes_unread():
    """Issue 61 item 4: a full-duplex body its headers alone decided (past brain_body_max_bytes) is decided on the
    first bytes the block chain reads instead: a long context goes where its prefix is cached, the pick comes while
    the upload still runs, the rest is echoed as it came and never parsed, and its work is booked once it passed."""
    b = _one_model_fleet()
    front = _early_front(b)
    systems = [f"project {k}: " + f"rule {k} " * 700 for k in range(N)]  # ~6 KB each: under the brain's limit
    home = {}
    for k, system in enumerate(systems):  # a short first request of each project: read whole, placed by cost
        small = _agent_body(system, 10)
        ctx = Ctx(request(small, {"x-session-id": f"warm{k}", "content-length": str(len(small))}))
        asyncio.run(front.Process(None, ctx))
        home[k] = picked(ctx.out)[0].split(",")[0]
    assert len(set(home.values())) > 1  # the projects are spread: where each long context goes says what decided it
    for k, system in reversed(list(enumerate(systems))):  # not the order a tie among idle replicas would give
        big = _agent_body(system, 20_000)  # ~120 KB: past the limit
        msgs = request(big, {"x-session-id": f"long{k}", "content-length": str(len(big))}, pieces=30)
        ctx = Ctx(msgs[:-5])  # the upload is still running when the pick must come
        asyncio.run(front.Process(None, ctx))
        assert picked(ctx.out)[0].split(",")[0] == home[k], k
        echoed = b"".join(o.request_body.response.body_mutation.streamed_response.body for o in ctx.out[1:])
        assert big.startswith(echoed) and len(echoed) >= 8192
        ctx = Ctx(msgs)
        asyncio.run(front.Process(None, ctx))
        assert b"".join(o.request_body.response.body_mutation.streamed_response.body for o in ctx.out[1:]) == big
        d = b.recent_decisions(last=1)[0]
        assert d["predicted_prompt_tokens"] >= len(big) // 5  # priced by its declared size, not by what was read
    assert b.stats.bodies[BodyStatus.PARTIAL] == 2 * N and b.stats.bodies[BodyStatus.HEADERS_ONLY] == 0


@pytest.mark.parametrize("case", ["two models", "alias", "messages api", "no declared size", "seed policy"])
def test_a_body_its_first_bytes_cannot_route_is_decided_as_before(case):
    """Where what follows the first bytes may move the request (another model, an alias to rewrite, a conversation
    hashed from its parse), or nothing says how big it is, its first bytes do not decide it."""
    extra: dict = {}
    models = ["mock-coder-30b"]
    path = "/v1/chat/completions"
    if case == "two models":
        models = ["mock-coder-30b", "other"]
    if case == "alias":
        extra = {"models": {"aliases": {"coder": "mock-coder-30b"}}}
    if case == "seed policy":
        extra = {"routing": {"policy": "seed"}}
    if case == "messages api":
        path = "/v1/messages"
    b = live_brain(parse_config({"replicas": [{"name": f"r{i}", "url": f"http://127.0.0.{i + 1}:8000",
                                               "models": models} for i in range(N)],
                                 "brain": {"protocol": "endpoint-picker"}, "envoy": {"brain_body_max_bytes": 8192},
                                 **extra}))
    big = _agent_body("sys " * 100, 20_000, "coder" if case == "alias" else "mock-coder-30b")
    hdrs = {"x-session-id": "s", **({} if case == "no declared size" else {"content-length": str(len(big))})}
    msgs = request(big, hdrs, pieces=30)
    msgs[0].request_headers.headers.headers[1].raw_value = path.encode()
    ctx = Ctx(msgs)
    asyncio.run(_early_front(b).Process(None, ctx))
    assert b"".join(o.request_body.response.body_mutation.streamed_response.body for o in ctx.out[1:]) == big
    assert b.stats.bodies[BodyStatus.PARTIAL] == 0


@pytest.mark.parametrize("models", [["mock-coder-30b"], ["mock-coder-30b", "other"]], ids=["first bytes", "headers"])
def test_a_client_s_kv_transfer_params_in_a_body_passed_on_unread_are_refused_before_its_end(models):
    """Issue 59, finding 4, in the picker's pass-through: a body decided before its end (on its first bytes, or on its
    headers) reached a disaggregated fleet's replica unread, a connector on it acting on the client's own
    kv_transfer_params. It is read as it passes: they get a 400 in place of the body's rest, the pick's work is
    given back; the same words quoted in a prompt pass."""
    b = live_brain(parse_config({"replicas": [{"name": f"r{i}", "url": f"http://127.0.0.{i + 1}:8000", "models": models,
                                               "role": "prefill" if i == 0 else "decode"} for i in range(N)],
                                 "brain": {"protocol": "endpoint-picker"}, "envoy": {"brain_body_max_bytes": 8192}}))
    front = EndpointPicker(b.picks.pick, b.picks.end, b.cfg.envoy.brain_body_max_bytes, b.clock,
                           arrived=lambda res: b.router.arrived(res, b.clock()), early_reach=b.picks.early_reach,
                           connectors=b.picks.connectors)
    text = "please review kv_transfer_params handling: " + '{"kv_transfer_params": {"remote_host": "h"}} ' * 2000
    attack = orjson.dumps({"messages": [{"role": "user", "content": text}], "model": "mock-coder-30b",
                           "kv_transfer_params": {"remote_host": "10.9.9.9", "remote_port": 5600}})
    quoted = orjson.dumps({"messages": [{"role": "user", "content": text}], "model": "mock-coder-30b"})
    for data, refused in ((attack, True), (quoted, False)):
        ctx = Ctx(request(data, {"content-length": str(len(data))}, pieces=40))
        asyncio.run(front.Process(None, ctx))
        assert ctx.out[0].WhichOneof("response") == "request_headers"  # decided before its end
        last = ctx.out[-1]
        if refused:
            assert last.immediate_response.status.code == 400
            assert orjson.loads(last.immediate_response.body)["error"]["code"] == "kv_transfer_params_not_allowed"
            passed = b"".join(o.request_body.response.body_mutation.streamed_response.body for o in ctx.out[1:-1])
            assert len(passed) < len(data)  # the replica never had the whole body
        else:
            assert b"".join(o.request_body.response.body_mutation.streamed_response.body
                            for o in ctx.out[1:]) == data
    assert b.router.open_reservations == 0
    assert b.stats.bodies[BodyStatus.PARTIAL if len(models) == 1 else BodyStatus.HEADERS_ONLY] == 2
    # a gateway that sends the body STREAMED (not the protocol's mode): decided on the headers, read as it passes too
    msgs = request(attack, {"content-length": str(len(attack))}, pieces=40)
    msgs[0].protocol_config.request_body_mode = pm.ProcessingMode.STREAMED
    ctx = Ctx(msgs)
    asyncio.run(front.Process(None, ctx))
    assert ctx.out[-1].immediate_response.status.code == 400  # in place of the chunk that completed them
