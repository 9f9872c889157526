"""The brain's clusters and one cluster per replica.

Each replica cluster has the replica itself at priority 0 and the other
replicas at priority 1. Envoy sends everything to priority 0 (no active
health checks mark it down); a retry after a refused connection or a reset
before any response byte skips the priority already tried, so it lands on
another replica. Per-replica stats stay ``cluster.<replica>.upstream_rq_total``.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from ..config import AppConfig, ReplicaSpec, brain_calls_max, first_answer_s
from ..contract import (
    BRAIN_CLUSTER,
    BRAIN_DOOR_CLUSTER,
    BRAIN_LOG_CLUSTER,
    FALLBACK_CLUSTER,
    DOOR_READY_PATH,
    header_door_socket,
    log_door_socket,
)
from .common import BIG, socket_address, dur, is_ip, thresholds


def upstream_http_options(cfg: AppConfig) -> dict:
    """A replica cluster's HTTP/1.1 options: its idle connections closed before the engine closes them (a request
    written on a connection the engine is closing is reset, and may already be on its way)."""
    return {"typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "common_http_protocol_options": {"idle_timeout": dur(cfg.envoy.upstream_idle_timeout_s)},
        "explicit_http_config": {"http_protocol_options": {}},
    }}}


SYSTEM_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"  # Debian's; Envoy verifies nothing without a CA


def upstream_tls(sni: str, ca_file: str | None, cert_file: str | None = None, key_file: str | None = None,
                 alpn: tuple[str, ...] = ()) -> dict:
    """A cluster's ``transport_socket`` for TLS to ``sni``: the peer's chain checked against ``ca_file`` (the
    system's bundle by default) and its name against ``sni``; a client certificate when one is given."""
    ctx: dict[str, Any] = {"validation_context": {
        "trusted_ca": {"filename": ca_file or SYSTEM_CA_BUNDLE},
        "match_typed_subject_alt_names": [{"san_type": "IP_ADDRESS" if is_ip(sni) else "DNS",
                                           "matcher": {"exact": sni}}],
    }}
    if cert_file:
        ctx["tls_certificates"] = [{"certificate_chain": {"filename": cert_file},
                                    "private_key": {"filename": key_file}}]
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
        address = socket_address(b.host, b.grpc_port or 0)
        if b.tls_cert_file:
            tls = upstream_tls(e.brain_tls_sni or b.host, e.brain_tls_ca_file, e.brain_tls_cert_file,
                               e.brain_tls_key_file, alpn=("h2",))
    cluster = {
        "name": BRAIN_CLUSTER,
        "type": "STATIC" if b.grpc_socket or is_ip(b.host) else "STRICT_DNS",
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
        "circuit_breakers": thresholds(brain_calls_max(cfg)),
        "health_checks": [
            {
                "timeout": dur(max(0.1, hc / 2)),
                "interval": dur(hc),
                # Envoy's default for a cluster that carried no traffic lately is one check a minute: a brain
                # that died between requests would be found a minute late
                "no_traffic_interval": dur(hc),
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
    if e.brain_endpoints or e.brain_failover:
        cluster["outlier_detection"] = refused_brain_ejection(hc)
    if tls is not None:
        cluster["transport_socket"] = tls
    return cluster


def refused_brain_ejection(hc: float) -> dict:
    """A brain that refuses a connection is out of the cluster's choice at once, for a few health-check intervals:
    until the checks mark a dead brain (two failures, ~1 s), every call that picked it failed open to the ring hash
    (41-72 a brain death under the brains test's load, moving their sessions; 1-2 with this) where another brain
    was there to ask. Only connection failures count (the brain's answers are gRPC statuses, a busy brain's its own)."""
    return {
        "split_external_local_origin_errors": True,
        "consecutive_local_origin_failure": 1,
        "enforcing_consecutive_local_origin_failure": 100,
        "enforcing_consecutive_5xx": 0,
        "enforcing_consecutive_gateway_failure": 0,
        "enforcing_success_rate": 0,
        "enforcing_local_origin_success_rate": 0,
        "enforcing_failure_percentage": 0,
        "enforcing_failure_percentage_local_origin": 0,
        "interval": dur(hc),
        "base_ejection_time": dur(2 * hc),
        "max_ejection_time": dur(8 * hc),
        "max_ejection_percent": 100,
    }


def _brain_endpoint(ep: str) -> dict:
    if ep.startswith("unix:"):
        return {"pipe": {"path": ep[len("unix:"):]}}
    host, _, port = ep.rpartition(":")
    return socket_address(host.strip("[]"), int(port))


def door_sockets(cfg: AppConfig) -> tuple[list[str], list[str]] | None:
    """The header doors of the brains this Envoy asks (``contract.header_door_socket``): (theirs, brain_failover's).
    None when a brain is reached over TCP, or a door's path would be too long: the header path then asks over gRPC."""
    b, e = cfg.brain, cfg.envoy
    if not cfg.envoy.header_path or not b.grpc_socket or b.protocol != "envoy":
        return None
    mine = _doors([os.path.abspath(b.grpc_socket), *e.brain_endpoints], header_door_socket)
    failover = _doors(list(e.brain_failover), header_door_socket)
    return None if mine is None or failover is None else (mine, failover)


def _doors(endpoints: list[str], door_of: Callable[[str], str | None]) -> list[str] | None:
    """Each brain endpoint's door (``door_of`` its socket path); None if one is over TCP or has none."""
    doors = []
    for ep in endpoints:
        path = ep[len("unix:"):] if ep.startswith("unix:") else ep if ep.startswith("/") else None
        door = door_of(path) if path else None
        if door is None:
            return None
        doors.append(door)
    return doors


def log_door_sockets(cfg: AppConfig) -> list[str] | None:
    """The log doors (``contract.log_door_socket``) of the brains this Envoy logs to. None when a brain is reached
    over TCP, or a door's path would be too long, or with brain_failover (the log follows the decisions there by the
    brains' gRPC health checks): the access log then goes over gRPC."""
    b, e = cfg.brain, cfg.envoy
    if not b.grpc_socket or e.brain_failover or b.protocol != "envoy":
        return None
    return _doors([os.path.abspath(b.grpc_socket), *e.brain_endpoints], log_door_socket)


def brain_door_cluster(cfg: AppConfig) -> dict | None:
    """The brains' header doors (``door_sockets``): HTTP/1.1 over their Unix sockets, health-checked as the brain
    cluster is (a brain not ready answers 503 there: its header calls go on to the body path, which fails open)."""
    doors = door_sockets(cfg)
    if doors is None:
        return None
    mine, failover = doors
    hc, in_flight = cfg.envoy.brain_health_check_interval_s, cfg.envoy.brain_max_in_flight
    return {
        "name": BRAIN_DOOR_CLUSTER,
        "type": "STATIC",
        # a Unix socket connects at once or is refused at once; a timer shorter than the call's fires only when a
        # burst keeps Envoy's loop or the brain's busy, and a connection that fails fails every call pending on the
        # pool with it (1,630 of a 2,000 flood's header calls failed open after 35 such timeouts at 0.25 s)
        "connect_timeout": dur(first_answer_s(cfg)),
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http_protocol_options": {}},
        }},
        # HTTP/1.1: a call in flight is a connection. Never held, so brain_max_in_flight of them at most (the brain's
        # file descriptors); more wait in Envoy for one, within the call's timeout, then go on to the body path
        "circuit_breakers": {"thresholds": [
            {"priority": p, "max_connections": in_flight, "max_requests": in_flight, "max_pending_requests": BIG,
             "max_retries": 0} for p in ("DEFAULT", "HIGH")]},
        "health_checks": [{
            "timeout": dur(max(0.1, hc / 2)),
            "interval": dur(hc),
            "no_traffic_interval": dur(hc),
            "unhealthy_threshold": 2,
            "healthy_threshold": 1,
            "http_health_check": {"path": DOOR_READY_PATH},
        }],
        **({"outlier_detection": refused_brain_ejection(hc)} if len(mine) + len(failover) > 1 else {}),
        "load_assignment": {"cluster_name": BRAIN_DOOR_CLUSTER, "endpoints": [
            {"lb_endpoints": [{"endpoint": {"address": {"pipe": {"path": d}}}} for d in mine]},
            *([{"priority": 1, "lb_endpoints": [{"endpoint": {"address": {"pipe": {"path": d}}}} for d in failover]}]
              if failover else []),
        ]},
    }


def brain_clusters(cfg: AppConfig) -> list[dict]:
    """Every cluster of the brain: its gRPC services, its access log, its header door when it has one."""
    door = brain_door_cluster(cfg)
    return [brain_cluster(cfg), brain_log_cluster(cfg), *([door] if door is not None else [])]


def brain_log_cluster(cfg: AppConfig) -> dict:
    """The brains' log doors where Envoy reaches them by Unix sockets (``log_door_sockets``: plain connections, its
    fluentd logger's), else their gRPC access-log service (``brain_grpc_log_cluster``)."""
    doors = log_door_sockets(cfg)
    if doors is None:
        return brain_grpc_log_cluster(cfg)
    return {
        "name": BRAIN_LOG_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "0.25s",
        "load_assignment": {"cluster_name": BRAIN_LOG_CLUSTER, "endpoints": [
            {"lb_endpoints": [{"endpoint": {"address": {"pipe": {"path": d}}}} for d in doors]}]},
    }


def brain_grpc_log_cluster(cfg: AppConfig) -> dict:
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


def lb_endpoint(r: ReplicaSpec) -> dict:
    ep: dict[str, Any] = {"endpoint": {"address": socket_address(r.host, r.port), "hostname": r.name}}
    if r.tls:
        ep["metadata"] = {"filter_metadata": {"envoy.transport_socket_match": {TLS_MATCH_KEY: r.name}}}
    return ep


def tls_matches(replicas) -> dict:
    """``transport_socket_matches`` for a cluster whose endpoints include https:// replicas: each such endpoint
    gets its own TLS (its SNI, CA and client certificate); the others stay plaintext."""
    matches = [{"name": f"tls-{r.name}", "match": {TLS_MATCH_KEY: r.name},
                "transport_socket": upstream_tls(r.sni, r.tls_ca_file, r.tls_cert_file, r.tls_key_file)}
               for r in replicas if r.tls]
    return {"transport_socket_matches": matches} if matches else {}


def replica_cluster(cfg: AppConfig, r: ReplicaSpec) -> dict:
    others = [o for o in cfg.replicas if o.name != r.name]
    endpoints: list[dict] = [{"priority": 0, "lb_endpoints": [lb_endpoint(r)]}]
    if others:
        endpoints.append({"priority": 1, "lb_endpoints": [lb_endpoint(o) for o in others]})
    all_ip = all(is_ip(x.host) for x in cfg.replicas)
    return {
        "name": r.name,
        "type": "STATIC" if all_ip else "STRICT_DNS",
        "connect_timeout": dur(cfg.envoy.upstream_connect_timeout_s),
        "lb_policy": "LEAST_REQUEST",
        "circuit_breakers": thresholds(),
        "per_connection_buffer_limit_bytes": cfg.envoy.max_body_bytes,
        "load_assignment": {"cluster_name": r.name, "endpoints": endpoints},
        **upstream_http_options(cfg),
        **tls_matches([r, *others]),
    }


def fallback_cluster(cfg: AppConfig) -> dict:
    """Where requests go when the brain does not answer (SPEC C7): bounded-load ring hash over every
    replica, on the session header or the client's address (the route's hash policy)."""
    all_ip = all(is_ip(x.host) for x in cfg.replicas)
    return {
        "name": FALLBACK_CLUSTER,
        "type": "STATIC" if all_ip else "STRICT_DNS",
        "connect_timeout": dur(cfg.envoy.upstream_connect_timeout_s),
        "lb_policy": "RING_HASH",
        "common_lb_config": {"consistent_hashing_lb_config": {
            "hash_balance_factor": cfg.envoy.fail_open_hash_balance_factor}},
        "circuit_breakers": thresholds(),
        "per_connection_buffer_limit_bytes": cfg.envoy.max_body_bytes,
        "load_assignment": {
            "cluster_name": FALLBACK_CLUSTER,
            "endpoints": [{"lb_endpoints": [lb_endpoint(r) for r in cfg.replicas]}],
        },
        **upstream_http_options(cfg),
        **tls_matches(cfg.replicas),
    }


def replica_clusters(cfg: AppConfig) -> list[dict]:
    """The clusters that follow the replica list (static, or in the CDS file)."""
    return [fallback_cluster(cfg), *(replica_cluster(cfg, r) for r in cfg.replicas)]


def clusters(cfg: AppConfig) -> list[dict]:
    return [*brain_clusters(cfg), *replica_clusters(cfg)]
