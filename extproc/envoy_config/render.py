"""Render Envoy's bootstrap from the same config the brain reads, so the two never disagree.

The bootstrap is assembled from pieces that also ship alone (``snippets``) for users who already run Envoy:
the filters (``filters``), the routes (``routes``), the brain's and the replicas' clusters (``clusters``); here,
the listener, the admin socket, the stats listener and the overload manager around them.
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from ..config import AppConfig, ReplicaSpec
from .common import socket_address, dur
from .filters import brain_headers, edge_headers_removed  # noqa: F401 (read from here)
from .filters import (
    access_log,
    early_header_mutation,
    ext_proc_off_for_route,
    hcm_access_log_options,
    http_filters,
    local_reply_config,
)
from .routes import allowed_path_regex, routes  # noqa: F401 (allowed_path_regex: read from here)
from .clusters import (brain_cluster, brain_clusters, brain_door_cluster, brain_log_cluster, clusters,  # noqa: F401
                       fallback_cluster, replica_cluster, replica_clusters)  # (replica_clusters: read from here)


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
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",  # noqa: E501 (a type URL)
        "stat_prefix": "warmroute_stats",
        "route_config": {"name": "stats", "virtual_hosts": [{"name": "stats", "domains": ["*"], "routes": [
            {"match": {"path": "/stats/prometheus", "headers": [{"name": ":method", "string_match": {"exact": "GET"}}]},
             "route": {"cluster": ADMIN_CLUSTER, "timeout": "10s"}},
            {"match": {"prefix": "/"}, "direct_response": {"status": 404, "body": {"inline_string": "not found\n"}}},
        ]}]},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
    }
    listener = {"name": "warmroute_stats", "address": socket_address(e.stats_host, e.stats_port),
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
            {"name": "envoy.overload_actions.stop_accepting_requests",
             "triggers": [trigger(threshold={"value": 0.95})]},
        ],
    }


LISTENER_READ_BYTES = 64 * 1024  # x max_inflate_ratio (100): at most 6.4 MB inflated per upload at a time


def envoy_bootstrap(cfg: AppConfig) -> dict[str, Any]:
    """The default shape's bootstrap (``shapes.bootstrap`` chooses the shape)."""
    e = cfg.envoy
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",  # noqa: E501 (a type URL)
        "stat_prefix": "ingress",
        "codec_type": "AUTO",
        "stream_idle_timeout": dur(e.stream_idle_timeout_s),
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
            {"name": "envoy.filters.http.router",
             "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
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
                    "address": socket_address(e.listen_host, e.listen_port),
                    # How much Envoy reads from a client before it stops reading: each piece read is what the gzip
                    # decompressor inflates at once (up to max_inflate_ratio times it), before any body limit is
                    # seen. At max_body_bytes a 1 MB upload read in one piece became 62 MB, sixteen took Envoy
                    # past 1 GiB. Bodies still reach max_body_bytes: the virtual host's request_body_buffer_limit bounds
                    # them
                    "per_connection_buffer_limit_bytes": LISTENER_READ_BYTES,
                    "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                    "typed_config": hcm}]}],
                },
                *stats_listeners,
            ],
            "clusters": [*(clusters(cfg) if not e.cds_path else brain_clusters(cfg)),
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
        # the header path's door, where Envoy reaches the brain by a Unix socket (absent over TCP)
        **({"brain_door_cluster": door} if (door := brain_door_cluster(cfg)) is not None else {}),
        "fallback_cluster": fallback_cluster(cfg),
        "replica_cluster_template": replica_cluster(cfg, first),
        "other_routes_typed_per_filter_config": ext_proc_off_for_route(cfg),
    }


class _NoAliasDumper(yaml.SafeDumper):
    """Snippets are pasted by hand: spell every repeated block out instead of &id001 anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump(doc: Any) -> str:
    return yaml.dump(doc, Dumper=_NoAliasDumper, sort_keys=False, default_flow_style=False, width=120)
