"""The paste-in pieces alone, merged into a minimal foreign Envoy bootstrap, route correctly."""

from __future__ import annotations

import json
import urllib.request

import pytest

from extproc.envoy_config import snippets
from extproc.tools.stack.local import wait_for

from .conftest import quiet

pytestmark = pytest.mark.integration


def foreign_bootstrap(legacy_port: int) -> dict:
    """What a user might already run: one listener, a /legacy route to their own service, router only."""
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [{
                "name": "main",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "theirs",
                        "route_config": {"virtual_hosts": [{
                            "name": "all", "domains": ["*"],
                            "routes": [{"match": {"prefix": "/legacy"}, "route": {"cluster": "legacy",
                                                                                  "prefix_rewrite": "/v1/models"}}],
                        }]},
                        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
                    },
                }]}],
            }],
            "clusters": [{
                "name": "legacy", "type": "STATIC", "connect_timeout": "1s",
                "load_assignment": {"cluster_name": "legacy", "endpoints": [{"lb_endpoints": [
                    {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1",
                                                                 "port_value": legacy_port}}}}]}]},
            }],
        },
    }


def merge(doc: dict, pieces: dict, replica_clusters: list[dict]) -> dict:
    """The paste-in steps of docs/guide.md, as code."""
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm.setdefault("early_header_mutation_extensions", []).extend(pieces["early_header_mutation_extensions"])
    hcm["http_filters"][:0] = pieces["http_filters"]  # before the router filter
    hcm.setdefault("access_log", []).extend(pieces["access_log"])
    hcm.update(pieces["hcm_access_log_options"])
    hcm["local_reply_config"] = pieces["local_reply_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    for r in routes:  # their own routes keep the brain out of their traffic
        r["typed_per_filter_config"] = pieces["other_routes_typed_per_filter_config"]
    routes.extend(pieces["routes"])  # after their own routes (the last one answers 404 to any other path)
    doc["static_resources"]["clusters"] += [pieces["brain_cluster"], pieces["brain_log_cluster"],
                                            *([pieces["brain_door_cluster"]] if "brain_door_cluster" in pieces else []),
                                            pieces["fallback_cluster"], *replica_clusters]
    return doc


def post(url: str, body: dict, headers: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_snippets_merged_into_a_foreign_bootstrap_route_through_the_brain(own_stack):
    from extproc.envoy_config import replica_cluster

    s = own_stack(3, envoy=False, config={"brain": {"grpc_socket": None}})  # the stack's Unix socket elsewhere
    cfg = s.live_config()
    assert "socket_address" in snippets(cfg)["brain_cluster"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    pieces = snippets(cfg)
    # the template is one replica's cluster; the user repeats it per replica
    assert pieces["replica_cluster_template"] == replica_cluster(cfg, cfg.replicas[0])
    doc = merge(foreign_bootstrap(s.replicas[0].port), pieces, [replica_cluster(cfg, r) for r in cfg.replicas])
    s.start_envoy(doc)
    s.wait_all_live(30)

    with urllib.request.urlopen(s.url + "/legacy", timeout=10) as r:  # their route still works
        assert json.loads(r.read())["object"] == "list"
    served = []
    for i in range(4):
        quiet(s)
        out = post(s.url + "/v1/chat/completions",
                   {"model": "mock-coder-30b", "max_tokens": 4, "messages": [{"role": "user", "content": f"q{i}"}]},
                   {"x-session-id": "foreign-1", "x-warmroute-cluster": "r2"})
        served.append(out["system_fingerprint"])
    assert len(set(served)) == 1  # sticky: the brain decided
    st = s.state()
    assert sum(r["decisions"] for r in st["replicas"]) == 4
    wait_for(lambda: s.state()["open_reservations"] == 0, 10, "releases through the pasted access log")
