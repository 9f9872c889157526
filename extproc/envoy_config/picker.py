"""Envoy in the endpoint-picker shape (``warmroute envoy-config --mode endpoint-picker``): what a Gateway
API Inference Extension gateway runs, so the brain's ``endpoint-picker`` protocol is tested against the
real thing and a cluster without such a gateway can run it as is.

One cluster holds every replica, with Envoy's ``override_host`` load-balancing policy: the host is the
first of ``x-gateway-destination-endpoint`` (dynamic metadata ``envoy.lb``, where the brain puts it), a
retry takes the next one in the list. Chosen over an ``ORIGINAL_DST`` cluster because that one takes a
single address (no ordered fallbacks), needs no host list (so it would send a request to any address a
header names), and has nothing to fall back to: here, when the brain does not answer (down, slow:
``failure_mode_allow``), the fallback policy is the same bounded-load ring hash on the session header as
the default shape's fail-open route, so sessions stay on their caches.

What this shape does not have, compared with the default one: no access log to the brain (it releases at
the response's end, read through ext_proc, so every response chunk passes through the brain), no
per-replica clusters (Envoy's per-replica counters are the pool cluster's per-host stats).
"""

from __future__ import annotations

import os
from typing import Any

from ..config import AppConfig, ConfigError
from ..contract import (
    DESTINATION_HEADER,
    DESTINATION_NAMESPACE,
    PICKER_CLUSTER,
    SUBSET_NAMESPACE,
)
from .clusters import brain_cluster, lb_endpoint, tls_matches, upstream_http_options
from .common import socket_address, dur, is_ip, thresholds
from .filters import early_header_mutation, ext_proc_filter, local_reply_config
from .render import admin_section, overload_manager, stats_listener
from .routes import retry_policy, routes

UPSTREAM_ADDRESS_ATTRIBUTE = "upstream.address"


def picker_ext_proc(cfg: AppConfig) -> dict:
    """The ext_proc filter: headers, then the bodies. ``envoy.picker_body_mode`` "full-duplex" is how GIE gateways
    configure it (FULL_DUPLEX_STREAMED both ways); "buffered" sends the request body whole (the brain answers on
    it) and the response in STREAMED chunks, each held by Envoy until the brain has seen it, so that a brain
    that dies at any moment fails open instead of failing the request."""
    e = cfg.envoy
    duplex = e.picker_body_mode == "full-duplex"
    return ext_proc_filter(cfg, {
        "request_header_mode": "SEND",
        "response_header_mode": "SEND",
        "request_body_mode": "FULL_DUPLEX_STREAMED" if duplex else "BUFFERED",
        "response_body_mode": "FULL_DUPLEX_STREAMED" if duplex else "STREAMED",
        # full duplex requires trailers sent; buffered does not need them
        "request_trailer_mode": "SEND" if duplex else "SKIP",
        "response_trailer_mode": "SEND" if duplex else "SKIP",
    },
        # the endpoint that answered, read on the response (a retry may have moved the request)
        response_attributes=[UPSTREAM_ADDRESS_ATTRIBUTE],
        metadata_options={
            "forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE, DESTINATION_NAMESPACE]},
            "receiving_namespaces": {"untyped": [DESTINATION_NAMESPACE]},
        })


def pool_cluster(cfg: AppConfig) -> dict:
    """Every replica, for override_host to pick from. With DNS discovery and no CDS file, Envoy resolves the
    same name as the brain itself (a headless Service: one host per ready pod), so the two see one set."""
    e, d = cfg.envoy, cfg.discovery
    all_ip = all(is_ip(r.host) for r in cfg.replicas)
    dns = d.source == "dns" and not e.cds_path
    ring_hash = {"name": "envoy.load_balancing_policies.ring_hash", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.ring_hash.v3.RingHash",
        "consistent_hashing_lb_config": {"hash_balance_factor": e.fail_open_hash_balance_factor}}}
    return {
        "name": PICKER_CLUSTER,
        "type": "STRICT_DNS" if dns or not all_ip else "STATIC",
        **({"dns_refresh_rate": dur(d.interval_s), "respect_dns_ttl": False} if dns else {}),
        "connect_timeout": dur(e.upstream_connect_timeout_s),
        "circuit_breakers": thresholds(),
        "per_connection_buffer_limit_bytes": e.max_body_bytes,
        "load_balancing_policy": {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                "override_host_sources": [
                    {"metadata": {"key": DESTINATION_NAMESPACE, "path": [{"key": DESTINATION_HEADER}]}},
                    {"header": DESTINATION_HEADER},
                ],
                "fallback_policy": {"policies": [{"typed_extension_config": ring_hash}]},
            },
        }}]},
        "load_assignment": {"cluster_name": PICKER_CLUSTER, "endpoints": [{"lb_endpoints": (
            [{"endpoint": {"address": socket_address(d.dns_name, d.port)}}] if dns
            else [lb_endpoint(r) for r in cfg.replicas])}]},
        **upstream_http_options(cfg),
        **tls_matches(cfg.replicas),
    }

def picker_routes(cfg: AppConfig) -> list[dict]:
    """The 404 of paths not served (the default shape's), then everything to the pool cluster: the host is the
    brain's; without an answer the ring hash hashes the session header (or the client's address)."""
    not_served = routes(cfg)[0]
    return [not_served, {
        "name": "warmroute_picked",
        "match": {"prefix": "/"},
        "route": {
            "cluster": PICKER_CLUSTER,
            "timeout": "0s",
            "retry_policy": {k: v for k, v in retry_policy(cfg).items() if k != "retry_priority"},
            "hash_policy": [
                *({"header": {"header_name": h}, "terminal": True} for h in cfg.router.profile.session_headers),
                {"connection_properties": {"source_ip": True}},
            ],
        },
    }]

def picker_brain_cluster(cfg: AppConfig) -> dict:
    """The brain's cluster, without Envoy's panic routing: once its health check sees the brain down, a new
    stream fails at its start, before any body chunk went out, which is the only moment a full-duplex
    ext_proc can still fail open (Envoy sends no body it no longer holds). Panic routing would keep
    connecting to the dead brain and fail those requests instead."""
    c = brain_cluster(cfg)
    c["common_lb_config"] = {"healthy_panic_threshold": {"value": 0.0}}
    return c


def picker_clusters(cfg: AppConfig) -> list[dict]:
    return [pool_cluster(cfg)]

def picker_bootstrap(cfg: AppConfig) -> dict[str, Any]:
    e = cfg.envoy
    if cfg.brain.protocol != "endpoint-picker":
        raise ConfigError("brain.protocol: --mode endpoint-picker needs a brain that speaks it: set brain.protocol: "
                          "endpoint-picker")
    if cfg.discovery.source == "kubernetes" and not e.cds_path:
        raise ConfigError("envoy.cds_path: with kubernetes discovery the brain writes the pool's endpoints there for "
                          "Envoy; set a path (or discover by dns, which Envoy resolves itself)")
    mutation = early_header_mutation(cfg)
    # a client's own destination header would pick the host whenever the brain does not answer
    mutation[0]["typed_config"]["mutations"].append({"remove": DESTINATION_HEADER})
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",  # noqa: E501 (a type URL)
        "stat_prefix": "ingress",
        "codec_type": "AUTO",
        "stream_idle_timeout": dur(e.stream_idle_timeout_s),
        "early_header_mutation_extensions": mutation,
        "always_set_request_id_in_response": True,
        "local_reply_config": local_reply_config(),
        "route_config": {"name": "warmroute", "virtual_hosts": [{
            "name": "models", "domains": ["*"], "routes": picker_routes(cfg),
            "request_body_buffer_limit": e.max_body_bytes,
        }]},
        "http_filters": [
            picker_ext_proc(cfg),
            {"name": "envoy.filters.http.router",
             "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }
    stats_listeners, stats_clusters = stats_listener(cfg)
    doc: dict[str, Any] = {
        "admin": admin_section(cfg),
        "overload_manager": overload_manager(cfg),
        "static_resources": {
            "listeners": [{
                "name": "warmroute_ingress",
                "address": socket_address(e.listen_host, e.listen_port),
                "per_connection_buffer_limit_bytes": e.max_body_bytes,
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                "typed_config": hcm}]}],
            }, *stats_listeners],
            "clusters": [picker_brain_cluster(cfg), *([] if e.cds_path else picker_clusters(cfg)), *stats_clusters],
        },
    }
    if e.cds_path:
        hcm["route_config"]["validate_clusters"] = False
        path = os.path.abspath(e.cds_path)
        doc["node"] = {"id": "warmroute-envoy", "cluster": "warmroute"}
        doc["dynamic_resources"] = {"cds_config": {
            "resource_api_version": "V3",
            "path_config_source": {"path": path, "watched_directory": {"path": os.path.dirname(path)}},
        }}
    return doc

__all__ = ["picker_bootstrap", "picker_clusters", "picker_ext_proc", "pool_cluster"]
