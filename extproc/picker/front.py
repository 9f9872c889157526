"""The Gateway API Inference Extension's endpoint-picker exchange (GIE docs/proposals/004, v1), per stream.

A gateway opens one ext_proc stream per HTTP request and keeps it for the request's whole life:

1. request headers (with the gateway's subset hint in ``metadata_context``), then the body in
   ``FULL_DUPLEX_STREAMED`` chunks. The body is buffered to its end (the prefix and session keys are in
   it), the brain decides, and the answer goes out in the protocol's order: the headers response carrying
   ``x-gateway-destination-endpoint: ip:port[,ip:port...]`` as a header mutation and the same value as
   dynamic metadata ``envoy.lb``, with ``clear_route_cache``; then the body back, in chunks of at most
   62,000 bytes. A body past ``body_max_bytes`` is decided on its first bytes (``early_reach``: what its block
   chain reads, where nothing after them can move it) or else on its headers alone, and streamed on as it comes.
2. the response passes through: its status and first byte, and the endpoint that served it (the
   gateway's ``envoy.lb`` / ``x-gateway-destination-endpoint-served``, or Envoy's ``upstream.address``
   attribute), are all the brain learns. Its end (or the stream's, when the client or the gateway went
   away first) releases the reservation: no access log comes from a gateway the brain did not configure.

A gateway configured with ``BUFFERED`` request bodies (not the protocol's mode, but seen in the wild)
is answered on the body message; one that sends ``STREAMED`` bodies gets a decision on the headers.
"""

from __future__ import annotations

import itertools

import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm

from ..contract import (
    DESTINATION_HEADER,
    DESTINATION_NAMESPACE,
    DESTINATION_SERVED_KEY,
    DP_RANK_HEADER,
    PICKER_BODY_CHUNK,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
)
from ..core.kv_scan import KvTransferScan
from ..core.profile import BODY_ARRIVING_KEY, BODY_PARTIAL_KEY, CONTENT_LENGTH
from ..answers import Answered, SERVICE_UNAVAILABLE, error, in_api_shape, kv_transfer_not_allowed, model_not_found, \
    path_not_served
from .messages import header_value, headers_of, path_of, render, wait_longer

UPSTREAM_ADDRESS_ATTRIBUTE = "upstream.address"  # Envoy's attribute: the endpoint that served (response side)
_FAULT_CODES = frozenset({502, 503, 504})


class PickResult(Protocol):
    endpoints: list[str]  # best first; empty: nothing to pick
    reservation: Any  # what ``end`` releases (None with no pick)
    subset_empty: bool  # the gateway's subset named nothing the picker knows
    dp_rank: "int | None"  # the data-parallel engine of the pick (a header for the replica), or None
    body: "bytes | None"  # the body to send instead (the model's alias rewritten), or None
    unknown_model: "str | None"  # the body names a model no endpoint serves (answered 404), or None
    unserved_path: "str | None"  # no endpoint (of the model) serves the request's path (answered 404), or None
    immediate: "Answered | None"  # an answer to give at once instead (a 413), or None
    held: Any  # flow control holds it: ``wait(held)`` gives the pick later; None: this is the pick


# (headers, body or None, the gateway's subset or None) -> the pick
Pick = Callable[[dict[str, str], "bytes | None", "list[str] | None"], PickResult]
# (reservation, served endpoint or None, failed: True/False, None when nothing is known, first byte seconds)
End = Callable[[Any, "str | None", "bool | None", "float | None"], None]


MAX_SUBSET = 4096  # endpoints read from a subset hint: more than any pool; a 2M-entry hint stalled the loop 0.6 s


def _struct_strings(value) -> list[str]:
    """A metadata value as a list of endpoints: a list of strings, or one comma-separated string; the first
    MAX_SUBSET of them."""
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        values = value.list_value.values
        return [v.string_value.strip() for v in itertools.islice(values, MAX_SUBSET) if v.string_value.strip()]
    if kind == "string_value":
        return [p.strip() for p in itertools.islice(value.string_value[:MAX_SUBSET * 64].split(","), MAX_SUBSET)
                if p.strip()]
    return []


def subset_of(req: ep.ProcessingRequest) -> list[str] | None:
    """The gateway's subset hint: None when it sent none (pick from the whole pool); a list, maybe empty."""
    ns = req.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET_KEY not in ns.fields:
        return None
    return _struct_strings(ns.fields[SUBSET_KEY])


def served_of(req: ep.ProcessingRequest) -> str | None:
    ns = req.metadata_context.filter_metadata.get(DESTINATION_NAMESPACE)
    if ns is not None and DESTINATION_SERVED_KEY in ns.fields:
        served = _struct_strings(ns.fields[DESTINATION_SERVED_KEY])
        if served:
            return served[0]
    for attrs in req.attributes.values():
        v = attrs.fields.get(UPSTREAM_ADDRESS_ATTRIBUTE)
        if v is not None and v.string_value:
            return v.string_value
    return None


def destination_answer(endpoints: list[str], body_len: int | None, phase: str = "request_headers",
                       dp_rank: int | None = None, body: bytes | None = None) -> ep.ProcessingResponse:
    """The pick, as the protocol wants it: the header and the metadata carry the same value. ``body``: the
    buffered body's replacement (answering its ``request_body``)."""
    value = ",".join(endpoints)
    out = ep.ProcessingResponse()
    common = getattr(out, phase).response
    if body is not None:
        common.body_mutation.body = body
    common.header_mutation.set_headers.append(header_value(DESTINATION_HEADER, value))
    if dp_rank is not None:
        common.header_mutation.set_headers.append(header_value(DP_RANK_HEADER, str(dp_rank)))
    if body_len is not None:
        # a streamed body reaches the replica without Content-Length unless it is set again
        common.header_mutation.set_headers.append(header_value(CONTENT_LENGTH, str(body_len)))
    common.clear_route_cache = True
    out.dynamic_metadata.fields[DESTINATION_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = value
    return out


def body_chunks(body: bytes, end: bool) -> list[ep.ProcessingResponse]:
    """``body`` back to the gateway as streamed body responses of at most PICKER_BODY_CHUNK bytes."""
    pieces = [body[i:i + PICKER_BODY_CHUNK] for i in range(0, len(body), PICKER_BODY_CHUNK)] or [b""]
    return [_streamed("request_body", p, end and i == len(pieces) - 1) for i, p in enumerate(pieces)]


def _streamed(phase: str, body: bytes, end: bool) -> ep.ProcessingResponse:
    out = ep.ProcessingResponse()
    sr = getattr(out, phase).response.body_mutation.streamed_response
    sr.body = body
    sr.end_of_stream = end
    return out


def no_endpoint(subset_given: bool) -> Answered:
    if subset_given:
        return error(SERVICE_UNAVAILABLE, "none of the endpoints this gateway allows for the request is ready",
                     "service_unavailable", "no_eligible_endpoint", "warmroute_no_eligible_endpoint", 5)
    return error(SERVICE_UNAVAILABLE, "no model server is ready; retry shortly", "service_unavailable",
                 "no_healthy_instances", "warmroute_no_healthy_instances", 5)


_PASS = {
    "request_headers": ep.ProcessingResponse(request_headers=ep.HeadersResponse()),
    "request_body": ep.ProcessingResponse(request_body=ep.BodyResponse()),
    "request_trailers": ep.ProcessingResponse(request_trailers=ep.TrailersResponse()),
    "response_headers": ep.ProcessingResponse(response_headers=ep.HeadersResponse()),
    "response_body": ep.ProcessingResponse(response_body=ep.BodyResponse()),
    "response_trailers": ep.ProcessingResponse(response_trailers=ep.TrailersResponse()),
}
_DUPLEX = pm.ProcessingMode.FULL_DUPLEX_STREAMED
_BUFFERED = (pm.ProcessingMode.BUFFERED, pm.ProcessingMode.BUFFERED_PARTIAL)


@dataclass(slots=True)
class _Stream:
    """One request's exchange: what has been read, answered and learned."""

    headers: dict[str, str] = field(default_factory=dict)
    subset: list[str] | None = None
    body: list[bytes] = field(default_factory=list)
    size: int = 0
    request_mode: int = _DUPLEX  # how the gateway sends the request body (its protocol_config)
    response_duplex: bool = True  # response body chunks must be echoed back
    answered: bool = False
    picked_at: float = 0.0
    reservation: Any = None
    served: str | None = None
    response_seen: bool = False  # the response's first message (the one with its metadata) has been read
    status: int = 0
    first_byte_s: float | None = None  # from the pick to a streamed response's first body byte (its first token)
    streamed: bool = False  # the response is an event stream
    ended: bool = False
    new_body: bytes | None = None  # the body the pick rewrote (its model alias), sent instead of the client's
    arriving: bool = False  # decided before its body ended: its work is booked when the body has passed
    early: int | None = None  # decided on this many of its body's first bytes, the rest passed on unread (None: whole)
    kv: KvTransferScan | None = None  # a body passed on unread, read for a client's kv_transfer_params


class EndpointPicker(ep_grpc.ExternalProcessorServicer):
    def __init__(self, pick: Pick, end: End, body_max_bytes: int, clock: Callable[[], float] = time.monotonic,
                 on_reset: Callable[[], None] | None = None, buffered_max_bytes: int | None = None,
                 wait: "Callable[[object], Awaitable[Any]] | None" = None,
                 cancel: "Callable[[object], None] | None" = None, hold_s: float = 0.0,
                 arrived: "Callable[[Any], None] | None" = None,
                 pick_at_headers: "Callable[[dict[str, str], list[str] | None], PickResult | None] | None" = None,
                 early_reach: "Callable[[dict[str, str]], int | None] | None" = None,
                 connectors: "Callable[[], bool] | None" = None):
        self.pick = pick
        # the fleet's engines run a KV connector (a replica of role prefill or decode): a body passed on unread is
        # read for a client's kv_transfer_params as it passes (core.kv_scan: 0.08-9 ms a MB, prose to code)
        self.connectors = connectors
        # a body its headers alone would decide (past body_max_bytes): how many of its first bytes decide it instead
        self.early_reach = early_reach
        # the header path: the pick of a turn of a session under way, on its headers alone (None: its body decides)
        self.pick_at_headers = pick_at_headers
        # a request decided before its body ended (past the byte limits, or a STREAMED gateway): its work is booked
        # once the body has passed (an upload held open reaches no engine, and must not hold the fleet's room)
        self.arrived = arrived
        # flow control: how to wait for a held request's pick (a future, registered at once), to give it up when the
        # gateway closes the stream, and how long to ask the gateway's message timer to wait
        self.wait, self.cancel, self.hold_s = wait, cancel, hold_s
        self.end = end
        self.body_max_bytes = body_max_bytes  # larger bodies: decided on the headers, streamed through
        # bodies held across every stream at once: past it a body is decided on its headers and streamed through, so
        # streams that never end cannot each hold body_max_bytes (114 MB -> 505 MB with no bound)
        self.buffered_max_bytes = buffered_max_bytes if buffered_max_bytes is not None else 16 * body_max_bytes
        self.buffered = 0
        self.clock = clock
        self.on_reset = on_reset

    async def Process(self, request_iterator: AsyncIterator[ep.ProcessingRequest], context) -> None:
        st = _Stream()
        try:
            while True:
                req = await context.read()
                if req is grpc.aio.EOF:
                    return
                if req.HasField("protocol_config"):
                    st.request_mode = req.protocol_config.request_body_mode
                    st.response_duplex = req.protocol_config.response_body_mode == _DUPLEX
                for out in await self._step(st, req, context):
                    await context.write(out)
                    if out.HasField("immediate_response"):
                        return
                if st.ended:
                    return
        finally:
            self._drop_held(st)
            if st.reservation is not None and not st.ended:
                # the stream ended before the response did: the client left, the replica reset, the gateway went
                self.end(st.reservation, st.served, None, st.first_byte_s)
                if self.on_reset is not None:
                    self.on_reset()

    def _drop_held(self, st: _Stream) -> bytes:
        """The body the stream held, no longer counted against buffered_max_bytes."""
        held, st.body = b"".join(st.body), []
        self.buffered -= st.size
        st.size = 0
        return held

    async def _decide(self, st: _Stream, body: bytes | None, context, phase: str = "request_headers",
                      arriving: bool = False, partial: bool = False) -> ep.ProcessingResponse:
        st.answered = True
        st.arriving = arriving and self.arrived is not None
        headers = {**st.headers, BODY_ARRIVING_KEY: "1"} if st.arriving else st.headers
        p = self.pick({**headers, BODY_PARTIAL_KEY: "1"} if partial else headers, body, st.subset)
        if p.held is not None:  # flow control holds it: the pick comes once a replica has room (or a 429)
            answer = self.wait(p.held)  # registered before any await: the pick may come at the next tick
            try:
                if st.request_mode != _DUPLEX:
                    # a gateway whose ext_proc filter sets max_message_timeout waits this long for the answer; one
                    # that does not ignores it, and its own message timeout bounds the wait
                    await context.write(wait_longer(self.hold_s))
                p = await answer
            except BaseException:
                self.cancel(p.held)
                if answer.done() and not answer.cancelled() and answer.result().reservation is not None:
                    # placed as the gateway left: nobody will end that response, so its reservation ends here
                    self.end(answer.result().reservation, None, None, None)
                raise
        if p.immediate is not None:
            return render(p.immediate)
        if p.unknown_model is not None:
            return render(model_not_found(p.unknown_model))
        if p.unserved_path is not None:
            return render(path_not_served(p.unserved_path))
        if not p.endpoints:
            return render(no_endpoint(st.subset is not None and (p.subset_empty or not st.subset)))
        st.reservation = p.reservation
        st.picked_at = self.clock()
        st.new_body = p.body
        if partial:  # the client's body passes as it comes (as on the header path: its own Content-Length)
            return destination_answer(p.endpoints, None, phase, p.dp_rank)
        sent = p.body if p.body is not None else body
        return destination_answer(p.endpoints, len(sent) if sent is not None and phase == "request_headers" else None,
                                  phase, p.dp_rank, p.body if phase == "request_body" else None)

    async def _step(self, st: _Stream, req: ep.ProcessingRequest, context) -> list[ep.ProcessingResponse]:
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            st.headers = headers_of(req.request_headers)
            st.subset = subset_of(req)
            if req.request_headers.end_of_stream:
                return [await self._decide(st, None, context)]
            if st.request_mode in _BUFFERED:
                return [_PASS[kind]]  # the decision rides on the body's answer
            if st.request_mode != _DUPLEX:  # STREAMED: Envoy waits for this answer before any body
                answer = await self._decide(st, None, context, arriving=True)
                self._unread(st)
                return [answer]
            if self.pick_at_headers is not None and self.arrived is not None:
                # a turn its headers decide is answered now; its body then passes through as it comes, unread
                p = self.pick_at_headers(st.headers, st.subset)
                if p is not None and p.endpoints:
                    st.answered = st.arriving = True
                    st.reservation, st.picked_at = p.reservation, self.clock()
                    self._unread(st)
                    return [destination_answer(p.endpoints, None, "request_headers", p.dp_rank)]
            if self.early_reach is not None and self.arrived is not None:
                st.early = self.early_reach(st.headers)
            return []  # full duplex: the answer waits for the body
        if kind == "request_body":
            chunk = req.request_body
            if st.request_mode in _BUFFERED:
                return [await self._decide(st, chunk.body, context,
                                           "request_body")] if not st.answered else [_PASS[kind]]
            if chunk.end_of_stream:
                self._body_ended(st)
            if st.request_mode != _DUPLEX:  # STREAMED: Envoy passes the chunk on as it is
                refused = self._refused(st, chunk.body)
                return [refused] if refused is not None else [_PASS[kind]]
            if st.answered:  # decided before its body ended: pass it on as it comes
                return self._pass(st, chunk.body, chunk.end_of_stream)
            st.body.append(chunk.body)
            st.size += len(chunk.body)
            self.buffered += len(chunk.body)
            if chunk.end_of_stream:
                body = self._drop_held(st)
                answer = await self._decide(st, body, context)
                if answer.HasField("immediate_response"):
                    return [answer]
                return [answer, *body_chunks(st.new_body if st.new_body is not None else body, True)]
            if st.early is not None and st.size >= st.early:
                head = self._drop_held(st)
                answer = await self._decide(st, head, context, arriving=True, partial=True)
                return [answer] if answer.HasField("immediate_response") else self._unread(st, answer, head)
            if st.size > self.body_max_bytes or self.buffered > self.buffered_max_bytes:
                answer = await self._decide(st, None, context, arriving=True)
                held = self._drop_held(st)
                if answer.HasField("immediate_response"):
                    return [answer]
                return self._unread(st, answer, held)
            return []
        if kind == "request_trailers":
            self._body_ended(st)
            out: list[ep.ProcessingResponse] = []
            if not st.answered:  # a body that ended in trailers: decide on what came
                body = self._drop_held(st)
                answer = await self._decide(st, body, context)
                if answer.HasField("immediate_response"):
                    return [answer]
                out += [answer, *body_chunks(st.new_body if st.new_body is not None else body, False)]
            return [*out, _PASS[kind]]
        if kind == "response_headers":
            h = headers_of(req.response_headers)
            code = h.get(":status", "")
            st.status = int(code) if code.isascii() and code.isdigit() and len(code) <= 3 else 0
            st.served = served_of(req) or st.served
            st.response_seen = True
            # a streamed completion's first body chunk is its first token; its headers come before it
            st.streamed = h.get("content-type", "").startswith("text/event-stream")
            if req.response_headers.end_of_stream:
                self._finish(st)
            return [_PASS[kind]]
        if kind == "response_body":
            chunk = req.response_body
            if not st.response_seen:  # Envoy sends metadata and attributes with the first message of a phase
                st.served = st.served or served_of(req)
                st.response_seen = True
            if st.streamed and st.first_byte_s is None and st.picked_at and chunk.body:
                st.first_byte_s = self.clock() - st.picked_at
            if chunk.end_of_stream:
                self._finish(st)
            if st.response_duplex:
                return [_streamed("response_body", chunk.body, chunk.end_of_stream)]
            return [_PASS[kind]]
        if kind == "response_trailers":
            self._finish(st)
            return [_PASS[kind]]
        return []

    def _unread(self, st: _Stream, answer: ep.ProcessingResponse | None = None,
                held: bytes = b"") -> list[ep.ProcessingResponse]:
        """A stream decided before its body ended: the answer, then what came so far, the rest to pass as it comes."""
        if self.connectors is not None and self.connectors():
            st.kv = KvTransferScan()
        if answer is None:
            return []
        passed = self._pass(st, held, False)
        return passed if passed and passed[0].HasField("immediate_response") else [answer, *passed]

    def _pass(self, st: _Stream, data: bytes, end: bool) -> list[ep.ProcessingResponse]:
        """Body bytes passed on unread, unless they carry a client's kv_transfer_params: then a 400, in place of the
        rest (the replica never reads a whole body, so never acts on them), and the pick's work given back."""
        refused = self._refused(st, data)
        return body_chunks(data, end) if refused is None else [refused]

    def _refused(self, st: _Stream, data: bytes) -> ep.ProcessingResponse | None:
        """A 400 when ``data``, read on from what passed before, completes a client's kv_transfer_params."""
        if st.kv is None or not st.kv.feed(data):
            return None
        if st.reservation is not None:
            self.end(st.reservation, None, None, None)
            st.reservation = None
        return render(in_api_shape(kv_transfer_not_allowed(), path_of(st.headers)))

    def _body_ended(self, st: _Stream) -> None:
        if st.arriving and st.reservation is not None:
            st.arriving = False
            self.arrived(st.reservation)

    def _finish(self, st: _Stream) -> None:
        if st.ended:
            return
        st.ended = True
        if st.reservation is not None:
            self.end(st.reservation, st.served, st.status in _FAULT_CODES, st.first_byte_s)


__all__ = ["EndpointPicker", "PickResult", "subset_of", "served_of", "destination_answer", "body_chunks"]
