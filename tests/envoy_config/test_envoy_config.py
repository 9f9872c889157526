"""The Envoy bootstrap rendered from the config: shipped files match, and each promise is in it."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import pytest

from extproc.config import AppConfig, ConfigError, load_config, parse_config
from extproc.brain.server import GRPC_MAX_MESSAGE
from extproc.contract import (
    BRAIN_CLUSTER,
    FALLBACK_CLUSTER,
    HOLD_FILTER,
    METADATA_NAMESPACE,
    RESERVATION_HEADER,
    ROUTE_FROM_BRAIN_FILTER,
    ROUTING_HEADER,
    log_door_socket,
)
from extproc.envoy_config import bootstrap, extension_of, shipped_files
from extproc.tools.stack.local import envoy_binary

ROOT = Path(__file__).resolve().parents[2]
CFG = load_config(ROOT / "envoy/warmroute.yaml")


def hcm(doc):
    return doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


@pytest.mark.parametrize("path,text", sorted(shipped_files(ROOT).items()))
def test_shipped_envoy_files_are_rendered_from_the_shipped_config(path, text):
    assert (ROOT / path).read_text() == text, f"{path} is stale: run `make envoy-files`"


@pytest.mark.parametrize("path", ["envoy/envoy.yaml", "envoy/compose.envoy.yaml"])
def test_envoy_accepts_the_shipped_bootstrap(path):
    p = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(ROOT / path), "-l", "error"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]


def test_routes_by_the_brain_header_and_fails_open_to_a_bounded_ring_hash_over_all_replicas():
    doc = bootstrap(CFG)
    routes = {r["name"]: r for r in hcm(doc)["route_config"]["virtual_hosts"][0]["routes"]}
    first, second = routes["warmroute_brain_choice"], routes["warmroute_fail_open"]
    assert list(routes).index("warmroute_brain_choice") < list(routes).index("warmroute_fail_open")
    assert first["match"]["headers"][0] == {"name": ROUTING_HEADER, "present_match": True}
    # the brain's own cluster and the fallback are never a routing header's target
    assert first["match"]["headers"][1] == {"name": ROUTING_HEADER, "string_match": {"prefix": "warmroute_"},
                                            "invert_match": True}
    assert first["route"]["cluster_header"] == ROUTING_HEADER
    assert second["route"]["cluster"] == FALLBACK_CLUSTER
    clusters = {c["name"]: c for c in doc["static_resources"]["clusters"]}
    fb = clusters[FALLBACK_CLUSTER]
    # C7: the brain down, cache locality stays: bounded-load ring hash on the session header, else the client
    assert fb["lb_policy"] == "RING_HASH"
    assert fb["common_lb_config"]["consistent_hashing_lb_config"]["hash_balance_factor"] == 150
    hp = second["route"]["hash_policy"]
    assert [h["header"]["header_name"] for h in hp[:-1]] == list(CFG.router.profile.session_headers)
    assert all(h["terminal"] for h in hp[:-1]) and hp[-1] == {"connection_properties": {"source_ip": True}}
    assert len(fb["load_assignment"]["endpoints"][0]["lb_endpoints"]) == len(CFG.replicas)
    ext = extension_of(next(f for f in hcm(doc)["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"))
    assert ext["failure_mode_allow"] is True


def test_headers_only_envoy_or_the_brain_may_set_are_dropped_before_routing():
    names = [f["name"] for f in hcm(bootstrap(CFG))["http_filters"]]
    assert names == ["warmroute.inflate_gzip_requests", "warmroute.inflated_body_limit",
                     "warmroute.header_path", "warmroute.look_whole_body", "warmroute.look_upload_time",
                     "warmroute.look",
                     "warmroute.big_body_model",
                     "envoy.filters.http.ext_proc", HOLD_FILTER, ROUTE_FROM_BRAIN_FILTER, "envoy.filters.http.router"]
    (early,) = hcm(bootstrap(CFG))["early_header_mutation_extensions"]
    removed = {m["remove"] for m in early["typed_config"]["mutations"] if "remove" in m}
    assert removed == {ROUTING_HEADER, RESERVATION_HEADER, "x-request-id", "x-warmroute-tenant", "x-data-parallel-rank",
                       "x-warmroute-inflated-from", "x-warmroute-priority",  # flow control's class (on by default)
                       "x-warmroute-upload-ms", "x-warmroute-declared-length"}
    # a proxy in front that sets the tenant itself: its header is kept
    trusted = parse_config({"envoy": {"trust_downstream_tenant_header": True}})
    (early,) = hcm(bootstrap(trusted))["early_header_mutation_extensions"]
    assert "x-warmroute-tenant" not in {m.get("remove") for m in early["typed_config"]["mutations"]}


def test_only_the_allowed_paths_are_proxied_and_the_rest_get_a_404():
    import re as re_

    cfg = parse_config({"envoy": {"allowed_paths": ["/v1/chat/completions", "/v1/files/*"]}})
    routes = hcm(bootstrap(cfg))["route_config"]["virtual_hosts"][0]["routes"]
    first = routes[0]
    assert first["name"] == "warmroute_not_served" and first["direct_response"]["status"] == 404
    matchers = first["match"]["headers"]
    assert all(m["name"] == ":path" and m["invert_match"] for m in matchers)

    def not_served(path: str) -> bool:  # Envoy ANDs the inverted matchers: outside every entry
        return all(not re_.fullmatch(m["string_match"]["safe_regex"]["regex"], path) for m in matchers)

    assert not not_served("/v1/chat/completions") and not not_served("/v1/chat/completions?x=1")
    assert not not_served("/v1/files/abc")
    for path in ("/metrics", "/v1/chat/completions/render", "/v1/chat/completionsX", "/admin/fault", "/v1/files"):
        assert not_served(path), path
    with pytest.raises(ConfigError, match=r"envoy.allowed_paths\[0\]"):
        parse_config({"envoy": {"allowed_paths": ["v1/no-slash"]}})


def test_one_message_per_request_carries_the_body_and_the_headers_the_brain_reads():
    filters = {f["name"]: extension_of(f) for f in hcm(bootstrap(CFG))["http_filters"]}
    ext = filters["envoy.filters.http.ext_proc"]
    assert ext["processing_mode"]["request_header_mode"] == "SKIP"
    assert ext["processing_mode"]["request_body_mode"] == "BUFFERED"
    attrs = set(ext["request_attributes"])
    for h in (*CFG.router.profile.session_headers, CFG.router.profile.tenant_header, "x-request-id"):
        assert f"request.headers['{h}']" in attrs
    assert ext["metadata_options"]["receiving_namespaces"]["untyped"] == [METADATA_NAMESPACE]
    # the router must not see the headers before the brain has answered
    assert filters[HOLD_FILTER]["max_request_bytes"] >= 32 * 2**20
    copied = {m["append"]["header"]["key"]: m["append"]["header"]["value"]
              for m in filters[ROUTE_FROM_BRAIN_FILTER]["mutations"]["request_mutations"] if "append" in m}
    # the look's upload time is the look's: no replica sees it
    assert {"remove": "x-warmroute-upload-ms"} in filters[ROUTE_FROM_BRAIN_FILTER]["mutations"]["request_mutations"]
    assert copied == {ROUTING_HEADER: f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:cluster)%",
                      RESERVATION_HEADER: f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:reservation)%",
                      # a data-parallel replica's engine, when the brain names one
                      "x-data-parallel-rank": f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:dp_rank)%"}


def test_no_route_timeout_cuts_a_long_generation():
    for route in hcm(bootstrap(CFG))["route_config"]["virtual_hosts"][0]["routes"]:
        if "route" in route:
            assert route["route"]["timeout"] == "0s"  # Envoy's default is 15 s


def test_bodies_of_32_mib_fit_envoy_and_the_grpc_message_limit():
    doc = bootstrap(CFG)
    # a body's limit is the virtual host's; the listener reads in small pieces, each inflated at once (a gzip upload)
    assert doc["static_resources"]["listeners"][0]["per_connection_buffer_limit_bytes"] <= 64 * 1024
    assert hcm(doc)["route_config"]["virtual_hosts"][0]["request_body_buffer_limit"] >= 32 * 2**20
    assert GRPC_MAX_MESSAGE > 32 * 2**20 + 2**20  # the body plus the protobuf envelope


def test_retry_on_another_replica_after_refused_connection_or_reset_before_response():
    doc = bootstrap(CFG)
    rp = next(r for r in hcm(doc)["route_config"]["virtual_hosts"][0]["routes"] if "route"
              in r)["route"]["retry_policy"]
    assert {"connect-failure", "reset"} <= set(rp["retry_on"].split(","))
    assert rp["retry_priority"]["name"] == "envoy.retry_priorities.previous_priorities"
    clusters = {c["name"]: c for c in doc["static_resources"]["clusters"]}
    for r in CFG.replicas:
        eps = clusters[r.name]["load_assignment"]["endpoints"]
        assert [e["priority"] for e in eps] == [0, 1]
        assert [x["endpoint"]["hostname"] for x in eps[0]["lb_endpoints"]] == [r.name]
        assert r.name not in [x["endpoint"]["hostname"] for x in eps[1]["lb_endpoints"]]


def test_admin_interface_is_a_unix_socket_only_its_user_opens():
    """On a loopback TCP port any local user could POST /quitquitquit; a read-only stats port is the scrape target."""
    assert bootstrap(CFG)["admin"]["address"] == {"pipe": {"path": CFG.envoy.admin_path, "mode": 0o600}}
    for shape_cfg in (CFG, parse_config({"replicas": [{"name": "a", "url": "http://10.0.0.1:8000"}],
                                         "brain": {"protocol": "endpoint-picker"}})):
        doc = bootstrap(shape_cfg)
        assert "socket_address" not in doc["admin"]["address"]
    with_stats = bootstrap(parse_config({"envoy": {"stats_port": 9901}}))
    stats = next(ls for ls in with_stats["static_resources"]["listeners"] if ls["name"] == "warmroute_stats")
    routes = stats["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    assert routes[0]["match"]["path"] == "/stats/prometheus" and "direct_response" in routes[-1]
    with pytest.raises(ConfigError, match=r"^envoy\.admin_port: "):
        parse_config({"envoy": {"admin_port": 9901}})


def test_the_brain_is_health_checked_with_grpc_health_v1_and_logs_reach_it():
    doc = bootstrap(CFG)
    brain = next(c for c in doc["static_resources"]["clusters"] if c["name"] == BRAIN_CLUSTER)
    assert "grpc_health_check" in brain["health_checks"][0]
    # by the brain's Unix socket: the entries go to its log door, beside that socket, on connections of their own
    log_door = hcm(doc)["access_log"][0]["typed_config"]
    assert log_door["cluster"] == "warmroute_brain_log" and log_door["record"]["res"] == f"%REQ({RESERVATION_HEADER})%"
    log = next(c for c in doc["static_resources"]["clusters"] if c["name"] == "warmroute_brain_log")
    [door] = log["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert door["endpoint"]["address"]["pipe"]["path"] == log_door_socket(os.path.abspath(CFG.brain.grpc_socket))
    # over TCP: the gRPC access-log service, on a connection of its own (bodies on the ext_proc one made Envoy drop
    # entries)
    tcp = bootstrap(dataclasses.replace(CFG, brain=dataclasses.replace(CFG.brain, grpc_socket=None, grpc_port=9100)))
    brain = next(c for c in tcp["static_resources"]["clusters"] if c["name"] == BRAIN_CLUSTER)
    als = hcm(tcp)["access_log"][0]["typed_config"]
    assert als["common_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] == "warmroute_brain_log"
    log = next(c for c in tcp["static_resources"]["clusters"] if c["name"] == "warmroute_brain_log")
    assert log["load_assignment"]["endpoints"] == brain["load_assignment"]["endpoints"]
    assert RESERVATION_HEADER in als["additional_request_headers_to_log"]


def test_a_brain_that_refuses_a_connection_is_passed_over_at_once_where_another_brain_can_be_asked():
    """Outlier detection on the brains' clusters (decisions, header doors, log stream) with other brains to ask: the
    first refused connection ejects, and only connection failures count (never the brain's own answers)."""
    from extproc.contract import BRAIN_DOOR_CLUSTER, BRAIN_LOG_CLUSTER

    sock = dataclasses.replace(CFG, brain=dataclasses.replace(CFG.brain, grpc_socket="/run/a/brain.sock"))
    pair = dataclasses.replace(sock, envoy=dataclasses.replace(sock.envoy, brain_failover=("unix:/run/b/brain.sock",)))
    clusters = {c["name"]: c for c in bootstrap(pair)["static_resources"]["clusters"]}
    for name in (BRAIN_CLUSTER, BRAIN_DOOR_CLUSTER, BRAIN_LOG_CLUSTER):
        od = clusters[name]["outlier_detection"]
        assert od["split_external_local_origin_errors"] and od["consecutive_local_origin_failure"] == 1, name
        assert od["enforcing_consecutive_local_origin_failure"] == 100 and od["max_ejection_percent"] == 100
        assert not any(v for k, v in od.items() if k.startswith("enforcing_") and "local_origin_failure" not in k)
    # one brain alone: nobody else to ask, so no ejection (Envoy would route to it in panic anyway)
    alone = {c["name"]: c for c in bootstrap(sock)["static_resources"]["clusters"]}
    assert not any("outlier_detection" in c for c in alone.values())


def test_hostnames_render_as_dns_clusters():
    from extproc.config import parse_config

    cfg = parse_config({"replicas": [{"name": "a", "url": "http://vllm-a:8000"}], "brain": {"host": "brain",
                                                                                            "grpc_socket": None,
                                                                                            "grpc_port": 9100,
                                                                                            "insecure": True}})
    clusters = {c["name"]: c for c in bootstrap(cfg)["static_resources"]["clusters"]}
    assert clusters["a"]["type"] == "STRICT_DNS" and clusters[BRAIN_CLUSTER]["type"] == "STRICT_DNS"
    assert bootstrap(AppConfig())["static_resources"]["clusters"][0]["name"] == BRAIN_CLUSTER


def test_a_body_too_big_to_copy_to_the_brain_sends_it_the_headers_only():
    cfg = parse_config({"envoy": {"brain_body_max_bytes": 4096}})
    routes = hcm(bootstrap(cfg))["route_config"]["virtual_hosts"][0]["routes"]
    names = [r["name"] for r in routes]
    # after the brain's answer, before the fail-open route
    assert names.index("warmroute_brain_choice") < names.index("warmroute_big_body") < names.index("warmroute_fail_open")
    big = next(r for r in routes if r["name"] == "warmroute_big_body")
    assert big["match"]["headers"] == [{"name": "content-length", "range_match": {"start": 4097, "end": 2**62}}]
    mode = big["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["overrides"]["processing_mode"]
    assert mode["request_header_mode"] == "SEND" and mode["request_body_mode"] == "NONE"
    assert big["route"] == next(r for r in routes if r["name"] == "warmroute_fail_open")["route"]


# ------------------------------------------------------------------ the endpoint-picker shape

PICKER_CFG = {"replicas": [{"name": f"r{i}", "url": f"http://10.0.0.{i + 5}:8000"} for i in range(3)],
              "brain": {"protocol": "endpoint-picker", "grpc_socket": "/tmp/wr-test/brain.sock"}}


def picker_doc(**envoy):
    return bootstrap(parse_config({**PICKER_CFG, "envoy": envoy}))


def ext_proc_of(doc):
    return extension_of(next(f for f in hcm(doc)["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"))


@pytest.mark.parametrize("mode", ["buffered", "full-duplex"])
def test_envoy_accepts_the_picker_shape(mode, tmp_path):
    from extproc.envoy_config import dump

    path = tmp_path / "envoy.yaml"
    path.write_text(dump(picker_doc(picker_body_mode=mode)))
    p = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "-l", "error"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]


def test_the_picker_shape_routes_by_override_host_with_a_bounded_ring_hash_fallback():
    from extproc.contract import DESTINATION_HEADER, DESTINATION_NAMESPACE, PICKER_CLUSTER

    doc = picker_doc()
    (pool,) = [c for c in doc["static_resources"]["clusters"] if c["name"] == PICKER_CLUSTER]
    policy = pool["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    sources = policy["typed_config"]["override_host_sources"]
    assert sources[0] == {"metadata": {"key": DESTINATION_NAMESPACE, "path": [{"key": DESTINATION_HEADER}]}}
    fallback = policy["typed_config"]["fallback_policy"]["policies"][0]["typed_extension_config"]
    assert fallback["typed_config"]["consistent_hashing_lb_config"]["hash_balance_factor"] == 150
    hosts = [e["endpoint"]["address"]["socket_address"]["address"] for e
             in pool["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert hosts == ["10.0.0.5", "10.0.0.6", "10.0.0.7"]
    route = hcm(doc)["route_config"]["virtual_hosts"][0]["routes"][-1]["route"]
    assert route["cluster"] == PICKER_CLUSTER and route["timeout"] == "0s"
    assert route["hash_policy"][0] == {"header": {"header_name": "x-session-id"}, "terminal": True}
    # a client cannot pick its replica while the brain is away: its own destination header is dropped
    removed = hcm(doc)["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    assert {"remove": DESTINATION_HEADER} in removed
    # no access log to the brain: it releases from the response it sees
    assert "access_log" not in hcm(doc)


def test_the_picker_shapes_body_modes():
    buffered = ext_proc_of(picker_doc())["processing_mode"]
    duplex = ext_proc_of(picker_doc(picker_body_mode="full-duplex"))["processing_mode"]
    assert (buffered["request_body_mode"], buffered["response_body_mode"]) == ("BUFFERED", "STREAMED")
    assert (duplex["request_body_mode"], duplex["response_body_mode"]) == ("FULL_DUPLEX_STREAMED",
                                                                           "FULL_DUPLEX_STREAMED")
    assert duplex["request_trailer_mode"] == duplex["response_trailer_mode"] == "SEND"  # Envoy requires it
    for p in (buffered, duplex):
        assert p["request_header_mode"] == p["response_header_mode"] == "SEND"
    assert ext_proc_of(picker_doc())["failure_mode_allow"] is True
    with pytest.raises(ConfigError, match="^envoy.picker_body_mode:"):
        picker_doc(picker_body_mode="streamed")


def test_the_picker_shapes_brain_cluster_has_no_panic_routing():
    (brain,) = [c for c in picker_doc()["static_resources"]["clusters"] if c["name"] == BRAIN_CLUSTER]
    assert brain["common_lb_config"]["healthy_panic_threshold"] == {"value": 0.0}
    assert brain["health_checks"][0]["no_traffic_interval"] == brain["health_checks"][0]["interval"]


def test_a_shape_the_brain_does_not_speak_is_refused():
    with pytest.raises(ConfigError, match="^brain.protocol: --mode endpoint-picker needs"):
        bootstrap(CFG, "endpoint-picker")
    with pytest.raises(ConfigError, match="^brain.protocol: this brain speaks endpoint-picker"):
        bootstrap(parse_config(PICKER_CFG), "envoy")


def test_dns_discovery_renders_a_pool_envoy_resolves_itself():
    from extproc.contract import PICKER_CLUSTER

    cfg = parse_config({"brain": PICKER_CFG["brain"], "discovery": {"source": "dns", "dns_name": "vllm-headless",
                                                                    "port": 8000, "interval_s": 5}})
    (pool,) = [c for c in bootstrap(cfg)["static_resources"]["clusters"] if c["name"] == PICKER_CLUSTER]
    assert pool["type"] == "STRICT_DNS" and pool["dns_refresh_rate"] == "5.000s"
    addr = pool["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert (addr["address"], addr["port_value"]) == ("vllm-headless", 8000)
    k8s = parse_config({"brain": PICKER_CFG["brain"], "discovery": {"source": "kubernetes", "inference_pool": "p"}})
    with pytest.raises(ConfigError, match="^envoy.cds_path:"):
        bootstrap(k8s)


def test_the_header_path_asks_at_the_door_only_where_every_brain_is_reached_by_a_socket():
    """ext_authz to the brain's header door beside its Unix socket; an ext_proc call wherever a brain is reached over
    TCP (its door has no TLS), or a door's path would not fit a socket. The per-route switch-off matches the filter."""
    import dataclasses

    from extproc.contract import BRAIN_DOOR_CLUSTER, HEADER_PATH_FILTER

    def shape(cfg):
        doc = bootstrap(cfg)
        (f,) = [f for f in hcm(doc)["http_filters"] if f["name"] == HEADER_PATH_FILTER]
        kind = extension_of(f)["@type"].rsplit(".", 1)[1]
        clusters = {c["name"]: c for c in doc["static_resources"]["clusters"]}
        off = {r.get("name"): r.get("typed_per_filter_config", {}).get(HEADER_PATH_FILTER, {}).get("@type", "")
               for vh in hcm(doc)["route_config"]["virtual_hosts"] for r in vh["routes"]}
        return kind, clusters.get(BRAIN_DOOR_CLUSTER), off["warmroute_not_served"].rsplit(".", 1)[1]

    sock = dataclasses.replace(CFG, brain=dataclasses.replace(CFG.brain, grpc_socket="/run/warmroute/brain.sock"))
    kind, door, off = shape(sock)
    assert kind == "ExtAuthz" and off == "ExtAuthzPerRoute"
    path = door["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["pipe"]["path"]
    assert path == "/run/warmroute/brain.headers.sock"
    tcp_peer = dataclasses.replace(sock, envoy=dataclasses.replace(sock.envoy, brain_endpoints=("10.0.0.2:9100",)))
    too_long = dataclasses.replace(sock, brain=dataclasses.replace(sock.brain, grpc_socket="/" + "d" * 96 + "/b.sock"))
    tcp = dataclasses.replace(sock, brain=dataclasses.replace(sock.brain, grpc_socket=None, grpc_port=9100,
                                                               insecure=True))
    for cfg in (tcp_peer, too_long, tcp):
        assert shape(cfg) == ("ExternalProcessor", None, "ExtProcPerRoute")
