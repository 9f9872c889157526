"""Render Envoy's bootstrap from the same config the brain reads, so the two never disagree.

The bootstrap is assembled from pieces that also ship alone (``snippets``)
for users who already run Envoy:

- ``early_header_mutation``: the connection manager drops client-sent copies of the headers only
  Envoy or the brain may set (routing, reservation, request id, tenant) before anything is routed;
- ``http_filters``: gzip request bodies inflated; ext_proc, which
  sends the brain one message per request (the buffered body, with the few
  request headers the brain reads as attributes); a buffer filter that holds
  the request headers back from the router until the brain has answered; a
  header mutation that turns the brain's answer (dynamic metadata) into the
  routing header, so the route is chosen from it;
- ``access_log``: the gRPC access-log entry that tells the brain each request's end and outcome;
- ``routes``: "route by the brain's header" / "fail open to the bounded ring hash", both only on the
  paths of ``envoy.allowed_paths``, and a 404 for every other path;
- ``brain_cluster`` and one ``replica_cluster`` per replica.

Each replica cluster has the replica itself at priority 0 and the other
replicas at priority 1. Envoy sends everything to priority 0 (no active
health checks mark it down); a retry after a refused connection or a reset
before any response byte skips the priority already tried, so it lands on
another replica. Per-replica stats stay ``cluster.<replica>.upstream_rq_total``.
"""

from __future__ import annotations

import ipaddress
import os
import re
from typing import Any

import yaml

from ..config import AppConfig, ReplicaSpec, brain_calls_max, first_answer_s
from ..core.profile import CONTENT_LENGTH
from ..contract import (
    ACCESS_LOG_NAME,
    ANSWER_CLUSTER,
    ANSWER_DP_RANK,
    ANSWER_RESERVATION,
    BRAIN_CLUSTER,
    BRAIN_LOG_CLUSTER,
    DP_RANK_HEADER,
    INFLATED_FROM_HEADER,
    BODY_METADATA_NAMESPACE,
    EXT_PROC_FILTER,
    EXT_PROC_STAT_PREFIX,
    LOOK_METADATA,
    TIME_ATTRIBUTE,
    FALLBACK_CLUSTER,
    HOLD_FILTER,
    METADATA_NAMESPACE,
    PATH_ATTRIBUTE,
    RESERVATION_HEADER,
    RESERVED_NAME_PREFIX,
    REQUEST_ID_HEADER,
    ROUTE_FROM_BRAIN_FILTER,
    ROUTING_HEADER,
    header_attribute,
)
from ..contract import brain_headers as _brain_headers

_BIG = 1_000_000  # circuit-breaker ceilings: LLM requests are long, Envoy's 1024 defaults are not for them


def _dur(seconds: float) -> str:
    return f"{seconds:.3f}s"


def _address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _thresholds(max_requests: int = _BIG) -> dict:
    return {
        "thresholds": [
            {"priority": p, "max_connections": _BIG, "max_pending_requests": _BIG, "max_requests": max_requests,
             "max_retries": _BIG} for p in ("DEFAULT", "HIGH")
        ]
    }


def brain_headers(cfg: AppConfig) -> list[str]:
    """The request headers this config's brain reads (see ``contract.brain_headers``)."""
    names = _brain_headers(cfg.router.profile.session_headers, cfg.router.profile.tenant_reads())
    if cfg.flow_control.enabled:
        names.append(cfg.flow_control.priority_header.lower())
    return names


def edge_headers_removed(cfg: AppConfig) -> list[str]:
    """Request headers only Envoy or the brain may set: what a client sends under these names is dropped
    before any route is matched or filter runs (a header filter would be too late: the route is matched
    on the client's headers at the first filter that asks for it, and stays cached unless the brain
    answers). The request id is Envoy's own, so a client cannot release another request's reservation; the
    data-parallel engine is the brain's to name (a client's would pass wherever the brain names none)."""
    names = [ROUTING_HEADER, RESERVATION_HEADER, REQUEST_ID_HEADER, DP_RANK_HEADER, INFLATED_FROM_HEADER]
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
            "@type": "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
            "mutations": [*({"remove": h} for h in edge_headers_removed(cfg)),
                          # the encoding the body came in, before the decompressor inflates it and drops the header
                          {"append": {"header": {"key": INFLATED_FROM_HEADER, "value": "%REQ(content-encoding)%"},
                                      "append_action": "OVERWRITE_IF_EXISTS_OR_ADD", "keep_empty_value": False}}],
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
            "message_timeout": _dur(first_answer_s(cfg)),
            # flow control: the brain holds a request by extending this call's timer (override_message_timeout)
            **({"max_message_timeout": _dur(cfg.flow_control.wait_s + 5)} if cfg.flow_control.enabled else {}),
            "processing_mode": processing_mode,
            **more,
        },
    }


_SKIP_FILTER = {"action": {"name": "skip", "typed_config": {
    "@type": "type.googleapis.com/envoy.extensions.filters.common.matcher.action.v3.SkipFilter"}}}


def _header_predicate(header: str, regex: str) -> dict:
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


def look_filter(cfg: AppConfig) -> dict:
    """``warmroute.look``: a large body's headers go to the brain before the client uploads it (flow control on,
    issue 43). The brain lets it come, or refuses a new session with 429 while it is behind a burst: 2,000 new
    sessions of 100 KB are seconds of reading for one process, which Envoy's timer would fail open into the engines,
    and behind which the turns of sessions under way would wait. Only bodies of more than
    LOOK_BYTES that the brain will read (a bigger one takes the headers-only route): a look costs the brain about a
    fifth of reading such a body."""
    e = cfg.envoy
    look = ext_proc_filter(cfg, dict(HEADERS_ONLY), request_attributes=[TIME_ATTRIBUTE])
    look["typed_config"]["grpc_service"]["initial_metadata"] = [{"key": LOOK_METADATA[0], "value": LOOK_METADATA[1]}]
    look["typed_config"]["stat_prefix"] = LOOK_STAT_PREFIX
    look["typed_config"].pop("max_message_timeout", None)  # the brain answers a look at once, never holds it
    return {
        "name": LOOK_FILTER,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.common.matching.v3.ExtensionWithMatcher",
            "extension_config": look,
            "xds_matcher": {"matcher_list": {"matchers": [{
                "predicate": {"or_matcher": {"predicate": [
                    {"not_matcher": _header_predicate(CONTENT_LENGTH, greater_than_regex(LOOK_BYTES))},
                    _header_predicate(CONTENT_LENGTH, greater_than_regex(e.brain_body_max_bytes)),
                ]}},
                "on_match": _SKIP_FILTER,
            }]}},
        },
    }


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
                    "predicate": {"not_matcher": _header_predicate(INFLATED_FROM_HEADER, ".*")},
                    "on_match": _SKIP_FILTER,
                }]}},
            },
        },
        *([look_filter(cfg)] if cfg.flow_control.enabled else []),
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
                    }]},
                }},
                # only for what the brain will not read itself: a Content-Length above brain_body_max_bytes, or
                # none (chunked). A body the brain reads whole is not parsed twice
                # (an inflated upload has no Content-Length once inflated, and is bounded at the brain's limit)
                "xds_matcher": {"matcher_list": {"matchers": [{
                    "predicate": {"or_matcher": {"predicate": [
                        {"and_matcher": {"predicate": [
                            _header_predicate(CONTENT_LENGTH, ".*"),
                            {"not_matcher": _header_predicate(CONTENT_LENGTH,
                                                              greater_than_regex(e.brain_body_max_bytes))},
                        ]}},
                        _header_predicate(INFLATED_FROM_HEADER, ".*"),
                    ]}},
                    "on_match": _SKIP_FILTER,
                }]}},
            },
        },
        ext_proc_filter(cfg, {
            "request_header_mode": "SKIP",
            "response_header_mode": "SKIP",
            "request_body_mode": "BUFFERED",
            "response_body_mode": "NONE",
            "request_trailer_mode": "SKIP",
            "response_trailer_mode": "SKIP",
        }, request_attributes=[header_attribute(h) for h in brain_headers(cfg)] + [PATH_ATTRIBUTE],
            metadata_options={"receiving_namespaces": {"untyped": [METADATA_NAMESPACE]},
                              "forwarding_namespaces": {"untyped": [BODY_METADATA_NAMESPACE]}}),
        {
            # Holds the request headers until the whole body has passed ext_proc: without it the router
            # picks a route as soon as the headers arrive, before the brain has said anything.
            "name": HOLD_FILTER,
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
                "max_request_bytes": e.max_body_bytes,
            },
        },
        {
            # Runs after the brain's answer; the mutation happens before this filter looks up its route
            # config, so the route is computed with the header in place (ext_proc cleared the cache).
            # No answer (brain down, no body): no metadata, empty value, no header, fail-open route.
            "name": ROUTE_FROM_BRAIN_FILTER,
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
                "mutations": {"request_mutations": [
                    *({"append": {"header": {"key": header, "value": f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:{field})%"},
                                  "append_action": "ADD_IF_ABSENT", "keep_empty_value": False}}
                      for header, field in ((ROUTING_HEADER, ANSWER_CLUSTER), (RESERVATION_HEADER, ANSWER_RESERVATION))),
                    # the data-parallel engine the brain priced, when it chose one: its header replaces a client's
                    {"append": {"header": {"key": DP_RANK_HEADER,
                                           "value": f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:{ANSWER_DP_RANK})%"},
                                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD", "keep_empty_value": False}},
                ]},
            },
        },
    ]


def access_log(cfg: AppConfig) -> list[dict]:
    return [
        {
            "name": "envoy.access_loggers.http_grpc",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
                "common_config": {
                    "log_name": ACCESS_LOG_NAME,
                    "transport_api_version": "V3",
                    "grpc_service": {"envoy_grpc": {"cluster_name": BRAIN_LOG_CLUSTER}},
                    # each entry releases a reservation: flushed every access_log_flush_s (10 ms). The buffer is also the
                    # most Envoy holds while its stream is not writable: at 1 byte, every entry logged while one
                    # flush waited was dropped (logs_dropped), each a reservation open for an hour
                    "buffer_flush_interval": _dur(cfg.envoy.access_log_flush_s),
                    "buffer_size_bytes": 1024 * 1024,
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
    return {"access_log_options": {"access_log_flush_interval": _dur(cfg.envoy.access_log_periodic_s)}}


def local_reply_config() -> dict:
    """Envoy's own replies (413, 431, 503 no healthy upstream, 504 ...) in the OpenAI error shape the rest of
    the API uses, with the status and a machine-readable code (Envoy's response code details); the JSON
    answers warmroute already shapes (the 404 of paths not served, the brain's no_healthy_instances) pass
    through as they are."""
    return {
        "mappers": [{
            "filter": {"extension_filter": {
                "name": "envoy.access_loggers.extension_filters.cel",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
                                 "expression": "response.code_details == 'direct_response' || "
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


ADMIN_CLUSTER = "warmroute_envoy_admin"


def admin_section(cfg: AppConfig) -> dict:
    """Envoy's admin on a Unix socket only its user opens (mode 0600): on a loopback TCP port any local user could
    POST /quitquitquit, or /runtime_modify, and stop or steer the data plane."""
    return {"address": {"pipe": {"path": cfg.envoy.admin_path, "mode": 0o600}}}


def stats_listener(cfg: AppConfig) -> tuple[list[dict], list[dict]]:
    """(listeners, clusters) of the read-only Prometheus port: GET /stats/prometheus proxied to the admin socket,
    anything else 404. None without envoy.stats_port."""
    e = cfg.envoy
    if e.stats_port is None:
        return [], []
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "warmroute_stats",
        "route_config": {"name": "stats", "virtual_hosts": [{"name": "stats", "domains": ["*"], "routes": [
            {"match": {"path": "/stats/prometheus", "headers": [{"name": ":method", "string_match": {"exact": "GET"}}]},
             "route": {"cluster": ADMIN_CLUSTER, "timeout": "10s"}},
            {"match": {"prefix": "/"}, "direct_response": {"status": 404, "body": {"inline_string": "not found\n"}}},
        ]}]},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
    }
    listener = {"name": "warmroute_stats", "address": _address(e.stats_host, e.stats_port),
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                "typed_config": hcm}]}]}
    cluster = {"name": ADMIN_CLUSTER, "type": "STATIC", "connect_timeout": "1s",
               "load_assignment": {"cluster_name": ADMIN_CLUSTER, "endpoints": [{"lb_endpoints": [
                   {"endpoint": {"address": {"pipe": {"path": e.admin_path}}}}]}]}}
    return [listener], [cluster]


HEAP_MONITOR = "envoy.resource_monitors.fixed_heap"


def overload_manager(cfg: AppConfig) -> dict:
    """Envoy's memory bounded (``envoy.max_heap_bytes``): 20 gzip bombs took it from 177 MB to 1.2 GB. Past 85% it
    resets the streams whose buffers hold the most (tracked from 1 MiB up), past 95% it refuses new requests (a 503
    in the OpenAI error shape) rather than be killed; past 15% it returns freed memory to the system."""
    def trigger(**kind) -> dict:
        return {"name": HEAP_MONITOR, **kind}

    return {
        "refresh_interval": "0.25s",
        "resource_monitors": [{"name": HEAP_MONITOR, "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.resource_monitors.fixed_heap.v3.FixedHeapConfig",
            "max_heap_size_bytes": cfg.envoy.max_heap_bytes}}],
        "buffer_factory_config": {"minimum_account_to_track_power_of_two": 20},
        "actions": [
            {"name": "envoy.overload_actions.reset_high_memory_stream",
             "triggers": [trigger(scaled={"scaling_threshold": 0.85, "saturation_threshold": 0.95})]},
            # memory a burst took goes back to the system once it is over, not only near the bound
            {"name": "envoy.overload_actions.shrink_heap", "triggers": [trigger(threshold={"value": 0.15})]},
            {"name": "envoy.overload_actions.stop_accepting_requests", "triggers": [trigger(threshold={"value": 0.95})]},
        ],
    }


def upstream_http_options(cfg: AppConfig) -> dict:
    """A replica cluster's HTTP/1.1 options: its idle connections closed before the engine closes them (a request
    written on a connection the engine is closing is reset, and may already be on its way)."""
    return {"typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "common_http_protocol_options": {"idle_timeout": _dur(cfg.envoy.upstream_idle_timeout_s)},
        "explicit_http_config": {"http_protocol_options": {}},
    }}}


def _retry_policy(cfg: AppConfig) -> dict:
    # "reset": any reset or disconnect before the first response byte, whatever its kind (a killed vLLM's port
    # takes up to 1.3 s to close, resetting what reaches it meanwhile; a keep-alive connection the engine closes
    # as a request is written on it). Envoy never retries once a response byte went to the client, and the
    # generation had not begun where nothing was answered.
    return {
        "retry_on": "connect-failure,reset,refused-stream",
        "num_retries": cfg.envoy.retries,
        "retry_priority": {
            "name": "envoy.retry_priorities.previous_priorities",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.retry.priority.previous_priorities.v3.PreviousPrioritiesConfig",
                "update_frequency": 1,
            },
        },
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"},
            }
        ],
        "host_selection_retry_max_attempts": 5,
    }


def allowed_path_regex(entry: str) -> str:
    """The RE2 regex of one ``envoy.allowed_paths`` entry on ``:path``: an exact path, with or without a query
    string; a prefix for an entry ending in '*'; a ``{name}`` segment matches any one segment
    (``/v1/responses/{id}`` lets a response's id through, not ``/v1/responses/render``)."""
    prefix = entry.endswith("*")
    parts = re.split(r"\{[^}/]*\}", entry[:-1] if prefix else entry)
    body = "[^/?]+".join(re.escape(x) for x in parts)
    return "^" + body + (".*$" if prefix else "([?].*)?$")


def _not_allowed(paths) -> list[dict]:
    """Header matchers on ``:path`` that all hold for a path outside the allow-list: one small regex per entry,
    each inverted. One regex over the whole list would pass RE2's default program-size limit."""
    return [{"name": ":path", "string_match": {"safe_regex": {"regex": allowed_path_regex(p)}}, "invert_match": True}
            for p in paths]


NOT_SERVED_BODY = '{"error": {"message": "this path is not served here", "type": "not_found", "code": "path_not_served"}}'


def routes(cfg: AppConfig) -> list[dict]:
    """The routes of the virtual host that serves the model API, in order: a 404 for every path outside
    ``envoy.allowed_paths``, the brain's choice, the big-body route, and the fail-open route."""
    common = {
        "timeout": "0s",  # never cut a long generation (Envoy's default is 15 s)
        "retry_policy": _retry_policy(cfg),
    }
    # C7: without the brain, keep cache locality: ring hash on the session header (the client's address when
    # there is none; Envoy cannot hash a body), bounded by hash_balance_factor
    fail_open = {"cluster": FALLBACK_CLUSTER, **common, "hash_policy": [
        *({"header": {"header_name": h}, "terminal": True} for h in cfg.router.profile.session_headers),
        {"connection_properties": {"source_ip": True}},
    ]}
    return [
        {
            "name": "warmroute_not_served",
            "match": {"prefix": "/", "headers": _not_allowed(cfg.envoy.allowed_paths)},
            "direct_response": {"status": 404, "body": {"inline_string": NOT_SERVED_BODY}},
            "response_headers_to_add": [{"header": {"key": "content-type", "value": "application/json"},
                                         "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
            # answered here: the brain is not asked (it would not name a replica for a path outside the API)
            "typed_per_filter_config": ext_proc_off_for_route(),
        },
        {
            # The fleet's models, not one replica's: the brain answers with the union of what every replica's
            # /v1/models lists (and the aliases). Without the brain, a replica answers its own
            "name": "warmroute_models",
            "match": {"path": "/v1/models", "headers": [{"name": ":method", "string_match": {"exact": "GET"}}]},
            "route": fail_open,
            "typed_per_filter_config": big_body_ext_proc(),
        },
        {
            "name": "warmroute_brain_choice",
            "match": {"prefix": "/", "headers": [
                {"name": ROUTING_HEADER, "present_match": True},
                # only a replica's cluster: never the brain's own or the fallback (defence in depth: the
                # header is the brain's answer, a client's copy is gone before routing)
                {"name": ROUTING_HEADER, "string_match": {"prefix": RESERVED_NAME_PREFIX}, "invert_match": True},
            ]},
            "route": {"cluster_header": ROUTING_HEADER, **common},
        },
        {
            # Bodies too big to copy to the brain: it is asked with the headers alone (session, Content-Length),
            # answers before the body is read, and the route is matched again with its answer in place.
            "name": "warmroute_big_body",
            "match": {"prefix": "/", "headers": [{"name": CONTENT_LENGTH, "range_match": {
                "start": cfg.envoy.brain_body_max_bytes + 1, "end": 2**62}}]},
            "route": fail_open,
            "typed_per_filter_config": big_body_ext_proc(),
        },
        {
            # A stored response's retrieval or cancel carries no body, and only the replica that made the response
            # holds it: the brain is asked with the headers (the path names the response, docs/apis.md) and the
            # route is matched again with its answer in place
            "name": "warmroute_stored_responses",
            "match": {"safe_regex": {"regex": STORED_RESPONSE_PATH}},
            "route": fail_open,
            "typed_per_filter_config": big_body_ext_proc(),
        },
        {
            # A body of no declared size (chunked): it may be larger than the brain accepts (a 4 MB one failed open
            # to a replica of another model), so it is decided as a big body is, on its headers and its model
            "name": "warmroute_unsized_body",
            # (an inflated upload lost its Content-Length to the decompressor: it is bounded at the brain's limit)
            "match": {"prefix": "/", "headers": [{"name": ":method", "string_match": {"exact": "POST"}},
                                                 {"name": CONTENT_LENGTH, "present_match": False},
                                                 {"name": INFLATED_FROM_HEADER, "present_match": False}]},
            "route": fail_open,
            "typed_per_filter_config": big_body_ext_proc(),
        },
        {
            "name": "warmroute_fail_open",
            "match": {"prefix": "/"},
            "route": fail_open,
        },
    ]


INFLATED_LIMIT_FILTER = "warmroute.inflated_body_limit"
LOOK_FILTER = "warmroute.look"
LOOK_STAT_PREFIX = "warmroute_look"  # http.<hcm>.ext_proc.warmroute_look.*
LOOK_BYTES = 64 * 1024  # ~16K tokens; below it a body is read without a look (a look costs what ~12 KB of body does)
BODY_MODEL_FILTER = "warmroute.big_body_model"
LISTENER_READ_BYTES = 64 * 1024  # x max_inflate_ratio (100): at most 6.4 MB inflated per upload at a time

STORED_RESPONSE_PATH = "^/v1/responses/[^/]+(/cancel)?$"  # Envoy matches a route's regex without the query


SYSTEM_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"  # Debian's; Envoy verifies nothing without a CA


def upstream_tls(sni: str, ca_file: str | None, cert_file: str | None = None, key_file: str | None = None,
                 alpn: tuple[str, ...] = ()) -> dict:
    """A cluster's ``transport_socket`` for TLS to ``sni``: the peer's chain checked against ``ca_file`` (the
    system's bundle by default) and its name against ``sni``; a client certificate when one is given."""
    ctx: dict[str, Any] = {"validation_context": {
        "trusted_ca": {"filename": ca_file or SYSTEM_CA_BUNDLE},
        "match_typed_subject_alt_names": [{"san_type": "IP_ADDRESS" if _is_ip(sni) else "DNS", "matcher": {"exact": sni}}],
    }}
    if cert_file:
        ctx["tls_certificates"] = [{"certificate_chain": {"filename": cert_file}, "private_key": {"filename": key_file}}]
    if alpn:
        ctx["alpn_protocols"] = list(alpn)
    return {"name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "sni": sni, "common_tls_context": ctx}}


def brain_cluster(cfg: AppConfig) -> dict:
    b, e = cfg.brain, cfg.envoy
    hc = e.brain_health_check_interval_s
    tls = None
    if b.grpc_socket:
        address = {"pipe": {"path": os.path.abspath(b.grpc_socket)}}
    else:
        address = _address(b.host, b.grpc_port or 0)
        if b.tls_cert_file:
            tls = upstream_tls(e.brain_tls_sni or b.host, e.brain_tls_ca_file, e.brain_tls_cert_file,
                               e.brain_tls_key_file, alpn=("h2",))
    cluster = {
        "name": BRAIN_CLUSTER,
        "type": "STATIC" if b.grpc_socket or _is_ip(b.host) else "STRICT_DNS",
        "connect_timeout": "0.25s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {
                    # bodies of tens of MiB go to the brain in one message
                    "initial_stream_window_size": 16 * 1024 * 1024,
                    "initial_connection_window_size": 64 * 1024 * 1024,
                }},
            }
        },
        # a burst the brain cannot decide within ext_proc_timeout_s fails open at once past this many calls in
        # flight, instead of queueing work for requests Envoy will have given up on by the time it is done. With
        # flow control the brain holds what it cannot place, and extends Envoy's timer for a call it reads while
        # behind: calls it may hold count on top (a flood of new sessions failed open past it, 205 of 400, straight
        # into the engines ahead of the sessions under way)
        "circuit_breakers": _thresholds(brain_calls_max(cfg)),
        "health_checks": [
            {
                "timeout": _dur(max(0.1, hc / 2)),
                "interval": _dur(hc),
                # Envoy's default for a cluster that carried no traffic lately is one check a minute: a brain
                # that died between requests would be found a minute late
                "no_traffic_interval": _dur(hc),
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                "grpc_health_check": {"service_name": ""},
            }
        ],
        "load_assignment": {
            "cluster_name": BRAIN_CLUSTER,
            # several brains sharing state (endpoint-picker shape): each request's stream goes to any of them;
            # brain_failover: the other pairs' brains, asked only while this one is down (priority 1)
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": a}} for a in
                                            [address, *(_brain_endpoint(ep) for ep in e.brain_endpoints)]]},
                          *([{"priority": 1, "lb_endpoints": [{"endpoint": {"address": _brain_endpoint(ep)}}
                                                              for ep in e.brain_failover]}]
                            if e.brain_failover else [])],
        },
    }
    if tls is not None:
        cluster["transport_socket"] = tls
    return cluster


def _brain_endpoint(ep: str) -> dict:
    if ep.startswith("unix:"):
        return {"pipe": {"path": ep[len("unix:"):]}}
    host, _, port = ep.rpartition(":")
    return _address(host.strip("[]"), int(port))


def brain_log_cluster(cfg: AppConfig) -> dict:
    """The brain again, for the access-log stream alone. On the ext_proc connection a body of a few MiB fills the
    connection's write buffer, every stream on it is then above its high watermark, and Envoy's gRPC access logger
    drops the entries it cannot flush: each a reservation never released (5 in 30 s of 300 KB bodies under load).
    Its own connection carries nothing but entries; no health check (the brain cluster's says whether it lives)."""
    # with brain_failover the log follows the decisions to the standby brain: it needs the health checks to know
    drop = ("circuit_breakers",) if cfg.envoy.brain_failover else ("health_checks", "circuit_breakers")
    c = {k: v for k, v in brain_cluster(cfg).items() if k not in drop}
    c["name"] = BRAIN_LOG_CLUSTER
    c["load_assignment"] = {**c["load_assignment"], "cluster_name": BRAIN_LOG_CLUSTER}
    return c


TLS_MATCH_KEY = "warmroute_replica"  # endpoint metadata that picks an https:// replica's transport socket


def _lb_endpoint(r: ReplicaSpec) -> dict:
    ep: dict[str, Any] = {"endpoint": {"address": _address(r.host, r.port), "hostname": r.name}}
    if r.tls:
        ep["metadata"] = {"filter_metadata": {"envoy.transport_socket_match": {TLS_MATCH_KEY: r.name}}}
    return ep


def _tls_matches(replicas) -> dict:
    """``transport_socket_matches`` for a cluster whose endpoints include https:// replicas: each such endpoint
    gets its own TLS (its SNI, CA and client certificate); the others stay plaintext."""
    matches = [{"name": f"tls-{r.name}", "match": {TLS_MATCH_KEY: r.name},
                "transport_socket": upstream_tls(r.sni, r.tls_ca_file, r.tls_cert_file, r.tls_key_file)}
               for r in replicas if r.tls]
    return {"transport_socket_matches": matches} if matches else {}


def replica_cluster(cfg: AppConfig, r: ReplicaSpec) -> dict:
    others = [o for o in cfg.replicas if o.name != r.name]
    endpoints: list[dict] = [{"priority": 0, "lb_endpoints": [_lb_endpoint(r)]}]
    if others:
        endpoints.append({"priority": 1, "lb_endpoints": [_lb_endpoint(o) for o in others]})
    all_ip = all(_is_ip(x.host) for x in cfg.replicas)
    return {
        "name": r.name,
        "type": "STATIC" if all_ip else "STRICT_DNS",
        "connect_timeout": _dur(cfg.envoy.upstream_connect_timeout_s),
        "lb_policy": "LEAST_REQUEST",
        "circuit_breakers": _thresholds(),
        "per_connection_buffer_limit_bytes": cfg.envoy.max_body_bytes,
        "load_assignment": {"cluster_name": r.name, "endpoints": endpoints},
        **upstream_http_options(cfg),
        **_tls_matches([r, *others]),
    }


def fallback_cluster(cfg: AppConfig) -> dict:
    """Where requests go when the brain does not answer (SPEC C7): bounded-load ring hash over every
    replica, on the session header or the client's address (the route's hash policy)."""
    all_ip = all(_is_ip(x.host) for x in cfg.replicas)
    return {
        "name": FALLBACK_CLUSTER,
        "type": "STATIC" if all_ip else "STRICT_DNS",
        "connect_timeout": _dur(cfg.envoy.upstream_connect_timeout_s),
        "lb_policy": "RING_HASH",
        "common_lb_config": {"consistent_hashing_lb_config": {
            "hash_balance_factor": cfg.envoy.fail_open_hash_balance_factor}},
        "circuit_breakers": _thresholds(),
        "per_connection_buffer_limit_bytes": cfg.envoy.max_body_bytes,
        "load_assignment": {
            "cluster_name": FALLBACK_CLUSTER,
            "endpoints": [{"lb_endpoints": [_lb_endpoint(r) for r in cfg.replicas]}],
        },
        **upstream_http_options(cfg),
        **_tls_matches(cfg.replicas),
    }


def replica_clusters(cfg: AppConfig) -> list[dict]:
    """The clusters that follow the replica list (static, or in the CDS file)."""
    return [fallback_cluster(cfg), *(replica_cluster(cfg, r) for r in cfg.replicas)]


def clusters(cfg: AppConfig) -> list[dict]:
    return [brain_cluster(cfg), brain_log_cluster(cfg), *replica_clusters(cfg)]


def envoy_bootstrap(cfg: AppConfig) -> dict[str, Any]:
    """The default shape's bootstrap (``shapes.bootstrap`` chooses the shape)."""
    e = cfg.envoy
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "ingress",
        "codec_type": "AUTO",
        "stream_idle_timeout": _dur(e.stream_idle_timeout_s),
        "early_header_mutation_extensions": early_header_mutation(cfg),
        # the id Envoy made for the request (a client's own is dropped at the edge), for the client's logs
        "always_set_request_id_in_response": True,
        "access_log": access_log(cfg),
        **hcm_access_log_options(cfg),
        "local_reply_config": local_reply_config(),
        "route_config": {
            "name": "warmroute",
            "virtual_hosts": [
                {
                    "name": "models",
                    "domains": ["*"],
                    "routes": routes(cfg),
                    # retries replay the buffered body: allow as much as a request may carry
                    "request_body_buffer_limit": e.max_body_bytes,
                }
            ],
        },
        "http_filters": [
            *http_filters(cfg),
            {"name": "envoy.filters.http.router", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }
    stats_listeners, stats_clusters = stats_listener(cfg)
    doc: dict[str, Any] = {
        "admin": admin_section(cfg),
        "overload_manager": overload_manager(cfg),
        "static_resources": {
            "listeners": [
                {
                    "name": "warmroute_ingress",
                    "address": _address(e.listen_host, e.listen_port),
                    # How much Envoy reads from a client before it stops reading: each piece read is what the gzip
                    # decompressor inflates at once (up to max_inflate_ratio times it), before any body limit is
                    # seen. At max_body_bytes a 1 MB upload read in one piece became 62 MB, sixteen took Envoy
                    # past 1 GiB. Bodies still reach max_body_bytes: the virtual host's request_body_buffer_limit bounds them
                    "per_connection_buffer_limit_bytes": LISTENER_READ_BYTES,
                    "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}],
                },
                *stats_listeners,
            ],
            "clusters": [*(clusters(cfg) if not e.cds_path else [brain_cluster(cfg), brain_log_cluster(cfg)]),
                         *stats_clusters],
        },
    }
    if e.cds_path:
        # the route names clusters that arrive through CDS, after the route config is loaded
        hcm["route_config"]["validate_clusters"] = False
        path = os.path.abspath(e.cds_path)
        doc["node"] = {"id": "warmroute-envoy", "cluster": "warmroute"}  # required with dynamic resources
        doc["dynamic_resources"] = {"cds_config": {
            "resource_api_version": "V3",
            "path_config_source": {"path": path, "watched_directory": {"path": os.path.dirname(path)}},
        }}
    return doc


def big_body_ext_proc() -> dict:
    """``typed_per_filter_config`` of the big-body and models routes: ext_proc sends the headers, not the body."""
    return {
        EXT_PROC_FILTER: {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
            "overrides": {"processing_mode": dict(HEADERS_ONLY)},
        },
    }


def ext_proc_off_for_route() -> dict:
    """``typed_per_filter_config`` for a user's other routes, so the brain sees only model traffic
    and their bodies are not held back."""
    return {
        EXT_PROC_FILTER: {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
            "disabled": True,
        },
        LOOK_FILTER: {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
            "disabled": True,
        },
        HOLD_FILTER: {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.BufferPerRoute",
            "disabled": True,
        },
    }


def snippets(cfg: AppConfig) -> dict[str, Any]:
    """The pieces to paste into an existing Envoy; ``replica_cluster_template`` uses the first replica."""
    first = cfg.replicas[0] if cfg.replicas else ReplicaSpec("r0", "http://127.0.0.1:8000")
    return {
        "early_header_mutation_extensions": early_header_mutation(cfg),
        "http_filters": http_filters(cfg),
        "access_log": access_log(cfg),
        "hcm_access_log_options": hcm_access_log_options(cfg),
        "local_reply_config": local_reply_config(),
        "routes": routes(cfg),
        "brain_cluster": brain_cluster(cfg),
        "brain_log_cluster": brain_log_cluster(cfg),
        "fallback_cluster": fallback_cluster(cfg),
        "replica_cluster_template": replica_cluster(cfg, first),
        "other_routes_typed_per_filter_config": ext_proc_off_for_route(),
    }


class _NoAliasDumper(yaml.SafeDumper):
    """Snippets are pasted by hand: spell every repeated block out instead of &id001 anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump(doc: Any) -> str:
    return yaml.dump(doc, Dumper=_NoAliasDumper, sort_keys=False, default_flow_style=False, width=120)
