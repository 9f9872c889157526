"""ext_proc message pieces both fronts build and read."""

from __future__ import annotations

import json
from typing import Collection

from envoy.config.core.v3 import base_pb2
from google.protobuf.duration_pb2 import Duration
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2

from ..core.apis import anthropic_error_body
from ..core.models import not_found_body, path_not_served_body


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


def json_response(status: int, doc: dict, details: str) -> ep.ProcessingResponse:
    """An immediate answer with a JSON body."""
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), headers=ep.HeaderMutation(
            set_headers=[header_value("content-type", "application/json")]),
        body=json.dumps(doc).encode(), details=details))


def model_not_found_response(model: str, valid: Collection[str] = ()) -> ep.ProcessingResponse:
    """No replica serves the body's model: 404 as vLLM itself answers it, naming the models served."""
    return json_response(http_status_pb2.NotFound, not_found_body(model, valid), "warmroute_model_not_found")


def path_not_served_response(path: str) -> ep.ProcessingResponse:
    """Replicas serve the model but none the path's API (an embedding model asked for chat): 404, never a replica
    that would refuse it."""
    return json_response(http_status_pb2.NotFound, path_not_served_body(path), "warmroute_path_not_served")


def openai_error(status: int, message: str, kind: str, code: str, details: str,
                 retry_after_s: int | None = None) -> ep.ProcessingResponse:
    """An immediate answer in OpenAI's error shape (what clients of vLLM already parse)."""
    body = json.dumps({"error": {"message": message, "type": kind, "code": code}}).encode()
    headers = [header_value("content-type", "application/json")]
    if retry_after_s is not None:
        headers.append(header_value("retry-after", str(retry_after_s)))
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), headers=ep.HeaderMutation(set_headers=headers),
        body=body, details=details))


def anthropic_shaped(answer: ep.ProcessingResponse) -> ep.ProcessingResponse:
    """An immediate answer in OpenAI's error shape re-written in Anthropic's, status and headers kept."""
    out = ep.ProcessingResponse()
    out.CopyFrom(answer)
    try:
        doc = json.loads(out.immediate_response.body)
    except ValueError:
        return answer
    out.immediate_response.body = json.dumps(anthropic_error_body(doc)).encode()
    return out


def path_of(headers: dict[str, str]) -> str:
    """The request's path without its query (Envoy's ``request.url_path`` attribute, or the ``:path`` header)."""
    return headers.get(":path", "").split("?", 1)[0]
