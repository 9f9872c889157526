"""The header door: the header path's call as plain HTTP (Envoy's ext_authz) on a Unix socket beside the gRPC one.

A turn of a session under way is decided at its headers (``header_path``); where Envoy reaches the brain by a Unix
socket it asks there with an HTTP request instead of an ext_proc stream (``envoy_config.filters.door_filter``). Same
question, same answers, in ext_authz's words: a route is a 200 carrying the routing and reservation headers (Envoy adds
them to the request), "go on to the body" a 200 with neither, the brain's own answer its status, headers and JSON
body (Envoy sends them to the client). Served by an asyncio protocol over httptools' parser (llhttp, Node's): every
turn under way pays this door's CPU, and measured with do-nothing servers on this machine a call costs the server
~0.7 ms over a gRPC stream, 0.2-1.0 ms through aiohttp's low-level server, 0.06-0.27 ms here (2.2-5x less than
aiohttp in each of eight alternating runs, quiet and noisy).

A 5xx, a timeout or no answer is ext_authz's error, and Envoy lets the request go on to the body path: so every fault
here answers 500 (never a 4xx, which Envoy would send to the client as the brain's word). The socket is the gRPC
one's sibling with its permissions: whoever reaches it can open reservations. What a caller holds here: a
connection (Envoy opens at most ``envoy.brain_max_in_flight``, kept alive until Envoy's pool lets it go, as with the
gRPC socket) and one call's request line and headers at a time, at most ``MAX_HEADER_BYTES``; a body is not kept.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from http import HTTPStatus
from typing import Callable

import httptools

from ..answers import Answered, Placed
from ..contract import (
    DECLARED_LENGTH_HEADER,
    DOOR_READY_PATH,
    DP_RANK_HEADER,
    HEADER_DOOR_PREFIX,
    RESERVATION_HEADER,
    ROUTING_HEADER,
)
from ..core.profile import CONTENT_LENGTH
from . import logs

# (headers as the ext_proc header call gives them) -> a route, the brain's own answer, or None: read the body
Ask = Callable[[dict[str, str]], "Placed | Answered | None"]
# (method, request target, header lines as they came) -> the whole HTTP response
Handler = Callable[[str, str, list[tuple[bytes, bytes]]], bytes]

# Envoy sends up to 60 KiB of request headers (its max_request_headers_kb): a session id or credential that long must
# reach the brain, not be refused (a 400 here would be the client's answer); past this the call fails open (500)
MAX_HEADER_BYTES = 96 * 1024
ACCEPT_BACKLOG = 4096  # connections waiting to be accepted (the kernel caps it at net.core.somaxconn)
# headers the door's HTTP request carries that are not the client's: ext_authz's and the HTTP framing's
_NOT_THE_CLIENTS = frozenset((CONTENT_LENGTH, DECLARED_LENGTH_HEADER, "host", "x-envoy-internal",
                              "x-envoy-expected-rq-timeout-ms", "x-forwarded-for", "x-forwarded-proto"))


def response(status: int, headers: "list[tuple[str, str]] | None" = None, body: bytes = b"") -> bytes:
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"]
    head += [f"{k}: {v}\r\n" for k, v in headers or ()]
    head.append(f"content-length: {len(body)}\r\n\r\n")
    return "".join(head).encode("latin-1") + body


_BARE_200, _FAULT, _NOT_READY = response(200), response(500), response(503)


def client_headers(method: str, target: str, lines: list[tuple[bytes, bytes]]) -> dict[str, str] | None:
    """The client request's headers as the header path reads them (lower-case names, ``:method``, ``:path``, its
    declared ``content-length``); None: not a header call (a path outside the door)."""
    if not target.startswith(HEADER_DOOR_PREFIX + "/"):
        return None
    headers = {":method": method, ":path": target[len(HEADER_DOOR_PREFIX):]}
    declared = None
    for raw_name, raw_value in lines:
        name = raw_name.decode("latin-1").lower()
        value = raw_value.decode("utf-8", "surrogateescape")
        if name == DECLARED_LENGTH_HEADER:
            declared = value
        if name not in _NOT_THE_CLIENTS:
            headers[name] = value if name not in headers else headers[name] + "," + value
    if declared is not None:
        headers[CONTENT_LENGTH] = declared
    return headers


def respond(out: "Placed | Answered | None") -> bytes:
    """The brain's word at the headers in ext_authz's terms."""
    if out is None:
        return _BARE_200
    if isinstance(out, Placed):
        headers = [(ROUTING_HEADER, out.replica), (RESERVATION_HEADER, out.reservation)]
        if out.dp_rank is not None:
            headers.append((DP_RANK_HEADER, str(out.dp_rank)))
        return response(200, headers)
    if out.status == 200 or out.status >= 500:
        # a 200 would let the request through unanswered, a 5xx fail open: the brain's own answer at the headers is
        # a refusal (429), which ext_authz passes on; anything else is read from the body, where ext_proc answers it
        return _BARE_200
    hit = _RENDERED.get(id(out))
    if hit is not None and hit[0] is out:
        return hit[1]
    raw = response(out.status, [("content-type", "application/json"), *out.headers], out.body)
    if len(_RENDERED) >= _RENDERED_MAX:
        _RENDERED.clear()
    _RENDERED[id(out)] = (out, raw)  # the answer kept with its bytes: its id names nothing else while it is here
    return raw


# the brain's own answers rendered lately, by the object (flow control's 429s are one object per reason and wait): a
# flood's 2,000 refusals at their header calls are rendered once, not each
_RENDERED: dict[int, tuple[Answered, bytes]] = {}
_RENDERED_MAX = 256


def door_app(ask: Ask, ready: Callable[[], bool], faults: "Counter[str] | None" = None) -> Handler:
    """The door's answer to one call: ``ask`` decides a header call, ``ready`` says whether the brain serves yet."""

    def handle(method: str, target: str, lines: list[tuple[bytes, bytes]]) -> bytes:
        if target == DOOR_READY_PATH:
            return _BARE_200 if ready() else _NOT_READY
        try:
            headers = client_headers(method, target, lines)
            if headers is None:  # not a call Envoy makes: fail open rather than answer a client
                return _FAULT
            return respond(ask(headers))
        except Exception as e:  # the request goes on to the body path: a fault here must not answer the client
            if faults is not None:
                faults["door"] += 1
            logs.event("loop_error", loop="header_door", error=type(e).__name__)
            return _FAULT

    return handle


class _TooLong(Exception):
    pass


class _Call(asyncio.Protocol):
    """One connection from Envoy: HTTP/1.1 requests one after another (kept alive), each answered as it completes.
    Anything the parser refuses, or headers past ``MAX_HEADER_BYTES``, is answered 500 and the connection closed."""

    def __init__(self, handle: Handler, open_calls: "set[_Call]"):
        self._handle, self._open = handle, open_calls
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._target, self._size = b"", 0
        self._lines: list[tuple[bytes, bytes]] = []

    def connection_made(self, transport) -> None:
        self._transport = transport
        self._open.add(self)

    def connection_lost(self, exc) -> None:
        self._open.discard(self)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # the parser's callbacks
    def on_message_begin(self) -> None:
        self._target, self._lines, self._size = b"", [], 0

    def on_url(self, url: bytes) -> None:
        self._grow(len(url))
        self._target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._grow(len(name) + len(value))
        self._lines.append((name, value))

    def _grow(self, n: int) -> None:
        self._size += n
        if self._size > MAX_HEADER_BYTES:
            raise _TooLong

    def on_message_complete(self) -> None:
        assert self._transport is not None
        out = self._handle(self._parser.get_method().decode("latin-1"), self._target.decode("latin-1"), self._lines)
        self._transport.write(out)
        if not self._parser.should_keep_alive():
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        # after a refusal or a call that asked to close, the transport reads no more, and llhttp refuses what follows
        # a closing call in the same chunk (tests/brain/test_header_door.py: a call pipelined behind it is not decided)
        assert self._transport is not None
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, _TooLong):
            self._transport.write(_FAULT)
            self._transport.close()


class Door:
    """A door's listening socket and the connections it has open (each a protocol with ``close()``)."""

    def __init__(self, server: asyncio.AbstractServer, conns: set):
        self._server, self._conns = server, conns

    async def cleanup(self) -> None:
        self._server.close()
        for conn in list(self._conns):  # Envoy keeps its connections open: they end with the brain
            conn.close()
        await self._server.wait_closed()


async def serve_unix(factory: Callable[[set], asyncio.Protocol], path: str, group_gid: int | None) -> Door:
    """A protocol (``factory(open connections)``) on the Unix socket ``path``, born 0600 (0660 with a group): the
    gRPC socket's permissions."""
    conns: set = set()
    old = os.umask(0o117 if group_gid is not None else 0o177)
    try:
        # Envoy opens up to brain_max_in_flight connections at once in a burst: past the accept backlog a Unix socket
        # refuses a connect at once, and Envoy fails that call open (755 of 1,500 in a flood at aiohttp's 128)
        server = await asyncio.get_running_loop().create_unix_server(lambda: factory(conns), path,
                                                                      backlog=ACCEPT_BACKLOG)
    finally:
        os.umask(old)
    if group_gid is not None:
        os.chown(path, -1, group_gid)
    os.chmod(path, 0o660 if group_gid is not None else 0o600)
    return Door(server, conns)


async def serve_door(handler: Handler, path: str, group_gid: int | None) -> Door:
    """The header door: ``handler`` answers each call on the Unix socket ``path``."""
    return await serve_unix(lambda conns: _Call(handler, conns), path, group_gid)
