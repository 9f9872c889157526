"""The HTTP filters warmroute puts before Envoy's router, and what the other routes switch off of them.

- ``early_header_mutation``: the connection manager drops client-sent copies of the headers only
  Envoy or the brain may set (routing, reservation, request id, tenant) before anything is routed;
- ``http_filters``: gzip request bodies inflated (and bounded by what they inflate to); the look before a large
  upload (flow control on); the model of a body too big for the brain, read by Envoy; ext_proc, which sends the
  brain one message per request (the buffered body, with the few request headers the brain reads as attributes);
  a buffer filter that holds the request headers back from the router until the brain has answered; a header
  mutation that turns the brain's answer (dynamic metadata) into the routing header, so the route is chosen from it;
- ``access_log``: the gRPC access-log entry that tells the brain each request's end and outcome;
- ``local_reply_config``: Envoy's own replies in the API's error shape.
"""

from __future__ import annotations

from typing import Any

from ..config import AppConfig, first_answer_s, max_message_s
from ..core.apis import KV_TRANSFER_FIELDS, KV_TRANSFER_KEY
from ..answers import DROPPED_REASON_HEADER
from ..core.profile import CONTENT_LENGTH, CREDENTIAL_HEADERS, TTFT_SLO_HEADERS, envoy_session_places
from ..contract import (
    ACCESS_LOG_NAME,
    ANSWER_CLUSTER,
    ANSWER_DP_RANK,
    ANSWER_RESERVATION,
    BODY_METADATA_NAMESPACE,
    SESSION_METADATA,
    BRAIN_CLUSTER,
    BRAIN_DOOR_CLUSTER,
    BRAIN_LOG_CLUSTER,
    CLIENT_FIRST_TOKEN_TAG,
    DECLARED_LENGTH_HEADER,
    DP_RANK_HEADER,
    EXT_PROC_FILTER,
    EXT_PROC_STAT_PREFIX,
    FIRST_TOKEN_TAG,
    HEADER_DOOR_PREFIX,
    HEADER_PATH_FILTER,
    HEADER_PATH_METADATA,
    HOLD_FILTER,
    INFLATED_FROM_HEADER,
    LOOK_BYTES,
    LOOK_METADATA,
    LOG_RECORD,
    LOG_TAG,
    LOOK_UPLOAD_HEADER,
    METADATA_NAMESPACE,
    PATH_ATTRIBUTE,
    REQUEST_ID_HEADER,
    RESERVATION_HEADER,
    ROUTE_FROM_BRAIN_FILTER,
    ROUTING_HEADER,
    TIME_ATTRIBUTE,
    header_attribute,
)
from ..contract import brain_headers as _brain_headers
from .clusters import door_sockets, log_door_sockets
from .common import dur


def brain_headers(cfg: AppConfig) -> list[str]:
    """The request headers this config's brain reads (see ``contract.brain_headers``)."""
    names = _brain_headers(cfg.router.profile.session_headers, cfg.router.profile.tenant_reads())
    # the credential scopes the ids clients choose for stored responses (hashed at once, never kept or logged)
    names += [h for h in CREDENTIAL_HEADERS if h not in names]
    if cfg.flow_control.enabled:
        names.append(cfg.flow_control.priority_header.lower())
    return names


def edge_headers_removed(cfg: AppConfig) -> list[str]:
    """Request headers only Envoy or the brain may set: what a client sends under these names is dropped
    before any route is matched or filter runs (a header filter would be too late: the route is matched
    on the client's headers at the first filter that asks for it, and stays cached unless the brain
    answers). The request id is Envoy's own, so a client cannot release another request's reservation; the
    data-parallel engine is the brain's to name (a client's would pass wherever the brain names none)."""
    names = [ROUTING_HEADER, RESERVATION_HEADER, REQUEST_ID_HEADER, DP_RANK_HEADER, INFLATED_FROM_HEADER,
             LOOK_UPLOAD_HEADER, DECLARED_LENGTH_HEADER]
    p = cfg.router.profile
    if p.tenant_source == "header" and p.tenant_header and not cfg.envoy.trust_downstream_tenant_header:
        names.append(p.tenant_header)
    f = cfg.flow_control
    if f.enabled and not f.trust_downstream_priority_header:
        names.append(f.priority_header)
    return names


def early_header_mutation(cfg: AppConfig) -> list[dict]:
    """The connection manager's ``early_header_mutation_extensions`` (see ``edge_headers_removed``)."""
    return [{
        "name": "envoy.http.early_header_mutation.header_mutation",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",  # noqa: E501 (a type URL)
            "mutations": [*({"remove": h} for h in edge_headers_removed(cfg)),
                          # the encoding the body came in, before the decompressor inflates it and drops the header
                          {"append": {"header": {"key": INFLATED_FROM_HEADER, "value": "%REQ(content-encoding)%"},
                                      "append_action": "OVERWRITE_IF_EXISTS_OR_ADD", "keep_empty_value": False}},
                          # the size the header path prices, for its door (ext_authz sends its own Content-Length)
                          *([{"append": {"header": {"key": DECLARED_LENGTH_HEADER, "value": "%REQ(content-length)%"},
                                         "append_action": "OVERWRITE_IF_EXISTS_OR_ADD", "keep_empty_value": False}}]
                            if door_sockets(cfg) is not None else [])],
        },
    }]


def ext_proc_filter(cfg: AppConfig, processing_mode: dict, **more: Any) -> dict:
    """The ext_proc filter to the brain, in either shape: ``processing_mode`` and the shape's ``more`` fields."""
    return {
        "name": EXT_PROC_FILTER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": BRAIN_CLUSTER}},
            "stat_prefix": EXT_PROC_STAT_PREFIX,
            # Brain down or slow: the request goes on without an answer, to the fallback route (in the
            # endpoint-picker shape: the override_host fallback policy; InferencePool failureMode FailOpen)
            "failure_mode_allow": True,
            # in the full-duplex picker shape the answer waits for the whole body: this bounds its upload too
            "message_timeout": dur(first_answer_s(cfg)),
            # flow control holds a request, and a disaggregated request waits for its prefill leg, by extending this
            # call's timer (override_message_timeout)
            **({"max_message_timeout": dur(max_message_s(cfg))} if max_message_s(cfg) is not None else {}),
            "processing_mode": processing_mode,
            **more,
        },
    }


SKIP_FILTER = {"action": {"name": "skip", "typed_config": {
    "@type": "type.googleapis.com/envoy.extensions.filters.common.matcher.action.v3.SkipFilter"}}}


def header_predicate(header: str, regex: str) -> dict:
    """An xDS matcher predicate: the request header is present and matches ``regex``."""
    return {"single_predicate": {
        "input": {"name": header, "typed_config": {
            "@type": "type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput", "header_name": header}},
        "value_match": {"safe_regex": {"google_re2": {}, "regex": regex}}}}


def greater_than_regex(n: int) -> str:
    """An RE2 regex of the decimal numbers greater than ``n`` (leading zeros allowed): a header matcher has no
    numeric comparison."""
    d = str(n)
    alts = [f"[1-9][0-9]{{{len(d)},}}"]  # more digits
    for i, c in enumerate(d):  # as many digits: the same up to i, then a larger digit, then anything
        if c != "9":
            rest = len(d) - i - 1
            alts.append(f"{d[:i]}[{int(c) + 1}-9]" + (f"[0-9]{{{rest}}}" if rest else ""))
    return "^0*(" + "|".join(alts) + ")$"


# ext_proc's processing mode that sends the request headers alone
HEADERS_ONLY = {"request_header_mode": "SEND", "response_header_mode": "SKIP", "request_body_mode": "NONE",
                "response_body_mode": "NONE", "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"}


def _any(predicates: list[dict]) -> dict:
    """An xDS predicate true when any of ``predicates`` is (an or_matcher takes two or more)."""
    return predicates[0] if len(predicates) == 1 else {"or_matcher": {"predicate": predicates}}


def _skipped_when(predicates: list[dict], extension: dict) -> dict:
    """``extension``, skipped for a request that matches any of ``predicates`` (on its headers as they are when the
    filter's turn comes: a header an earlier filter set counts)."""
    return {
        "name": extension["name"],
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.common.matching.v3.ExtensionWithMatcher",
            "extension_config": extension,
            "xds_matcher": {"matcher_list": {"matchers": [{"predicate": _any(predicates), "on_match": SKIP_FILTER}]}},
        },
    }


def extension_of(http_filter: dict) -> dict:
    """The typed_config of the filter itself, wrapped in a matcher or not."""
    tc = http_filter["typed_config"]
    return tc["extension_config"]["typed_config"] if "extension_config" in tc else tc


def _decided_at_headers(cfg: AppConfig) -> list[dict]:
    """A request the header path routed: the brain's routing header is there (a client's copy is gone at the edge)."""
    return [header_predicate(ROUTING_HEADER, ".+")] if cfg.envoy.header_path else []


def header_path_filter(cfg: AppConfig) -> dict:
    """``warmroute.header_path``: a request that names a session in a header and declares a size the brain reads is
    first asked about with its headers alone (issue 61). The brain answers a turn of a session under way with its route
    (header mutations: the routing header, the reservation), and the filters that would hold or send its body
    (the look, the body's ext_proc, the hold) skip it: its body streams to the replica unread. Otherwise the answer is
    to go on, and the body decides as before. Never held: flow control holds with the body.

    Asked through the brain's header door (ext_authz over HTTP) where Envoy reaches the brain by a Unix socket, else
    by an ext_proc call: the same question and answers, at a third of the brain's CPU (``door_filter``)."""
    e = cfg.envoy
    if door_sockets(cfg) is not None:
        call = door_filter(cfg)
    else:
        call = ext_proc_filter(cfg, dict(HEADERS_ONLY))
        call["typed_config"]["grpc_service"]["initial_metadata"] = [{"key": HEADER_PATH_METADATA[0],
                                                                     "value": HEADER_PATH_METADATA[1]}]
        call["typed_config"]["stat_prefix"] = HEADER_PATH_STAT_PREFIX
        call["typed_config"].pop("max_message_timeout", None)
        call["name"] = HEADER_PATH_FILTER
    sessions = [header_predicate(h.lower(), ".+") for h in cfg.router.profile.session_headers]
    return _skipped_when([
        {"not_matcher": _any(sessions)},
        {"not_matcher": header_predicate(CONTENT_LENGTH, ".+")},
        # larger than the brain reads is no matter (the body never reaches it); larger than Envoy buffers is Envoy's 413
        header_predicate(CONTENT_LENGTH, greater_than_regex(e.max_body_bytes)),
        header_predicate(INFLATED_FROM_HEADER, ".*"),
    ], call)


def door_headers(cfg: AppConfig) -> list[str]:
    """The request headers the header door is sent (ext_authz adds the method, path, host and authorization): what
    the brain reads to decide at the headers (session, tenant, request id, class, deadline, model header, size)."""
    names = [*brain_headers(cfg), *TTFT_SLO_HEADERS, DECLARED_LENGTH_HEADER]
    if cfg.router.profile.model_header:
        names.append(cfg.router.profile.model_header.lower())
    return list(dict.fromkeys(names))


def door_filter(cfg: AppConfig) -> dict:
    """The header path's call as an ext_authz request to the brain's header door (HTTP/1.1 on a Unix socket beside
    its gRPC one). Measured on this machine, do-nothing servers both: the gRPC stream costs ~0.7 ms of the server's
    CPU and ~1.3 ms p50 per request, the HTTP request ~0.2 ms and ~1.0 ms (docs/benchmarks.md). The answers map
    one to one: a route is a 200 whose routing and reservation headers Envoy adds to the request (and clears the
    route cache); "go on" a 200 with neither; the brain's own answer (a 429 in a burst) its status, JSON body and
    headers to the client. A door that is down, slow, or answers 5xx lets the request go on to the body path."""
    return {"name": HEADER_PATH_FILTER, "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthz",
        "http_service": {
            "server_uri": {"uri": "http://warmroute-brain", "cluster": BRAIN_DOOR_CLUSTER,
                           "timeout": dur(first_answer_s(cfg))},
            "path_prefix": HEADER_DOOR_PREFIX,
            "authorization_response": {
                "allowed_upstream_headers": {"patterns": [{"exact": h} for h in (ROUTING_HEADER, RESERVATION_HEADER,
                                                                                  DP_RANK_HEADER)]},
                "allowed_client_headers": {"patterns": [{"exact": h} for h in ("content-type", "retry-after",
                                                                                DROPPED_REASON_HEADER)]},
            },
        },
        "allowed_headers": {"patterns": [{"exact": h} for h in door_headers(cfg)]},
        "failure_mode_allow": True,
        "clear_route_cache": True,
        "transport_api_version": "V3",
        "stat_prefix": HEADER_PATH_STAT_PREFIX,
    }}


def _only_looked(cfg: AppConfig, extension: dict) -> dict:
    """``extension`` for the bodies the look is for alone: more than LOOK_BYTES that the brain will read (a bigger
    one takes the headers-only route) and Envoy will take (a body past its buffer limit, max_body_bytes, is Envoy's
    413; one that overran the limit while its look was out left the client without an answer, 1 run in 3)."""
    e = cfg.envoy
    return {
        "name": extension["name"],
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.common.matching.v3.ExtensionWithMatcher",
            "extension_config": extension,
            "xds_matcher": {"matcher_list": {"matchers": [{
                "predicate": {"or_matcher": {"predicate": [
                    {"not_matcher": header_predicate(CONTENT_LENGTH, greater_than_regex(LOOK_BYTES))},
                    header_predicate(CONTENT_LENGTH,
                                     greater_than_regex(min(e.brain_body_max_bytes, e.max_body_bytes))),
                    *_decided_at_headers(cfg),
                ]}},
                "on_match": SKIP_FILTER,
            }]}},
        },
    }


def look_filters(cfg: AppConfig) -> list[dict]:
    """``warmroute.look``: a large body's headers go to the brain before it reads the body (flow control on, issue
    43). The brain lets it come, or refuses a new session with 429 while it is behind a burst: 2,000 new sessions
    of 100 KB are seconds of reading for one process, which Envoy's timer would fail open into the engines, and
    behind which the turns of sessions under way would wait. A look costs the brain about a fifth of reading such
    a body.

    The look comes once Envoy holds the whole body (a buffer before it): a body the brain lets through is then on
    its way at once. Looked at on its headers alone, a declared size that never came counted as the brain's
    backlog: 8 held-open declarations of 2 MiB, renewed every 4.5 s, refused 60% of new sessions. The upload's
    own time travels with the look (``LOOK_UPLOAD_HEADER``), so that a slow upload does not read as a brain behind."""
    e = cfg.envoy
    look = ext_proc_filter(cfg, dict(HEADERS_ONLY), request_attributes=[TIME_ATTRIBUTE])
    look["typed_config"]["grpc_service"]["initial_metadata"] = [{"key": LOOK_METADATA[0], "value": LOOK_METADATA[1]}]
    look["typed_config"]["stat_prefix"] = LOOK_STAT_PREFIX
    look["typed_config"].pop("max_message_timeout", None)  # the brain answers a look at once, never holds it
    look["name"] = LOOK_FILTER
    return [
        _only_looked(cfg, {"name": LOOK_BUFFER_FILTER, "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
            "max_request_bytes": min(e.brain_body_max_bytes, e.max_body_bytes)}}),
        _only_looked(cfg, {"name": LOOK_UPLOAD_FILTER, "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [{"append": {
                # from the request's first byte to its last, read by Envoy: the whole body is here by now
                "header": {"key": LOOK_UPLOAD_HEADER, "value": "%REQUEST_DURATION%"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}}]}}}),
        _only_looked(cfg, look),
    ]


def http_filters(cfg: AppConfig) -> list[dict]:
    """The six filters to put before the router filter, in this order.

    One ext_proc message per request instead of two (headers, then body)
    halves the brain's gRPC work. The price is that ext_proc cannot mutate
    headers it did not send, so the brain answers with dynamic metadata and
    ``route_from_brain`` copies it into the routing header; ``hold_for_brain``
    keeps the router from choosing a route before that answer exists.
    Requests without a body (GET /v1/models, probes) never reach the brain:
    they carry no session or prompt, and take the fail-open route.
    """
    e = cfg.envoy
    return [
        {
            # A gzip body is inflated before the brain and the replica see it (vLLM reads no compressed body);
            # an inflated body past the buffer limit is Envoy's 413, so a decompression bomb costs nothing.
            "name": "warmroute.inflate_gzip_requests",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.decompressor.v3.Decompressor",
                "decompressor_library": {"name": "gzip", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.compression.gzip.decompressor.v3.Gzip",
                    # past it Envoy stops inflating and passes the body on cut off: the brain answers that 413
                    "max_inflate_ratio": e.max_inflate_ratio}},
                "request_direction_config": {"common_config": {"enabled": {
                    "default_value": True, "runtime_key": "warmroute.inflate_gzip_requests"}}},
                "response_direction_config": {"common_config": {"enabled": {
                    "default_value": False, "runtime_key": "warmroute.inflate_gzip_responses"}}},
            },
        },
        {
            # What a compressed upload inflates to, counted as it streams (nothing buffered): past the brain's body
            # limit Envoy answers 413 and resets the upload, so the decompressor inflates no more of it (Envoy's
            # buffer limit alone answered 413 but inflated all the rest of the upload: 62 MB for a 1 MB one)
            "name": INFLATED_LIMIT_FILTER,
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.common.matching.v3.ExtensionWithMatcher",
                "extension_config": {"name": "envoy.filters.http.body_size_limit", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.body_size_limit.v3.BodySizeLimit",
                    "max_request_bytes": e.brain_body_max_bytes}},
                # skipped for a request that came uncompressed (no inflated-from header): its limit is max_body_bytes
                "xds_matcher": {"matcher_list": {"matchers": [{
                    "predicate": {"not_matcher": header_predicate(INFLATED_FROM_HEADER, ".*")},
                    "on_match": SKIP_FILTER,
                }]}},
            },
        },
        *([header_path_filter(cfg)] if cfg.envoy.header_path else []),
        *(look_filters(cfg) if cfg.flow_control.enabled else []),
        {
            # A body too big to send to the brain is decided on its headers; its model (the top-level "model", read
            # as JSON by Envoy) travels with them as metadata, so it goes to a replica that serves it. It also holds
            # the headers until the whole body is here: a declaration held open charges nothing
            "name": BODY_MODEL_FILTER,
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.common.matching.v3.ExtensionWithMatcher",
                "extension_config": {"name": "envoy.filters.http.json_to_metadata", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.json_to_metadata.v3.JsonToMetadata",
                    "request_rules": {"rules": [{
                        "selectors": [{"key": "model"}],
                        "on_present": {"metadata_namespace": BODY_METADATA_NAMESPACE, "key": "model",
                                       "type": "STRING"},
                    }, *({
                        # a client's own kv_transfer_params in a body the brain does not read: flagged, answered 400
                        # by the brain. The filter reads primitive values only (an object's presence cannot be
                        # selected, and an on_present ``value`` is set whether the key is there or not): the
                        # fields a P/D connector acts on are selected instead
                        "selectors": [{"key": KV_TRANSFER_KEY}, {"key": field}],
                        "on_present": {"metadata_namespace": BODY_METADATA_NAMESPACE, "key": KV_TRANSFER_KEY,
                                       "type": "STRING"},
                    } for field in KV_TRANSFER_FIELDS), *({
                        # its session, where the body names one (Claude Code's metadata.user_id, a conversation_id):
                        # a turn too big for the brain stays with its session, as a parsed one does
                        "selectors": [{"key": k} for k in path],
                        "on_present": {"metadata_namespace": BODY_METADATA_NAMESPACE, "key": SESSION_METADATA + place,
                                       "type": "STRING"},
                    } for place, path in dict.fromkeys((p, k) for p, k, _ in envoy_session_places(
                        cfg.router.profile.session_body_fields)))]},
                }},
                # only for what the brain will not read itself: a Content-Length above brain_body_max_bytes, or
                # none (chunked). A body the brain reads whole is not parsed twice
                # (an inflated upload has no Content-Length once inflated, and is bounded at the brain's limit)
                "xds_matcher": {"matcher_list": {"matchers": [{
                    "predicate": {"or_matcher": {"predicate": [
                        {"and_matcher": {"predicate": [
                            header_predicate(CONTENT_LENGTH, ".*"),
                            {"not_matcher": header_predicate(CONTENT_LENGTH,
                                                              greater_than_regex(e.brain_body_max_bytes))},
                        ]}},
                        header_predicate(INFLATED_FROM_HEADER, ".*"),
                        *_decided_at_headers(cfg),  # routed: nothing to read, nothing to hold
                    ]}},
                    "on_match": SKIP_FILTER,
                }]}},
            },
        },
        _decided_by_body(cfg, ext_proc_filter(cfg, {
            "request_header_mode": "SKIP",
            "response_header_mode": "SKIP",
            "request_body_mode": "BUFFERED",
            "response_body_mode": "NONE",
            "request_trailer_mode": "SKIP",
            "response_trailer_mode": "SKIP",
        }, request_attributes=[header_attribute(h) for h in brain_headers(cfg)] + [PATH_ATTRIBUTE],
            metadata_options={"receiving_namespaces": {"untyped": [METADATA_NAMESPACE]},
                              "forwarding_namespaces": {"untyped": [BODY_METADATA_NAMESPACE]}})),
        _decided_by_body(cfg, {
            # Holds the request headers until the whole body has passed ext_proc: without it the router
            # picks a route as soon as the headers arrive, before the brain has said anything.
            "name": HOLD_FILTER,
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
                "max_request_bytes": e.max_body_bytes,
            },
        }),
        {
            # Runs after the brain's answer; the mutation happens before this filter looks up its route
            # config, so the route is computed with the header in place (ext_proc cleared the cache).
            # No answer (brain down, no body): no metadata, empty value, no header, fail-open route.
            "name": ROUTE_FROM_BRAIN_FILTER,
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
                "mutations": {"request_mutations": [
                    *({"append": {"header": {"key": header,
                                             "value": f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:{field})%"},
                                  "append_action": "ADD_IF_ABSENT", "keep_empty_value": False}}
                      for header, field in ((ROUTING_HEADER, ANSWER_CLUSTER), (RESERVATION_HEADER,
                                                                               ANSWER_RESERVATION))),
                    {"remove": LOOK_UPLOAD_HEADER},  # the look's, not the replica's
                    # the data-parallel engine the brain priced, when it chose one: its header replaces a client's
                    {"append": {"header": {"key": DP_RANK_HEADER,
                                           "value": f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:{ANSWER_DP_RANK})%"},
                                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD", "keep_empty_value": False}},
                ]},
            },
        },
    ]


def _decided_by_body(cfg: AppConfig, extension: dict) -> dict:
    """``extension`` (the body's call, the hold), skipped for a request the header path already routed."""
    return _skipped_when(_decided_at_headers(cfg), extension) if cfg.envoy.header_path else extension


def access_log(cfg: AppConfig) -> list[dict]:
    """Each request's end (and, every ``access_log_periodic_s``, each one in flight) logged to the brain: to its log
    door where Envoy reaches it by a Unix socket (Envoy's fluentd logger: ``brain.log_door``), else over gRPC."""
    flush = dur(cfg.envoy.access_log_flush_s)
    if log_door_sockets(cfg) is not None:
        return [{
            "name": "envoy.access_loggers.fluentd",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.fluentd.v3.FluentdAccessLogConfig",
                "cluster": BRAIN_LOG_CLUSTER,
                "tag": LOG_TAG,
                "stat_prefix": "warmroute_log",
                # each entry releases a reservation: flushed every access_log_flush_s (10 ms); past the buffer's
                # size entries are dropped (entries_lost), each a reservation open until its timeout
                "buffer_flush_interval": flush,
                "buffer_size_bytes": 1024 * 1024,
                # a brain restarting: reconnect soon (entries wait in the buffer meanwhile), never give up
                "retry_options": {"backoff_options": {"base_interval": "0.05s", "max_interval": "1s"}},
                "record": LOG_RECORD,
            },
        }]
    return [
        {
            "name": "envoy.access_loggers.http_grpc",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
                "common_config": {
                    "log_name": ACCESS_LOG_NAME,
                    "transport_api_version": "V3",
                    "grpc_service": {"envoy_grpc": {"cluster_name": BRAIN_LOG_CLUSTER}},
                    # each entry releases a reservation: flushed every access_log_flush_s (10 ms). The buffer is also
                    # the most Envoy holds while its stream is not writable: at 1 byte, every entry logged while one
                    # flush waited was dropped (logs_dropped), each a reservation open for an hour
                    "buffer_flush_interval": flush,
                    "buffer_size_bytes": 1024 * 1024,
                    # what the engine took to its first token, joined with the brain's prediction of it
                    "custom_tags": [{"tag": FIRST_TOKEN_TAG, "value": LOG_RECORD["ft"]},
                                    {"tag": CLIENT_FIRST_TOKEN_TAG, "value": LOG_RECORD["cft"]}],
                },
                "additional_request_headers_to_log": [RESERVATION_HEADER, ROUTING_HEADER],
                # a 200 that is an HTML page is a replica (or a proxy in front of it) gone wrong
                "additional_response_headers_to_log": ["content-type"],
            },
        }
    ]


def hcm_access_log_options(cfg: AppConfig) -> dict:
    """The connection manager logs each request in flight every ``access_log_periodic_s``: the brain keeps
    the reservations Envoy names and releases those no entry names (a lost or rogue ext_proc call)."""
    if not cfg.envoy.access_log_periodic_s:
        return {}
    return {"access_log_options": {"access_log_flush_interval": dur(cfg.envoy.access_log_periodic_s)}}


def local_reply_config() -> dict:
    """Envoy's own replies (413, 431, 503 no healthy upstream, 504 ...) in the OpenAI error shape the rest of
    the API uses, with the status and a machine-readable code (Envoy's response code details); the JSON
    answers warmroute already shapes (the 404 of paths not served, the brain's no_healthy_instances) pass
    through as they are."""
    return {
        "mappers": [{
            "filter": {"extension_filter": {
                "name": "envoy.access_loggers.extension_filters.cel",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",  # noqa: E501 (a type URL)
                                 # ext_authz_denied: the header door's own answers (a 429), as the brain wrote them
                                 "expression": "response.code_details == 'direct_response' || "
                                               "response.code_details == 'ext_authz_denied' || "
                                               "response.code_details.startsWith('warmroute_')"}}},
            "body_format_override": {"text_format": "%LOCAL_REPLY_BODY%", "content_type": "application/json"},
        }],
        "body_format": {"json_format": {"error": {
            "message": "%LOCAL_REPLY_BODY%",
            "type": "envoy_local_reply",
            "code": "%RESPONSE_CODE_DETAILS%",
            "status": "%RESPONSE_CODE%",
        }}},
    }


INFLATED_LIMIT_FILTER = "warmroute.inflated_body_limit"


LOOK_FILTER = "warmroute.look"


HEADER_PATH_STAT_PREFIX = "warmroute_headers"  # http.<hcm>.ext_proc.warmroute_headers.*


LOOK_BUFFER_FILTER = "warmroute.look_whole_body"  # the look comes once Envoy holds the body


LOOK_UPLOAD_FILTER = "warmroute.look_upload_time"


LOOK_STAT_PREFIX = "warmroute_look"  # http.<hcm>.ext_proc.warmroute_look.*




BODY_MODEL_FILTER = "warmroute.big_body_model"


def big_body_ext_proc() -> dict:
    """``typed_per_filter_config`` of the big-body and models routes: ext_proc sends the headers, not the body."""
    return {
        EXT_PROC_FILTER: {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
            "overrides": {"processing_mode": dict(HEADERS_ONLY)},
        },
    }


def ext_proc_off_for_route(cfg: AppConfig) -> dict:
    """``typed_per_filter_config`` for a user's other routes, so the brain sees only model traffic
    and their bodies are not held back (``cfg``: the header path's filter, when it asks through the door)."""
    door = door_sockets(cfg) is not None
    return {
        EXT_PROC_FILTER: {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
            "disabled": True,
        },
        **{name: {"@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                  "disabled": True} for name in (LOOK_FILTER, *(() if door else (HEADER_PATH_FILTER,)))},
        **({HEADER_PATH_FILTER: {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthzPerRoute",
            "disabled": True}} if door else {}),
        HOLD_FILTER: {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.BufferPerRoute",
            "disabled": True,
        },
        **{name: {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "disabled": True}
           for name in (LOOK_BUFFER_FILTER, LOOK_UPLOAD_FILTER)},
    }
