"""The ext_proc side: read the headers Envoy sent, answer with the brain's choice.

Per request Envoy opens an ext_proc stream and sends one message: the buffered body, with the
request headers the brain reads as attributes. The answer carries the chosen replica's cluster
and a reservation id as dynamic metadata (which Envoy's next filter copies into the routing
header) and as header mutations (which Envoy applies when its config sends the headers too),
and clears the route cache so Envoy re-routes.
"""

from __future__ import annotations

from collections import Counter
from typing import AsyncIterator, Awaitable, Callable


import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from ..contract import (
    BODY_METADATA_NAMESPACE,
    ANSWER_CLUSTER,
    ANSWER_DP_RANK,
    DP_RANK_HEADER,
    ANSWER_RESERVATION,
    HEADER_PATH_METADATA,
    LOOK_BYTES,
    LOOK_METADATA,
    METADATA_NAMESPACE,
    REQUEST_ID_HEADER,
    RESERVATION_HEADER,
    SESSION_METADATA,
    TIME_ATTRIBUTE,
    LOOK_UPLOAD_HEADER,
    ROUTING_HEADER,
    header_of_attribute,
)
from ..answers import Answered, Held, Placed
from ..core.apis import KV_TRANSFER_KEY
from ..core.profile import BODY_KV_TRANSFER_KEY, BODY_MODEL_KEY, BODY_SESSION_PREFIX, declared_size
from . import logs
from .header_path import Asked
from .intake import CALL_BYTES, Intake
from .legs import Legs
from ..picker.messages import header_value, headers_of, render, wait_longer

Outcome = Placed | Answered | Held | Legs
# (headers, body or None, the ext_proc phase being answered) -> the brain's outcome
Decide = Callable[[dict[str, str], "bytes | None", str], Outcome]


def route_answer(cluster: str, reservation: str, phase: str, dp_rank: int | None = None,
                 body: bytes | None = None) -> ep.ProcessingResponse:
    """The brain's choice for the ext_proc message ``phase`` (``request_body`` or ``request_headers``); with
    ``dp_rank``, the data-parallel engine of the replica too; with ``body``, the body to send instead."""
    out = ep.ProcessingResponse()
    common = getattr(out, phase).response
    if body is not None and phase == "request_body":
        common.body_mutation.body = body
    # Applied only where Envoy sent the headers; in the one-message config it is the dynamic metadata
    # that routes, but a header mutation must be present for Envoy to honour clear_route_cache.
    common.header_mutation.set_headers.extend([header_value(ROUTING_HEADER, cluster), header_value(RESERVATION_HEADER,
                                                                                                   reservation)])
    if dp_rank is not None:
        common.header_mutation.set_headers.append(header_value(DP_RANK_HEADER, str(dp_rank)))
    common.clear_route_cache = True
    answer = out.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields
    answer[ANSWER_CLUSTER].string_value = cluster
    answer[ANSWER_RESERVATION].string_value = reservation
    if dp_rank is not None:
        answer[ANSWER_DP_RANK].string_value = str(dp_rank)
    return out


def envoy_answer(out: "Placed | Answered", phase: str) -> ep.ProcessingResponse:
    """The brain's outcome as Envoy's answer to the ext_proc message ``phase``."""
    if isinstance(out, Placed):
        return route_answer(out.replica, out.reservation, phase, out.dp_rank, out.body)
    return render(out)


def body_kv_transfer(req: ep.ProcessingRequest) -> bool:
    """Envoy found a top-level kv_transfer_params in a body too big to send (json_to_metadata)."""
    ns = req.metadata_context.filter_metadata.get(BODY_METADATA_NAMESPACE)
    return ns is not None and KV_TRANSFER_KEY in ns.fields


def body_model(req: ep.ProcessingRequest) -> str | None:
    """The top-level "model" Envoy read from a body too big to send (json_to_metadata), when it did."""
    ns = req.metadata_context.filter_metadata.get(BODY_METADATA_NAMESPACE)
    v = ns.fields.get("model") if ns is not None else None
    return v.string_value[:256] if v is not None and v.string_value else None


# a session id Envoy read from a body: longer ones are no session (cut, it would name another session than the
# parse of a smaller body gives)
MAX_SESSION_CHARS = 1024


def body_sessions(req: ep.ProcessingRequest) -> dict[str, str]:
    """The session fields Envoy read from a body too big to send (json_to_metadata), as pseudo-headers by place."""
    ns = req.metadata_context.filter_metadata.get(BODY_METADATA_NAMESPACE)
    if ns is None:
        return {}
    return {BODY_SESSION_PREFIX + k[len(SESSION_METADATA):]: v.string_value for k, v in ns.fields.items()
            if k.startswith(SESSION_METADATA) and 0 < len(v.string_value) <= MAX_SESSION_CHARS}


def _attribute(req: ep.ProcessingRequest, name: str) -> str | None:
    for attrs in req.attributes.values():
        v = attrs.fields.get(name)
        if v is not None and v.HasField("string_value"):
            return v.string_value
    return None


def headers_from_attributes(req: ep.ProcessingRequest) -> dict[str, str]:
    """Headers Envoy sent as ``request.headers['name']`` attributes (absent headers are absent keys)."""
    out = {}
    for attrs in req.attributes.values():
        for key, value in attrs.fields.items():
            name = header_of_attribute(key)
            if name is not None and value.HasField("string_value"):
                out[name] = value.string_value
    return out


_PASS = {
    "request_headers": ep.ProcessingResponse(request_headers=ep.HeadersResponse()),
    "request_trailers": ep.ProcessingResponse(request_trailers=ep.TrailersResponse()),
    "response_headers": ep.ProcessingResponse(response_headers=ep.HeadersResponse()),
    "response_body": ep.ProcessingResponse(response_body=ep.BodyResponse()),
    "response_trailers": ep.ProcessingResponse(response_trailers=ep.TrailersResponse()),
}


BEHIND = 16  # calls read and not yet answered beyond which the brain extends Envoy's timer before it decides


class ExternalProcessor(ep_grpc.ExternalProcessorServicer):
    """Decides on the first message that can be decided on, then ends the stream.

    With the shipped config that is the only message: the body, headers as attributes; a body above
    ``envoy.brain_body_max_bytes`` takes the big-body route, whose message is the headers alone. A
    config that sends headers too (``request_header_mode: SEND``) also works: the headers are kept
    for the body, or decided on at once when no body follows. Ending the stream tells Envoy that the brain
    wants nothing more of this request.
    """

    def __init__(self, decide: Decide, big_body_bytes: int | None = None,
                 wait: "Callable[[object], Awaitable[Outcome]] | None" = None,  # a future, at once
                 cancel: "Callable[[object], None] | None" = None, hold_s: float = 0.0,
                 look: "Callable[[dict[str, str], float, float | None, bool], Answered | None] | None" = None,
                 intake: Intake | None = None, legs_s: float = 35.0,
                 at_headers: "Callable[[dict[str, str], Asked], Placed | Answered | None] | None" = None,
                 faults: "Counter[str] | None" = None):
        self.decide = decide
        # calls whose decision raised, by call: counted and logged by the error's kind, and the call ended with a
        # status Envoy fails open on (failure_mode_allow), instead of grpcio's traceback and nothing to alert on
        self.faults: Counter[str] = faults if faults is not None else Counter()
        self.big_body_bytes = big_body_bytes  # envoy.brain_body_max_bytes: such bodies are never sent
        self.open_calls = 0  # calls read and not yet answered: past BEHIND, the brain is behind a burst
        # flow control: how to wait for a held request's answer, and to give it up when Envoy closes the call
        self.wait, self.cancel, self.hold_s = wait, cancel, hold_s
        # the look before a large body (headers, once Envoy holds the body): (headers, how long its body would wait to
        # be read) -> None to let it come, or the answer instead; and how far behind the brain reads
        self.look, self.intake = look, intake
        self.legs_s = legs_s  # a disaggregated request's call stays open this long for its prefill leg
        # the header path: (headers) -> the route of a turn its headers decide, or None (its body decides)
        self.at_headers = at_headers

    async def _answer(self, out: Outcome, context, phase: str) -> None:
        if isinstance(out, Held):
            assert self.wait is not None and self.cancel is not None  # only flow control holds
            key = out.key
            answer = self.wait(key)  # registered before any await: the answer may come at the next tick
            try:
                # Envoy gives up on the call (and fails open) after its message_timeout: held, it waits longer
                await context.write(wait_longer(self.hold_s))
                out = await answer
            except BaseException:
                self.cancel(key)
                raise
        if isinstance(out, Legs):  # a disaggregated request: its prefill leg first, then the answer
            legs = out
            try:
                await context.write(wait_longer(self.legs_s))  # Envoy's timer would fail it open mid-leg
                await context.write(envoy_answer(await legs.run(), phase))
            except BaseException:
                legs.abandon()
                raise
            return
        assert not isinstance(out, Held)  # a held request's answer is a placement or the brain's own
        await context.write(envoy_answer(out, phase))

    async def Process(self, request_iterator: AsyncIterator[ep.ProcessingRequest], context) -> None:
        tags = (context.invocation_metadata() or ()) if self.at_headers is not None or self.look is not None else ()
        if self.at_headers is not None and HEADER_PATH_METADATA in tags:
            await self._guarded("header", self._header_path(context), context)
            return
        if self.look is not None and LOOK_METADATA in tags:
            await self._guarded("look", self._look(context), context)
            return
        self.open_calls += 1
        if self.intake is not None:
            self.intake.opened(context)
        try:
            await self._guarded("body", self._process(context), context)
        finally:
            self.open_calls -= 1
            if self.intake is not None:
                self.intake.closed(context)

    async def _guarded(self, call: str, work: Awaitable[None], context) -> None:
        """``work``, a fault in it counted and logged by its kind (never its message: it may quote a request), and
        the call ended with INTERNAL: Envoy routes the request without the brain, as it would a dead one."""
        try:
            await work
        except Exception as e:  # a bug must cost one request its decision, and say so; never the stream's traceback
            self.faults[call] += 1
            logs.event("loop_error", loop=f"ext_proc_{call}", error=type(e).__name__)
            await context.abort(grpc.StatusCode.INTERNAL, "the brain could not decide this request")

    async def _header_path(self, context) -> None:
        """``warmroute.header_path``: a request's headers before its body. Answered at once: its route (the body then
        never comes here), or go on (the body's own call follows)."""
        req = await context.read()
        if req is grpc.aio.EOF or req.WhichOneof("request") != "request_headers":
            return
        out = self.at_header_call(headers_of(req.request_headers))
        await context.write(envoy_answer(out, "request_headers") if out is not None else _PASS["request_headers"])

    def at_header_call(self, headers: dict[str, str]) -> "Placed | Answered | None":
        """The brain's word at a request's header call (over gRPC here, or at the header door): its route, the brain's
        own answer, or None to read its body."""
        assert self.at_headers is not None  # only the header path's calls come here
        asked = Asked()
        out = self.at_headers(headers, asked)
        if out is None and self.look is not None and self.intake is not None:
            # the look's word, here, before the upload: in a burst a new session is refused at this call and makes no
            # other (1,500 new sessions at once each paying a header call, a look and a body failed 900 open). By what
            # the brain measures of its own reading alone: a size declared and never sent charges nobody else
            size = declared_size(headers) or 0
            behind = self.intake.behind_s()
            out = self.look(headers, behind + self.intake.own_s(size if size > LOOK_BYTES else CALL_BYTES), behind,
                            asked.why == "new_session")
            if out is None:
                # its call announced now, at a call's cost and not its declared size's (a larger body's bytes count once
                # the look sees it here): 2,000 new sessions at once were each let on, and read or looked at to be
                # refused, while the turns under way waited behind their calls (issue 59, finding 6). A declaration
                # that never comes costs one call for a timer's length
                self.intake.let_through(headers.get(REQUEST_ID_HEADER), CALL_BYTES)
        return out

    async def _look(self, context) -> None:
        """``warmroute.look``: a large body's headers, sent once Envoy holds the body, before the brain reads it.
        Answered at once: let it
        come (the body call follows), or the brain's answer instead (then Envoy never sends the body)."""
        req = await context.read()
        if req is grpc.aio.EOF or req.WhichOneof("request") != "request_headers":
            return
        headers = headers_of(req.request_headers)
        assert self.look is not None and self.intake is not None  # only the look's calls come here
        size = declared_size(headers) or 0
        late = self.intake.late_s(_attribute(req, TIME_ATTRIBUTE), headers.get(LOOK_UPLOAD_HEADER))
        behind = self.intake.behind_s()
        out = self.look(headers, max(late, behind + self.intake.own_s(size)), max(late, behind), False)
        if out is None:
            self.intake.let_through(headers.get(REQUEST_ID_HEADER), size)
        else:  # refused here: its body never comes, and its header call's announcement goes with it
            self.intake.forget(headers.get(REQUEST_ID_HEADER))
        await context.write(render(out) if out is not None else _PASS["request_headers"])

    async def _process(self, context) -> None:
        headers: dict[str, str] = {}
        while True:
            req = await context.read()
            if req is grpc.aio.EOF:
                return
            kind = req.WhichOneof("request")
            if req.attributes:
                headers.update(headers_from_attributes(req))
            if kind == "request_body":
                if self.intake is not None:
                    self.intake.read(context, headers.get(REQUEST_ID_HEADER))
                if self.hold_s and self.open_calls > BEHIND:
                    # a burst: the decisions queued ahead of this one may outlast Envoy's timer, and a call that
                    # times out fails open into the engines. Flow control may hold it anyway: the timer first
                    await context.write(wait_longer(self.hold_s))
                await self._answer(self.decide(headers, req.request_body.body, "request_body"), context,
                                   "request_body")
                return
            if kind == "request_headers":
                headers.update(headers_of(req.request_headers))
                model = body_model(req)
                if model:
                    headers[BODY_MODEL_KEY] = model
                if body_kv_transfer(req):
                    headers[BODY_KV_TRANSFER_KEY] = "1"
                headers.update(body_sessions(req))
                size = declared_size(headers)
                # a body too big to send, or one of no declared size (chunked): the route sends headers alone (after
                # the whole body arrived, with its model read by Envoy)
                big = self.big_body_bytes is not None and (size is None or size > self.big_body_bytes)
                # no body follows, or one Envoy does not send (the big-body route): decide on the headers
                if req.request_headers.end_of_stream or big:
                    if self.intake is not None:  # read as far as it will be: its header call's announcement is done
                        self.intake.read(context, headers.get(REQUEST_ID_HEADER))
                    await self._answer(self.decide(headers, None, "request_headers"), context, "request_headers")
                    return
            await context.write(_PASS[kind])
