"""What the brain answers a request, in no front's words: placed on a replica, held for later, or answered by the
brain itself. Each front renders these in its own protocol (``brain/decide.py``: Envoy's ext_proc behind the rendered
Envoy; ``picker/front.py``: the Gateway API Inference Extension's endpoint picker), so the brain imports no Envoy
protobuf and the two fronts cannot drift in what they answer.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Callable, Collection

from .core.apis import Api, anthropic_error_body, api_of, response_not_found_body
from .core.models import not_found_body, path_not_served_body
from .core.names import Reason

OK, BAD_REQUEST, NOT_FOUND, PAYLOAD_TOO_LARGE, UNSUPPORTED_MEDIA_TYPE = 200, 400, 404, 413, 415
TOO_MANY_REQUESTS, SERVICE_UNAVAILABLE = 429, 503
# the reason header a gateway configured for llm-d's flow control already reads
DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"


@dataclass(frozen=True, slots=True)
class Placed:
    """Routed to a replica: its name (the rendered Envoy's cluster), the reservation id Envoy logs back, the
    data-parallel engine to steer to (or None), and the body to send instead of the client's (or None)."""

    replica: str
    reservation: str
    dp_rank: int | None = None
    body: bytes | None = None


@dataclass(frozen=True, slots=True)
class Held:
    """Flow control holds the request: its answer comes later (``Brain.let_go``), the call stays open."""

    key: object


@dataclass(frozen=True, slots=True)
class Answered:
    """The brain answers the request itself: a status, a JSON body, Envoy's response details, more headers."""

    status: int
    doc: dict
    details: str
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def body(self) -> bytes:
        return json.dumps(self.doc).encode()


def error(status: int, message: str, kind: str, code: str, details: str, retry_after_s: int | None = None,
          path: str = "") -> Answered:
    """An error in OpenAI's shape (what clients of vLLM already parse); on the Messages paths in Anthropic's, as vLLM
    answers there."""
    doc = {"error": {"message": message, "type": kind, "code": code}}
    headers = (("retry-after", str(retry_after_s)),) if retry_after_s is not None else ()
    return in_api_shape(Answered(status, doc, details, headers), path)


def in_api_shape(a: Answered, path: str) -> Answered:
    """An error re-written in the shape of the path's API (Anthropic's on the Messages paths)."""
    if api_of(path) is not Api.MESSAGES or not isinstance(a.doc.get("error"), dict):
        return a
    return Answered(a.status, anthropic_error_body(a.doc), a.details, a.headers)


_REFUSED_WHY = {
    "waited_too_long": "every replica is saturated; retry after the time given",
    "queue_full": "the queue of requests waiting for a replica is full",
    "deadline_unmeetable": "every replica is saturated: the first token would come after the request's deadline "
                           "(x-warmroute-ttft-slo-ms, or its class's); retry after the time given",
    "router_behind": "the router is behind a burst of new requests: this body would wait to be read longer than the "
                     "sessions under way can afford; retry after the time given",
    "tenant_over_cap": "this tenant has used its tokens for now (flow_control.tenant_tokens_per_minute); retry after "
                       "the time given",
}


def too_many(why: str, retry_after_s: int, path: str = "") -> Answered:
    """Flow control refuses the request: 429 with Retry-After and the reason (also in llm-d's header). One object per
    reason, wait and API shape (never changed by anyone): a flood's refusals are rendered once (``rendered``)."""
    return _too_many(why, retry_after_s, api_of(path) is Api.MESSAGES)


@functools.lru_cache(maxsize=1024)
def _too_many(why: str, retry_after_s: int, messages: bool) -> Answered:
    a = error(TOO_MANY_REQUESTS, _REFUSED_WHY.get(why, _REFUSED_WHY["queue_full"]), "rate_limit_error", why,
              f"warmroute_flow_{why}", retry_after_s, "/v1/messages" if messages else "")
    return Answered(a.status, a.doc, a.details, (*a.headers, (DROPPED_REASON_HEADER, why)))


def no_healthy() -> Answered:
    """B: an immediate 503 with an OpenAI-style error and Retry-After, never a hang."""
    return error(SERVICE_UNAVAILABLE, "no healthy vLLM replica is available; retry shortly", "service_unavailable",
                 "no_healthy_instances", "warmroute_no_healthy_instances", 5)


def model_not_found(model: str, valid: Collection[str] = ()) -> Answered:
    """No replica serves the body's model: 404 as vLLM itself answers it, naming the models served."""
    return Answered(NOT_FOUND, not_found_body(model, valid), "warmroute_model_not_found")


def path_not_served(path: str) -> Answered:
    """Replicas serve the model but none the path's API (an embedding model asked for chat): 404, never a replica
    that would refuse it."""
    return Answered(NOT_FOUND, path_not_served_body(path), "warmroute_path_not_served")


def models(listed: list[dict]) -> Answered:
    """GET /v1/models through Envoy: every model the fleet serves (and the aliases), as vLLM lists its own."""
    return Answered(OK, {"object": "list", "data": listed}, "warmroute_models")


def kv_transfer_not_allowed() -> Answered:
    """A client's own kv_transfer_params (only the brain's prefill leg may say where an engine's KV comes from)."""
    return error(BAD_REQUEST, "kv_transfer_params is set by the router, not by clients", "invalid_request_error",
                 "kv_transfer_params_not_allowed", "warmroute_kv_transfer_params_not_allowed")


def immediate(reason: Reason, path: str, *, model: str, served: Callable[[], list[str]], inflate_ratio: int,
              response_id: str) -> Answered | None:
    """The brain's own answer to a request no replica is asked for (None: one is), in the error shape of the path's
    API."""
    if reason == Reason.UNKNOWN_MODEL:
        out = model_not_found(model, served())
    elif reason == Reason.UNSERVED_PATH:
        out = path_not_served(path)
    elif reason == Reason.INFLATE_LIMIT:
        out = error(PAYLOAD_TOO_LARGE, f"the compressed request body inflates past {inflate_ratio} times its size "
                    "(envoy.max_inflate_ratio) or is not JSON once inflated; send it uncompressed",
                    "invalid_request_error", "body_inflates_too_far", "warmroute_body_inflates_too_far")
    elif reason == Reason.UNSUPPORTED_ENCODING:
        # a body in a Content-Encoding the fleet does not inflate (deflate, br, zstd, or gzip not applied last)
        out = error(UNSUPPORTED_MEDIA_TYPE, "the request body's Content-Encoding is not one this server reads: send it "
                    "uncompressed, or gzip alone", "invalid_request_error", "unsupported_content_encoding",
                    "warmroute_unsupported_content_encoding")
    elif reason == Reason.CLIENT_KV_TRANSFER:
        out = kv_transfer_not_allowed()
    elif reason == Reason.RESPONSE_GONE:
        out = Answered(NOT_FOUND, response_not_found_body(response_id), "warmroute_stored_response_gone")
    elif reason == Reason.NO_HEALTHY:
        out = no_healthy()
    else:
        return None
    return in_api_shape(out, path)


__all__ = ["Answered", "Held", "Placed", "error", "immediate", "in_api_shape", "kv_transfer_not_allowed",
           "model_not_found", "models",
           "no_healthy", "path_not_served", "too_many"]
