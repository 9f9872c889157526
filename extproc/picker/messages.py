"""ext_proc message pieces both fronts build and read."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from google.protobuf.duration_pb2 import Duration
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2

from ..answers import Answered


def header_value(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def headers_of(msg: ep.HttpHeaders) -> dict[str, str]:
    out = {}
    for h in msg.headers.headers:
        out[h.key] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def wait_longer(seconds: float) -> ep.ProcessingResponse:
    """Flow control holds the request: Envoy's message timer for this call, extended to ``seconds`` (within the
    filter's max_message_timeout; a filter without one ignores it), so that Envoy neither fails open nor gives up."""
    return ep.ProcessingResponse(override_message_timeout=Duration(seconds=int(seconds),
                                                                   nanos=int(seconds % 1 * 1e9)))


def render(a: Answered) -> ep.ProcessingResponse:
    """The brain's own answer as Envoy's immediate response."""
    headers = [header_value("content-type", "application/json"), *(header_value(k, v) for k, v in a.headers)]
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=a.status), headers=ep.HeaderMutation(set_headers=headers),
        body=a.body, details=a.details))


def path_of(headers: dict[str, str]) -> str:
    """The request's path without its query (Envoy's ``request.url_path`` attribute, or the ``:path`` header)."""
    return headers.get(":path", "").split("?", 1)[0]
