"""The routes: "route by the brain's header" / "fail open to the bounded ring hash", both only on the paths of
``envoy.allowed_paths``, a 404 for every other path, and the big-body, models and stored-response routes."""

from __future__ import annotations

import re

from ..config import AppConfig
from ..core.profile import CONTENT_LENGTH
from ..contract import (
    FALLBACK_CLUSTER,
    INFLATED_FROM_HEADER,
    RESERVED_NAME_PREFIX,
    ROUTING_HEADER,
)
from .filters import big_body_ext_proc, ext_proc_off_for_route


def retry_policy(cfg: AppConfig) -> dict:
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
                "@type": "type.googleapis.com/envoy.extensions.retry.priority.previous_priorities.v3.PreviousPrioritiesConfig",  # noqa: E501 (a type URL)
                "update_frequency": 1,
            },
        },
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"},  # noqa: E501 (a type URL)
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


def not_allowed(paths) -> list[dict]:
    """Header matchers on ``:path`` that all hold for a path outside the allow-list: one small regex per entry,
    each inverted. One regex over the whole list would pass RE2's default program-size limit."""
    return [{"name": ":path", "string_match": {"safe_regex": {"regex": allowed_path_regex(p)}}, "invert_match": True}
            for p in paths]


NOT_SERVED_BODY = ('{"error": {"message": "this path is not served here", "type": "not_found", '
                   '"code": "path_not_served"}}')


def routes(cfg: AppConfig) -> list[dict]:
    """The routes of the virtual host that serves the model API, in order: a 404 for every path outside
    ``envoy.allowed_paths``, the brain's choice, the big-body route, and the fail-open route."""
    common = {
        "timeout": "0s",  # never cut a long generation (Envoy's default is 15 s)
        "retry_policy": retry_policy(cfg),
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
            "match": {"prefix": "/", "headers": not_allowed(cfg.envoy.allowed_paths)},
            "direct_response": {"status": 404, "body": {"inline_string": NOT_SERVED_BODY}},
            "response_headers_to_add": [{"header": {"key": "content-type", "value": "application/json"},
                                         "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
            # answered here: the brain is not asked (it would not name a replica for a path outside the API)
            "typed_per_filter_config": ext_proc_off_for_route(cfg),
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


STORED_RESPONSE_PATH = "^/v1/responses/[^/]+(/cancel)?$"  # Envoy matches a route's regex without the query
