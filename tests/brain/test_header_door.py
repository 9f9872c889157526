"""The header door (``extproc/brain/header_door.py``): the header path's call as ext_authz's HTTP request. What Envoy
sends it is read as the gRPC header call's headers are, and each of the brain's words maps to the ext_authz answer
that does the same: a route (200 + headers Envoy adds to the request), "read the body" (a bare 200), the brain's own
refusal (its status and JSON to the client), and any fault a 5xx (Envoy lets the request go on). Live through Envoy in
tests/integration/test_header_path.py."""

from __future__ import annotations

import asyncio
import os
import stat
import tempfile

import aiohttp
import pytest

from extproc.answers import Answered, Placed, error
from extproc.contract import (DECLARED_LENGTH_HEADER, DOOR_READY_PATH, DP_RANK_HEADER, HEADER_DOOR_PREFIX,
                              RESERVATION_HEADER, ROUTING_HEADER, header_door_socket)
from extproc.brain.header_door import door_app, serve_door


def call(ask, *requests, ready=lambda: True) -> list[tuple[int, dict, bytes]]:
    """Serve the door on a fresh socket, send ``requests`` ((method, path, headers) each) as Envoy's ext_authz would,
    and return each answer's status, headers and body."""
    async def run():
        d = tempfile.mkdtemp(prefix="door-")
        path = os.path.join(d, "brain.headers.sock")
        runner = await serve_door(door_app(ask, ready), path, None)
        try:
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # only the brain's user (Envoy's group if given)
            out = []
            async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path)) as http:
                for method, p, headers in requests:
                    async with http.request(method, "http://brain" + p, headers=headers) as r:
                        out.append((r.status, {k.lower(): v for k, v in r.headers.items()}, await r.read()))
            return out
        finally:
            await runner.cleanup()
            os.rmdir(d) if not os.listdir(d) else None

    return asyncio.run(run())


def turn(**more) -> tuple[str, str, dict]:
    # what ext_authz sends: the method and the path behind the door's prefix, the allowed headers, its own length (0)
    return ("POST", HEADER_DOOR_PREFIX + "/v1/chat/completions?x=1",
            {"x-session-id": "agent-1", DECLARED_LENGTH_HEADER: "123456", "content-length": "0",
             "x-envoy-internal": "true", **more})


def test_a_header_call_is_read_as_the_grpc_call_s_headers():
    seen = []
    call(lambda h: seen.append(h), turn(authorization="Bearer k"))
    (h,) = seen
    assert h[":method"] == "POST" and h[":path"] == "/v1/chat/completions?x=1"
    assert h["content-length"] == "123456"  # the client's declared size, not the door request's own 0
    assert h["x-session-id"] == "agent-1" and h["authorization"] == "Bearer k"
    assert "x-envoy-internal" not in h and DECLARED_LENGTH_HEADER not in h and "host" not in h


def test_a_route_is_a_200_with_the_headers_envoy_adds_to_the_request():
    (status, headers, _), = call(lambda h: Placed("r2", "7.abc", dp_rank=1), turn())
    assert status == 200
    assert headers[ROUTING_HEADER] == "r2" and headers[RESERVATION_HEADER] == "7.abc" and headers[DP_RANK_HEADER] == "1"


def test_read_the_body_is_a_bare_200():
    (status, headers, body), = call(lambda h: None, turn())
    assert status == 200 and ROUTING_HEADER not in headers and RESERVATION_HEADER not in headers and body == b""


def test_the_brain_s_refusal_reaches_the_client_as_the_brain_wrote_it():
    refusal = error(429, "behind", "rate_limit_exceeded", "router_behind", "warmroute_router_behind",
                    retry_after_s=3)
    (status, headers, body), = call(lambda h: refusal, turn())
    assert status == 429 and headers["retry-after"] == "3" and headers["content-type"].startswith("application/json")
    assert body == refusal.body


@pytest.mark.parametrize("out", [Answered(503, {"error": {}}, "warmroute_no_healthy_instances"),
                                 Answered(200, {}, "odd")])
def test_an_answer_that_ext_authz_would_misread_goes_on_to_the_body(out):
    # a 5xx is ext_authz's error (fail open, the body path answers it); a 200 would pass the request unrouted
    (status, headers, _), = call(lambda h: out, turn())
    assert status == 200 and ROUTING_HEADER not in headers


def test_a_fault_fails_open_and_never_answers_the_client():
    def boom(h):
        raise RuntimeError("a bug")

    (status, _, _), (other, _, _) = call(boom, turn(), ("POST", "/v1/chat/completions", {}))
    assert status >= 500 and other >= 500  # ext_authz: error, so failure_mode_allow lets the request go on


def test_a_long_header_reaches_the_brain_and_is_no_400():
    # Envoy passes request headers up to 60 KiB; aiohttp's parser refuses 8 KiB by default, and a 4xx here would be the
    # client's answer
    seen = []
    (status, _, _), = call(lambda h: seen.append(h["x-session-id"]), turn(**{"x-session-id": "s" * 50_000}))
    assert status == 200 and seen == ["s" * 50_000]


def test_envoy_s_health_check_reads_whether_the_brain_serves():
    ready = [False]
    got = call(lambda h: None, ("GET", DOOR_READY_PATH, {}), ready=lambda: ready[0])
    assert got[0][0] == 503
    ready[0] = True
    assert call(lambda h: None, ("GET", DOOR_READY_PATH, {}), ready=lambda: ready[0])[0][0] == 200


def test_the_door_is_beside_the_grpc_socket_or_nowhere():
    assert header_door_socket("/run/warmroute/brain.sock") == "/run/warmroute/brain.headers.sock"
    assert header_door_socket("/run/w.d/brain") == "/run/w.d/brain.headers"
    assert header_door_socket("/" + "d" * 96 + "/b.sock") is None  # too long for a socket: the header path uses gRPC


def test_what_the_parser_refuses_or_headers_past_the_bound_fail_open_and_close_the_connection():
    """Anything but a well-formed call (a bad request line, headers past MAX_HEADER_BYTES) is ext_authz's error, never a
    4xx the client would get; a call after it on the same connection is not read."""
    from extproc.brain.header_door import MAX_HEADER_BYTES

    asked = []

    async def raw(data: bytes) -> bytes:
        d = tempfile.mkdtemp(prefix="door-")
        path = os.path.join(d, "brain.headers.sock")
        door = await serve_door(door_app(lambda h: asked.append(h) or Placed("r0", "1.a"), lambda: True), path, None)
        try:
            reader, writer = await asyncio.open_unix_connection(path)
            writer.write(data)
            await writer.drain()
            got = await asyncio.wait_for(reader.read(), 10)  # to EOF: the door closed the connection
            writer.close()
            return got
        finally:
            await door.cleanup()
            os.unlink(path)
            os.rmdir(d)

    call_ = (f"POST {HEADER_DOOR_PREFIX}/v1/chat/completions HTTP/1.1\r\nhost: b\r\ncontent-length: 0\r\n\r\n").encode()
    got = asyncio.run(raw(b"NOT HTTP AT ALL\r\n\r\n" + call_))
    assert got.startswith(b"HTTP/1.1 500 ") and got.count(b"HTTP/1.1") == 1
    long = (f"POST {HEADER_DOOR_PREFIX}/v1/chat/completions HTTP/1.1\r\nx-session-id: {'s' * (MAX_HEADER_BYTES + 1)}"
            "\r\ncontent-length: 0\r\n\r\n").encode()
    got = asyncio.run(raw(long + call_))
    assert got.startswith(b"HTTP/1.1 500 ") and got.count(b"HTTP/1.1") == 1
    assert not asked
    # a well-formed call that asks to close is answered, then closed: one pipelined behind it is never decided (its
    # reservation would be opened with nobody to hear of it)
    got = asyncio.run(raw(call_.replace(b"host: b", b"host: b\r\nconnection: close") + call_))
    assert got.startswith(b"HTTP/1.1 200 ") and ROUTING_HEADER.encode() + b": r0" in got and len(asked) == 1
