"""The names both sides of the wire use: Envoy's rendered config and the brain import them from here.

Change a name here and both sides change together; nothing else spells them.
"""

from __future__ import annotations

from typing import Iterable

ROUTING_HEADER = "x-warmroute-cluster"  # the replica's cluster, set from the brain's answer; the route reads it
RESERVATION_HEADER = "x-warmroute-reservation"  # "<number>.<64 random bits>", logged back to the brain
# gRPC metadata of the ext_proc calls Envoy makes to look at a large body's headers before it reads the body (issue 43)
LOOK_METADATA = ("x-warmroute-look", "1")
# gRPC metadata of the ext_proc calls Envoy makes with a request's headers alone, before its body, when they may decide
# it (the header path, issue 61)
HEADER_PATH_METADATA = ("x-warmroute-headers", "1")
# The header path's other door: where Envoy reaches the brain by a Unix socket, it asks at the headers over plain HTTP
# (ext_authz) on a socket beside it: a gRPC stream per request cost the brain ~0.7 ms of CPU, an HTTP request ~0.2 ms
HEADER_DOOR_PREFIX = "/warmroute-headers"  # the door's paths: this, then the request's own path
DOOR_READY_PATH = "/warmroute-ready"  # Envoy's health check of the door: never a header call's path
# the request's Content-Length, copied at the edge: ext_authz sends the door its own (0) in its place
DECLARED_LENGTH_HEADER = "x-warmroute-declared-length"
BRAIN_DOOR_CLUSTER = "warmroute_brain_headers"  # Envoy's cluster for the brain's header door
SOCKET_PATH_MAX = 107  # bytes in a Unix socket's path (sun_path, less its NUL)
REQUEST_ID_HEADER = "x-request-id"  # Envoy's request id: backs up release when our header never got applied
CONTENT_ENCODING_HEADER = "content-encoding"  # a body Envoy did not inflate is counted, and routed by headers
# what the client's content-encoding was, set at the edge before Envoy inflates the body (and drops that header): an
# inflated body that does not read is one cut off at envoy.max_inflate_ratio, answered 413
INFLATED_FROM_HEADER = "x-warmroute-inflated-from"
METADATA_NAMESPACE = "warmroute"  # the brain's answer {cluster, reservation} travels as dynamic metadata here
# a body too big to send to the brain: Envoy reads its top-level "model" into this namespace and forwards it
BODY_METADATA_NAMESPACE = "warmroute.body"
# its keys for the session fields Envoy reads from such a body (json_to_metadata): this prefix and the field's place
SESSION_METADATA = "session:"
ANSWER_CLUSTER = "cluster"
ANSWER_RESERVATION = "reservation"
ANSWER_DP_RANK = "dp_rank"  # the data-parallel engine chosen, when the replica has several (empty: none)
# vLLM (0.10+) and SGLang send a request to the data-parallel engine this header names
DP_RANK_HEADER = "x-data-parallel-rank"
BRAIN_CLUSTER = "warmroute_brain"  # Envoy's cluster for the brain's gRPC services
# the same brain, its own connection, for the access log only: bodies on the ext_proc connection filled its write
# buffer, and Envoy dropped the access-log entries that release reservations (logs_dropped)
BRAIN_LOG_CLUSTER = "warmroute_brain_log"
FALLBACK_CLUSTER = "warmroute_fallback"  # where requests go when the brain does not answer
EXT_PROC_STAT_PREFIX = "warmroute"  # Envoy's ext_proc stats: http.<hcm>.ext_proc.warmroute.*
HOLD_FILTER = "warmroute.hold_for_brain"
HEADER_PATH_FILTER = "warmroute.header_path"
ROUTE_FROM_BRAIN_FILTER = "warmroute.route_from_brain"
ACCESS_LOG_NAME = "warmroute"
# access-log custom tags (microseconds, "-" when Envoy has no such time): from the request's last byte sent upstream,
# and from its first byte received, to the first byte of the response body: on a streamed completion the first token
# (the response headers come before it, so Envoy's time_to_first_upstream_rx_byte is not)
FIRST_TOKEN_TAG = "warmroute_first_token_us"
CLIENT_FIRST_TOKEN_TAG = "warmroute_client_first_token_us"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
RESERVED_NAME_PREFIX = "warmroute_"  # replica names may not start with it: the clusters above use it


def brain_headers(session_headers: Iterable[str], tenant_header: str | None) -> list[str]:
    """The request headers Envoy must send the brain: session keys, tenant, request id, content encoding."""
    names = [*session_headers, *([tenant_header] if tenant_header else []), REQUEST_ID_HEADER, CONTENT_ENCODING_HEADER,
             INFLATED_FROM_HEADER]
    return list(dict.fromkeys(h.lower() for h in names))


def _sibling(grpc_socket: str, name: str) -> str | None:
    head, dot, ext = grpc_socket.rpartition(".")
    door = f"{head}.{name}.{ext}" if dot and "/" not in ext else f"{grpc_socket}.{name}"
    return door if len(door.encode()) <= SOCKET_PATH_MAX else None


def header_door_socket(grpc_socket: str) -> str | None:
    """The header door's socket beside the brain's gRPC socket (``brain.sock`` -> ``brain.headers.sock``); None when
    that path would be too long for a socket (the header path then stays on gRPC)."""
    return _sibling(grpc_socket, "headers")


def log_door_socket(grpc_socket: str) -> str | None:
    """The log door's socket beside the brain's gRPC socket (``brain.sock`` -> ``brain.log.sock``); None when that
    path would be too long for a socket (the access log then stays on gRPC)."""
    return _sibling(grpc_socket, "log")


# The log door's record (Envoy's fluentd access logger, ``envoy_config.filters.access_log``): field -> Envoy's
# formatter. Short names: every request's entry carries them. Read by ``brain.log_door.entry_of_record``
LOG_RECORD = {
    "t": "%ACCESS_LOG_TYPE%",
    "res": f"%REQ({RESERVATION_HEADER})%",
    "rid": f"%REQ({REQUEST_ID_HEADER})%",
    "up": "%UPSTREAM_REMOTE_ADDRESS%",
    "n": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
    "code": "%RESPONSE_CODE%",
    "det": "%RESPONSE_CODE_DETAILS%",
    "fl": "%RESPONSE_FLAGS%",
    "ct": "%RESP(content-type)%",
    "ft": "%COMMON_DURATION(US_TX_END:US_RX_BODY_BEG:us)%",  # FIRST_TOKEN_TAG's
    "cft": "%COMMON_DURATION(DS_RX_BEG:US_RX_BODY_BEG:us)%",  # CLIENT_FIRST_TOKEN_TAG's
    "uft": "%COMMON_DURATION(DS_RX_BEG:US_RX_BEG:us)%",  # the gRPC entry's time_to_first_upstream_rx_byte
}
LOG_TAG = "warmroute"


def header_attribute(name: str) -> str:
    """The CEL expression with which ext_proc sends one request header along with the body."""
    return f"request.headers['{name}']"


_ATTR_PREFIX, _ATTR_SUFFIX = "request.headers['", "']"
# the request's path without its query, sent beside the headers: the brain routes by the path's API too
PATH_ATTRIBUTE = "request.url_path"
TIME_ATTRIBUTE = "request.time"  # when Envoy had the request's first byte: how late the brain reads its look
# the milliseconds a looked-at body took to reach Envoy (its upload), set by Envoy just before the look: the look's
# lateness is counted from its last byte, not its first (a slow upload is not the brain being behind)
LOOK_UPLOAD_HEADER = "x-warmroute-upload-ms"
LOOK_BYTES = 64 * 1024  # ~16K tokens; below it a body is read without a look (a look costs what ~12 KB of body does)


def header_of_attribute(key: str) -> str | None:
    """Inverse of ``header_attribute``: the header name, or None for any other attribute."""
    if key.startswith(_ATTR_PREFIX) and key.endswith(_ATTR_SUFFIX):
        return key[len(_ATTR_PREFIX):-len(_ATTR_SUFFIX)].lower()
    return ":path" if key == PATH_ATTRIBUTE else None


# The Gateway API Inference Extension's endpoint-picker protocol (GIE docs/proposals/004, v1)
DESTINATION_HEADER = "x-gateway-destination-endpoint"  # "ip:port[,ip:port...]": the pick, then the retry order
DESTINATION_NAMESPACE = "envoy.lb"  # the same value under this dynamic-metadata namespace
DESTINATION_SERVED_KEY = "x-gateway-destination-endpoint-served"  # envoy.lb: the endpoint that answered
SUBSET_NAMESPACE = "envoy.lb.subset_hint"  # the gateway's filter metadata: pick only among these
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
PICKER_BODY_CHUNK = 62_000  # the body goes back to the gateway in chunks of at most this many bytes
PICKER_CLUSTER = "warmroute_pool"  # the rendered picker-shape Envoy's one cluster of every replica
