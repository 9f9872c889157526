"""The header door: the header path's call as plain HTTP (Envoy's ext_authz) on a Unix socket beside the gRPC one.

A turn of a session under way is decided at its headers (``header_path``); where Envoy reaches the brain by a Unix
socket it asks there with an HTTP request instead of an ext_proc stream (``envoy_config.filters.door_filter``). Same
question, same answers, in ext_authz's words: a route is a 200 carrying the routing and reservation headers (Envoy adds
them to the request), "go on to the body" a 200 with neither, the brain's own answer its status, headers and JSON
body (Envoy sends them to the client). Measured with do-nothing servers on this machine: a gRPC stream costs the
server ~0.7 ms of CPU a request, this ~0.2 ms.

A 5xx, a timeout or no answer is ext_authz's error, and Envoy lets the request go on to the body path: so every fault
here answers 500 (never a 4xx, which Envoy would send to the client as the brain's word). The socket is the gRPC
one's sibling with its permissions: whoever reaches it can open reservations.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Awaitable, Callable

from aiohttp import web

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

# Envoy sends up to 60 KiB of request headers (its max_request_headers_kb): a session id or credential that long must
# reach the brain, not be refused by the HTTP parser (a 400 here would be the client's answer)
MAX_HEADER_BYTES = 96 * 1024
ACCEPT_BACKLOG = 4096  # connections waiting to be accepted (the kernel caps it at net.core.somaxconn)
# headers the door's HTTP request carries that are not the client's: ext_authz's and the HTTP framing's
_NOT_THE_CLIENTS = frozenset((CONTENT_LENGTH, DECLARED_LENGTH_HEADER, "host", "x-envoy-internal",
                              "x-envoy-expected-rq-timeout-ms", "x-forwarded-for", "x-forwarded-proto"))


def client_headers(request: web.BaseRequest) -> dict[str, str] | None:
    """The client request's headers as the header path reads them (lower-case names, ``:method``, ``:path``, its
    declared ``content-length``); None: not a header call (a path outside the door)."""
    path = request.raw_path
    if not path.startswith(HEADER_DOOR_PREFIX + "/"):
        return None
    headers = {":method": request.method, ":path": path[len(HEADER_DOOR_PREFIX):]}
    for name, value in request.headers.items():
        name = name.lower()
        if name not in _NOT_THE_CLIENTS:
            headers[name] = value if name not in headers else headers[name] + "," + value
    declared = request.headers.get(DECLARED_LENGTH_HEADER)
    if declared is not None:
        headers[CONTENT_LENGTH] = declared
    return headers


def respond(out: "Placed | Answered | None") -> web.Response:
    """The brain's word at the headers in ext_authz's terms."""
    if out is None:
        return web.Response(status=200)
    if isinstance(out, Placed):
        headers = {ROUTING_HEADER: out.replica, RESERVATION_HEADER: out.reservation}
        if out.dp_rank is not None:
            headers[DP_RANK_HEADER] = str(out.dp_rank)
        return web.Response(status=200, headers=headers)
    if out.status == 200 or out.status >= 500:
        # a 200 would let the request through unanswered, a 5xx fail open: the brain's own answer at the headers is
        # a refusal (429), which ext_authz passes on; anything else is read from the body, where ext_proc answers it
        return web.Response(status=200)
    return web.Response(status=out.status, body=out.body, content_type="application/json",
                        headers=dict(out.headers))


Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


def door_app(ask: Ask, ready: Callable[[], bool], faults: "Counter[str] | None" = None) -> Handler:
    """The door's request handler: ``ask`` decides a header call, ``ready`` says whether the brain serves yet. Served
    by aiohttp's low-level server: one handler for every path, no router or middleware to pass through (a turn
    under way pays this door's CPU on every call)."""

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        if request.raw_path == DOOR_READY_PATH:
            return web.Response(status=200 if ready() else 503)
        headers = client_headers(request)
        if headers is None:  # not a call Envoy makes: fail open rather than answer a client
            return web.Response(status=500)
        try:
            return respond(ask(headers))
        except Exception as e:  # the request goes on to the body path: a fault here must not answer the client
            if faults is not None:
                faults["door"] += 1
            logs.event("loop_error", loop="header_door", error=type(e).__name__)
            return web.Response(status=500)

    return handle


async def serve_door(handler: Handler, path: str, group_gid: int | None) -> web.BaseRunner:
    """``handler`` on the Unix socket ``path``, born 0600 (0660 with a group): the gRPC socket's permissions."""
    runner = web.ServerRunner(web.Server(handler, access_log=None, max_line_size=MAX_HEADER_BYTES,
                                         max_field_size=MAX_HEADER_BYTES))
    await runner.setup()
    old = os.umask(0o117 if group_gid is not None else 0o177)
    try:
        # Envoy opens up to brain_max_in_flight connections at once in a burst: past the accept backlog (aiohttp's 128)
        # a Unix socket refuses a connect at once, and Envoy fails that call open (755 of 1,500 in a flood)
        await web.UnixSite(runner, path, backlog=ACCEPT_BACKLOG).start()
    finally:
        os.umask(old)
    if group_gid is not None:
        os.chown(path, -1, group_gid)
    os.chmod(path, 0o660 if group_gid is not None else 0o600)
    return runner
