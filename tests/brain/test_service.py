"""The brain's shell logic without a network: ext_proc answers, access-log entries, metric parsing."""

from __future__ import annotations

import re

import orjson
import pytest
from envoy.data.accesslog.v3 import accesslog_pb2 as al
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from extproc.brain.release import entry_of_proto
from extproc.config import ConfigError, parse_config
from extproc.contract import METADATA_NAMESPACE, RESERVATION_HEADER, ROUTING_HEADER
from extproc.brain.brain import Brain
from extproc.brain.decide import headers_from_attributes
from extproc.brain.scraper import parse_vllm_metrics
from extproc.brain.server import claim_socket_path

from ..helpers import envoy_decide, live_brain

CFG = parse_config({"replicas": [{"name": f"r{i}", "url": f"http://127.0.0.1:{8001 + i}"} for i in range(3)]})
BODY = orjson.dumps({"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]})


@pytest.fixture
def brain():
    return live_brain(CFG)


def headers_of(out: ep.ProcessingResponse) -> dict[str, str]:
    """The routing and reservation headers Envoy ends up with (from the metadata, as route_from_brain copies it)."""
    answer = out.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields
    return {ROUTING_HEADER: answer["cluster"].string_value, RESERVATION_HEADER: answer["reservation"].string_value}


def entry(request_id="", reservation="", code=200, details="via_upstream", upstream=None, attempts=1, **flags):
    """An access-log entry as the brain reads it, made from Envoy's gRPC one (``proto_entry``)."""
    return entry_of_proto(proto_entry(request_id, reservation, code, details, upstream, attempts, **flags))


def proto_entry(request_id="", reservation="", code=200, details="via_upstream", upstream=None, attempts=1, **flags):
    e = al.HTTPAccessLogEntry()
    e.request.request_id = request_id
    if reservation:
        e.request.request_headers[RESERVATION_HEADER] = reservation
    e.response.response_code.value = code
    e.response.response_code_details = details
    if upstream:
        e.common_properties.upstream_remote_address.socket_address.address = "127.0.0.1"
        e.common_properties.upstream_remote_address.socket_address.port_value = upstream
    e.common_properties.upstream_request_attempt_count = attempts
    for k, v in flags.items():
        setattr(e.common_properties.response_flags, k, v)
    return e


def port_of(name: str) -> int:
    return 8001 + int(name[1:])


def test_decide_answers_with_metadata_and_headers_and_clears_the_route_cache(brain):
    out = envoy_decide(brain, {"x-session-id": "s", "x-request-id": "q1"}, BODY)
    h = headers_of(out)
    assert h[ROUTING_HEADER] in ("r0", "r1", "r2")
    # <number>.<64 random bits>: nobody who was not handed it can name it
    assert re.fullmatch(r"\d+\.[0-9a-f]{16}", h[RESERVATION_HEADER])
    common = out.request_body.response
    assert common.clear_route_cache is True
    # the same answer as header mutations, for configs that send the headers message
    assert {m.header.key: m.header.raw_value.decode() for m in common.header_mutation.set_headers} == h


def test_a_bodyless_request_is_answered_in_the_headers_phase(brain):
    out = envoy_decide(brain, {"x-session-id": "s"}, None, "request_headers")
    assert out.WhichOneof("response") == "request_headers"
    assert headers_of(out)[ROUTING_HEADER] in ("r0", "r1", "r2")


def test_headers_sent_as_attributes_are_read_by_name():
    req = ep.ProcessingRequest()
    attrs = req.attributes["envoy.filters.http.ext_proc"].fields
    attrs["request.headers['x-session-id']"].string_value = "s-1"
    attrs["request.headers['X-Warmroute-Tenant']"].string_value = "acme"
    attrs["request.path"].string_value = "/v1/chat/completions"  # not a header
    assert headers_from_attributes(req) == {"x-session-id": "s-1", "x-warmroute-tenant": "acme"}


def test_the_access_log_releases_the_reservation_named_in_the_entry(brain):
    h = headers_of(envoy_decide(brain, {"x-request-id": "q1"}, BODY))
    assert brain.router.open_reservations == 1
    brain.on_log_entry(entry("q1", h[RESERVATION_HEADER], upstream=port_of(h[ROUTING_HEADER])))
    assert brain.router.open_reservations == 0
    brain.on_log_entry(entry("q1", h[RESERVATION_HEADER]))  # a duplicate entry changes nothing
    assert brain.stats.releases_by_log == 1


def test_a_request_reset_before_envoy_applied_our_header_is_released_by_its_request_id(brain):
    envoy_decide(brain, {"x-request-id": "q-reset"}, BODY)
    brain.on_log_entry(entry("q-reset", "", code=0, details="downstream_remote_disconnect",
                             downstream_remote_reset=True))
    assert brain.router.open_reservations == 0
    assert not brain.ledger.by_request_id


def test_a_reservation_id_from_an_earlier_brain_releases_nothing(brain):
    envoy_decide(brain, {"x-request-id": "q2"}, BODY)
    brain.on_log_entry(entry("other-request", "deadbeef.1"))
    assert brain.router.open_reservations == 1


@pytest.mark.parametrize(
    "kw,failed",
    [
        ({"code": 200}, False),
        ({"code": 503}, True),  # 5xx from the replica
        ({"code": 503, "details": "upstream_reset_before_response_started"}, False),  # Envoy's own, flags decide
        ({"code": 503, "details": "x", "upstream_connection_failure": True}, True),
        ({"code": 200, "upstream_remote_reset": True}, True),
        # the client left: not the replica's fault
        ({"code": 0, "details": "x", "downstream_remote_reset": True}, False),
        ({"code": 400}, False),
    ],
)
def test_passive_health_from_the_access_log_feeds_the_upstream_failure_rule(brain, kw, failed):
    h = headers_of(envoy_decide(brain, {"x-request-id": "q"}, BODY))
    name = h[ROUTING_HEADER]
    for _ in range(3):  # SPEC B: 3 consecutive failures eject
        brain.on_log_entry(entry("", "", upstream=port_of(name), **kw))
    assert (brain.router.replica(name).state.value == "EJECTED") is failed


@pytest.mark.parametrize(
    "kw,answered",
    [
        ({"code": 200}, True),
        ({"code": 400}, True),  # the request's fault, but the replica answered it
        ({"code": 503}, False),  # its failure
        ({"code": 0, "details": "x", "downstream_remote_reset": True}, False),  # the client gave up before any answer
    ],
)
def test_B_only_an_answer_from_the_replica_shows_it_busy_not_dead_to_the_stale_scrape_rule(brain, kw, answered):
    """A client that gave up on a hung replica is no failure of it, but no answer either: counted as one, clients
    timing out on a replica that answers nothing would keep it LIVE past the stale scrape rule for ever."""
    name = "r1"
    h = brain.router.replica(name).health
    before = h.served_at
    brain.on_log_entry(entry("", "", upstream=port_of(name), **kw))
    assert (h.served_at > before) is answered


@pytest.mark.parametrize("failed,first_byte_s,answered", [(False, 0.2, True), (False, None, False), (True, 0.2, False),
                                                         (None, 0.2, False)])
def test_B_the_endpoint_picker_s_end_of_a_response_shows_its_replica_busy_only_when_it_answered(brain, failed,
                                                                                            first_byte_s, answered):
    """The picker front sees the response itself (``Releaser.finish``): a first byte and no failure is an answer."""
    h = headers_of(envoy_decide(brain, {"x-request-id": "q"}, BODY))
    res = brain.router.reservation(int(h[RESERVATION_HEADER].partition(".")[0]))
    health = res.replica.health
    before = health.served_at
    brain.releaser.finish(res, None, failed, first_byte_s)
    assert (health.served_at > before) is answered and brain.router.open_reservations == 0


def test_a_retry_elsewhere_counts_against_the_chosen_replica(brain):
    h = headers_of(envoy_decide(brain, {"x-request-id": "q"}, BODY))
    chosen = h[ROUTING_HEADER]
    other = next(n for n in ("r0", "r1", "r2") if n != chosen)
    brain.on_log_entry(entry("q", h[RESERVATION_HEADER], upstream=port_of(other), attempts=2))
    assert brain.router.replica(chosen).health.upstream_failures == 1  # it refused or reset
    assert brain.router.replica(other).health.upstream_failures == 0  # it answered
    assert brain.router.open_reservations == 0


def test_no_healthy_instances_is_an_immediate_503_with_json_and_retry_after():
    b = Brain(parse_config({}))
    out = envoy_decide(b, {}, BODY)
    assert isinstance(out, ep.ProcessingResponse)
    imm = out.immediate_response
    assert imm.status.code == 503
    hdrs = {h.header.key: h.header.raw_value.decode() for h in imm.headers.set_headers}
    assert hdrs["retry-after"] and hdrs["content-type"] == "application/json"
    assert orjson.loads(imm.body)["error"]["code"] == "no_healthy_instances"


VLLM_NEW = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
"""
VLLM_OLD = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 4.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 2.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
"""


@pytest.mark.parametrize(
    "text,ok,running,waiting,kv",
    [
        (VLLM_NEW, True, 5, 1, 0.75),  # summed over label sets; KV shows the fullest engine
        (VLLM_OLD, True, 4, 2, 0.25),  # the older gpu_cache_usage_perc name
        ("# nothing here\n", False, 0, 0, 0.0),
        ("vllm:num_requests_running{ 3", False, 0, 0, 0.0),
    ],
)
def test_the_scraper_parses_vllm_metrics(text, ok, running, waiting, kv):
    r = parse_vllm_metrics(text)
    assert (r.ok, r.running, r.waiting, r.kv_usage) == (ok, running, waiting, kv)


def test_structured_logs_one_json_line_per_state_change_and_rebind_never_prompt_text(brain, caplog):
    import json as _json
    import logging

    secret = "TOP-SECRET-PROMPT"
    body = orjson.dumps({"messages": [{"role": "system", "content": secret}, {"role": "user", "content": secret}]})
    with caplog.at_level(logging.INFO, logger="warmroute"):
        h = headers_of(envoy_decide(brain, {"x-session-id": "user-42"}, body))
        brain.router.on_scrape(h[ROUTING_HEADER], False, 2000.0)  # LIVE -> EJECTED
        envoy_decide(brain, {"x-session-id": "user-42"}, body)  # the pin to the dead replica rebinds
    lines = [_json.loads(r.getMessage()) for r in caplog.records]
    events = [x["event"] for x in lines]
    assert "state_change" in events and "pin_change" in events
    assert next(x for x in lines if x["event"] == "pin_change")["action"] == "rebind"
    change = next(x for x in lines if x["event"] == "state_change")
    assert (change["old"], change["new"], change["reason"]) == ("LIVE", "EJECTED", "scrape_failed")
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert secret not in text and "user-42" not in text  # keys are hashes; prompts never leave the profile


def test_a_stale_socket_file_is_reclaimed_but_a_live_one_or_a_plain_file_is_not(tmp_path):
    import socket

    path = str(tmp_path / "brain.sock")
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(path)
    live.listen(1)
    with pytest.raises(ConfigError, match="another process serves"):
        claim_socket_path(path)
    live.close()  # the file stays, nobody listens: what a killed brain leaves
    assert claim_socket_path(path) == path
    assert not (tmp_path / "brain.sock").exists()
    (tmp_path / "plain").write_text("x")
    with pytest.raises(ConfigError, match="not a socket"):
        claim_socket_path(str(tmp_path / "plain"))


def test_a_reload_that_changes_the_headers_envoy_must_send_says_envoy_is_stale(tmp_path):
    import yaml

    path = tmp_path / "warmroute.yaml"
    doc = {"replicas": [{"name": "r0", "url": "http://127.0.0.1:8001"}]}
    path.write_text(yaml.safe_dump(doc))
    from extproc.config import load_config

    b = Brain(load_config(path), config_path=str(path))
    doc["pins"] = {"session_ttl_s": 60}  # thresholds change at once, Envoy unaffected
    path.write_text(yaml.safe_dump(doc))
    assert "envoy_config_stale" not in b.reload()
    doc["profile"] = {"session_headers": ["x-agent-session"]}
    path.write_text(yaml.safe_dump(doc))
    info = b.reload()
    assert "restart Envoy" in info["envoy_config_stale"]
    assert b.cfg.router.profile.session_headers == ("x-agent-session",)
    assert "restart_needed" not in info


def test_a_reload_keeps_the_running_brains_shared_state_and_says_a_restart_applies_it(tmp_path):
    import yaml

    from extproc.config import load_config

    path = tmp_path / "warmroute.yaml"
    doc = {"replicas": [{"name": "r0", "url": "http://127.0.0.1:8001"}], "pins": {"session_ttl_s": 60}}
    path.write_text(yaml.safe_dump(doc))
    b = Brain(load_config(path), config_path=str(path))
    doc["shared_state"] = {"redis_url": "redis://127.0.0.1:6390/0"}
    doc["pins"] = {"session_ttl_s": 90}
    path.write_text(yaml.safe_dump(doc))
    info = b.reload()
    assert "shared_state" in info["restart_needed"]
    assert b.cfg.shared_state.redis_url is None and b.router.outbox is None  # still alone
    assert b.cfg.router.pins.session_ttl_s == 90  # the rest applied
    doc["flow_control"] = {"enabled": False}  # the same for flow control: its queue and Envoy's timer are rendered
    path.write_text(yaml.safe_dump(doc))
    info = b.reload()
    assert "flow_control" in info["restart_needed"] and b.router.flow is not None and b.cfg.flow_control.enabled


def test_every_pin_action_has_a_metric_family_and_every_series_starts_at_zero():
    from prometheus_client import generate_latest

    from extproc.brain.metrics import PIN_ACTION_METRICS
    from extproc.core import BodyStatus, PinAction

    assert set(PIN_ACTION_METRICS) == set(PinAction)
    text = generate_latest(Brain(CFG).registry).decode()
    for status in BodyStatus:
        assert f'warmroute_request_bodies_total{{status="{status}"}} 0.0' in text
    assert 'warmroute_rebinds_total{cause="cost",kind="session"} 0.0' in text
    for call in ("body", "header", "look", "door"):  # an alert on their increase needs the series before any fault
        assert f'warmroute_call_faults_total{{call="{call}"}} 0.0' in text


def test_bodies_are_counted_by_status_so_header_only_routing_is_visible(brain):
    from prometheus_client import generate_latest

    envoy_decide(brain, {"x-session-id": "a"}, b"{not json")
    envoy_decide(brain, {"x-session-id": "b"}, BODY)
    envoy_decide(brain, {"x-session-id": "c"}, None, "request_headers")
    text = generate_latest(brain.registry).decode()
    assert 'warmroute_request_bodies_total{status="not_json"} 1.0' in text
    assert 'warmroute_request_bodies_total{status="ok"} 1.0' in text
    assert 'warmroute_request_bodies_total{status="absent"} 1.0' in text
    assert brain.state()["bodies"] == {"absent": 1, "not_json": 1, "ok": 1}


def test_an_access_log_entry_that_names_nothing_we_know_is_counted(brain):
    brain.on_log_entry(entry(request_id="never-seen", code=404, details="route_not_found"))
    assert brain.stats.unmatched_log_entries == 1
    assert brain.state()["unmatched_access_log_entries"] == 1


def test_a_reload_that_would_leave_no_replica_is_refused_and_the_old_config_kept(tmp_path):
    import yaml

    from extproc.config import load_config

    path = tmp_path / "warmroute.yaml"
    path.write_text(yaml.safe_dump({"replicas": [{"name": "r0", "url": "http://127.0.0.1:8001"}]}))
    b = Brain(load_config(path), config_path=str(path))
    for half_written in ("", "replicas: []\n"):
        path.write_text(half_written)
        with pytest.raises(ConfigError, match="allow_no_replicas"):
            b.reload()
        assert [r.name for r in b.router.replicas] == ["r0"] and len(b.cfg.replicas) == 1
    path.write_text("replicas: []\nallow_no_replicas: true\n")  # on purpose
    assert b.reload()["removed"] == ["r0"] and not b.router.replicas


def test_a_response_the_replica_cut_off_after_it_started_counts_as_an_upstream_failure(brain):
    out = envoy_decide(brain, {"x-session-id": "cut"}, BODY)
    name = headers_of(out)[ROUTING_HEADER]
    for k in range(3):  # 3 consecutive upstream failures eject a LIVE replica (B)
        out = envoy_decide(brain, {"x-session-id": "cut"}, BODY) if k else out
        h = headers_of(out)
        assert h[ROUTING_HEADER] == name  # the session stays while its replica is LIVE
        brain.on_log_entry(entry(reservation=h[RESERVATION_HEADER], code=200, upstream=port_of(name),
                                 details="upstream_reset_after_response_started{protocol_error}"))
    assert brain.router.replica(name).state.value == "EJECTED"


def test_two_open_requests_with_the_same_request_id_never_release_each_other(brain):
    """A pasted-in Envoy config may keep clients' x-request-id: a shared id backs up neither reservation."""
    h1 = headers_of(envoy_decide(brain, {"x-request-id": "dup"}, BODY))
    h2 = headers_of(envoy_decide(brain, {"x-request-id": "dup"}, BODY))
    assert brain.router.open_reservations == 2
    # the second request reset before Envoy applied our header: its entry names only the shared id
    brain.on_log_entry(entry("dup", "", code=0, details="downstream_remote_disconnect", downstream_remote_reset=True))
    assert brain.router.open_reservations == 2  # neither released: the id could be either request's
    # each request's own entry still releases its own reservation, once
    brain.on_log_entry(entry("dup", h1[RESERVATION_HEADER], upstream=port_of(h1[ROUTING_HEADER])))
    brain.on_log_entry(entry("dup", h2[RESERVATION_HEADER], upstream=port_of(h2[ROUTING_HEADER])))
    assert brain.router.open_reservations == 0 and brain.stats.releases_by_log == 2
    brain.ledger.forget_released()
    assert not brain.ledger.by_request_id


@pytest.mark.parametrize("source", ["header", "credential", "none"])
def test_the_tenant_comes_only_from_its_configured_source(source):
    """A client naming another tenant in a header must not share that tenant's keys unless the header is
    the trusted source (which Envoy strips from clients, tests/integration/test_envoy_stack.py)."""
    from extproc.core.config import ProfileConfig
    from extproc.core.profile import build_profile

    cfg = ProfileConfig(tenant_source=source)
    body = orjson.dumps({"messages": [{"role": "system", "content": "shared"}, {"role": "user", "content": "q"}]})

    def key(**h):
        return build_profile({"x-session-id": "s1", **h}, body, cfg).session_key

    victim = key(**{"x-warmroute-tenant": "victim", "authorization": "Bearer victim-key"})
    attacker = key(**{"x-warmroute-tenant": "victim", "authorization": "Bearer attacker-key"})
    no_tenant = key()
    if source == "header":
        assert victim == attacker != no_tenant  # the header is trusted: Envoy must strip clients' copies
    elif source == "credential":
        assert victim != attacker and victim != no_tenant  # the key the client proved, not the header it sent
        assert key(authorization="Bearer victim-key") == victim  # the header is ignored
    else:
        assert victim == attacker == no_tenant


def test_a_credential_is_never_kept_or_logged_only_its_hash():
    from extproc.core.config import ProfileConfig
    from extproc.core.profile import tenant_of

    t = tenant_of({"authorization": "Bearer sk-secret-123"}, ProfileConfig(tenant_source="credential"))
    assert t.startswith("credential:") and "sk-secret" not in t


def test_when_every_access_log_stream_closes_the_open_reservations_are_released_once(brain):
    h1 = headers_of(envoy_decide(brain, {"x-request-id": "a"}, BODY))
    envoy_decide(brain, {"x-request-id": "b"}, BODY)
    brain.envoy.opened()
    brain.envoy.opened()  # two Envoy workers
    assert brain.envoy.closed() == 0 and brain.router.open_reservations == 2  # one worker's stream reset: Envoy lives
    assert brain.envoy.closed() == 2 and brain.router.open_reservations == 0  # the last one: Envoy is gone
    # an entry that still arrives (a new stream of the same Envoy) releases nothing a second time
    brain.on_log_entry(entry("a", h1[RESERVATION_HEADER], upstream=port_of(h1[ROUTING_HEADER])))
    assert brain.stats.releases_by_log == 0 and brain.stats.released_envoy_gone == 2
    assert not brain.ledger.by_request_id
    # reservations made after the streams closed (a new Envoy, before its first entry) are not touched
    envoy_decide(brain, {"x-request-id": "c"}, BODY)
    brain.envoy.opened()
    assert brain.router.open_reservations == 1


def test_the_headers_of_a_body_too_big_to_send_are_decided_at_once_by_size():
    import asyncio

    from extproc.brain.decide import ExternalProcessor
    from extproc.core.names import BodyStatus

    b = Brain(CFG)
    seen = []

    def decide(headers, body, phase):
        seen.append((dict(headers), body, phase))
        return b.decide(headers, body, phase)

    def headers_msg(**h):
        req = ep.ProcessingRequest()
        for k, v in h.items():
            req.request_headers.headers.headers.add(key=k, raw_value=v.encode())
        return req

    class Ctx:
        def __init__(self, msgs):
            self.msgs, self.out = list(msgs), []

        async def read(self):
            import grpc
            return self.msgs.pop(0) if self.msgs else grpc.aio.EOF

        async def write(self, m):
            self.out.append(m)

    big = Ctx([headers_msg(**{"content-length": str(5 * 2**20), "x-session-id": "s"})])
    asyncio.run(ExternalProcessor(decide, 2 * 2**20).Process(None, big))
    assert len(big.out) == 1 and big.out[0].WhichOneof("response") == "request_headers"
    assert seen[-1][1] is None and seen[-1][2] == "request_headers"
    assert b.stats.bodies[BodyStatus.HEADERS_ONLY] == 1
    # a small body in the two-message mode waits for its body
    small = Ctx([headers_msg(**{"content-length": "100"})])
    asyncio.run(ExternalProcessor(decide, 2 * 2**20).Process(None, small))
    assert small.out[0].WhichOneof("response") == "request_headers" and len(seen) == 1  # a pass, no decision


def test_pin_changes_are_logged_once_per_kind_per_window_then_summarised(caplog):
    import json as _json
    import logging

    from extproc.brain.logs import Summarised

    s = Summarised("pin_change", window_s=10.0)
    with caplog.at_level(logging.INFO, logger="warmroute"):
        for i in range(500):
            s.add(100.0 + i * 0.01, ("unpin", "prefix", "spills", "r1"), action="unpin", replica="r1")
        s.add(101.0, ("rebind", "session", "dead", "r2"), action="rebind", replica="r2")
        s.flush(109.0)  # the window is still open
        s.flush(110.5)
    lines = [_json.loads(r.getMessage()) for r in caplog.records]
    assert [x["event"] for x in lines] == ["pin_change", "pin_change", "pin_change_summary"]
    assert lines[2]["not_logged_one_by_one"] == {"unpin/prefix/spills/r1": 499}


def test_behind_a_burst_the_brain_extends_envoy_s_timer_before_it_decides():
    """Issue 43: a call Envoy's 1 s timer gave up on failed open into the engines. Read while more than BEHIND calls
    are open, a call's first answer is the timer's extension, then the decision; an ordinary call gets the decision
    alone."""
    import asyncio

    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    from extproc.brain import decide as dc

    from extproc.answers import Placed

    placed = Placed("r0", "1.abc")
    decided = dc.envoy_answer(placed, "request_body")

    class Ctx:
        def __init__(self):
            self.msgs = [ep.ProcessingRequest(request_body=ep.HttpBody(body=b"{}", end_of_stream=True))]
            self.written = []

        async def read(self):
            return self.msgs.pop(0) if self.msgs else grpc.aio.EOF

        async def write(self, m):
            self.written.append(m)

    def run(open_before: int, hold_s: float) -> list:
        front = dc.ExternalProcessor(lambda h, b, phase: placed, 2 * 2**20, hold_s=hold_s)
        front.open_calls = open_before  # calls of the burst read before this one, not yet answered
        ctx = Ctx()
        asyncio.run(front.Process(None, ctx))
        return ctx.written

    burst = run(dc.BEHIND, 35.0)
    assert [m.WhichOneof("response") for m in burst] == [None, "request_body"]
    assert burst[0].override_message_timeout.seconds == 35
    assert run(0, 35.0) == [decided]  # not behind: one message, as before
    assert run(dc.BEHIND, 0.0) == [decided]  # no flow control (no max_message_timeout in Envoy): nothing to extend


def test_state_shows_the_returning_share_a_first_turn_counts_at_once_sessions_stop_coming_back():
    """/state says what the working sets count a first turn at: an operator (and a test) whose new sessions are let in
    beside full caches reads why there (issue 43's learned share of sessions that came back)."""
    t = [1000.0]
    cfg = parse_config({"replicas": [{"name": f"r{i}", "url": f"http://127.0.0.1:{8000 + i}"} for i in range(2)],
                        "warm": {"active_session_s": 5}})
    b = live_brain(cfg, t)
    assert b.state()["flow_control"]["returning_share"] == 1.0  # nothing seen: new sessions are expected back
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello there " * 50}]})
    for k in range(30):  # a session id per call: each leaves the active set unreturned
        t[0] += 6
        for r in cfg.replicas:  # fresh scrapes: the fleet stays LIVE as time passes
            b.router.on_scrape(r.name, True, t[0])
        h = headers_of(envoy_decide(b, {":method": "POST", ":path": "/v1/chat/completions",
                                        "x-session-id": f"once{k}", "x-request-id": f"q{k}"}, body))
        b.on_log_entry(entry(f"q{k}", h[RESERVATION_HEADER], upstream=8000 + int(h[ROUTING_HEADER][1:])))
    assert b.state()["flow_control"]["returning_share"] < 0.5
