"""Who may talk to the brain (issue 19, part 1): listeners, unguessable reservation ids, and reservations
that no access-log entry ever names (a lost or rogue ext_proc call) expiring after a bound."""

from __future__ import annotations

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2 as al

from extproc.brain.release import entry_of_proto
from extproc.brain.brain import Brain
from extproc.config import FLOW_FIRST_ANSWER_S, ConfigError, parse_config
from extproc.contract import RESERVATION_HEADER
from extproc.core import LIVE

from ..brain.test_service import BODY, entry, headers_of, proto_entry
from ..helpers import envoy_decide

REPLICAS = [{"name": f"r{i}", "url": f"http://127.0.0.1:{8001 + i}"} for i in range(3)]


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def live(cfg_doc=None):
    clock = Clock()
    b = Brain(parse_config({"replicas": REPLICAS, **(cfg_doc or {})}), clock=clock)
    for k in range(7):
        clock.t = 1000.0 + 3 * k
        for r in b.cfg.replicas:
            b.router.on_scrape(r.name, True, clock.t)
    assert all(r.state is LIVE for r in b.router.replicas)
    return b, clock


def periodic(request_id="", reservation=""):
    e = proto_entry(request_id, reservation)
    e.common_properties.access_log_type = al.AccessLogType.DownstreamPeriodic
    return entry_of_proto(e)


def test_a_reservation_id_cannot_be_guessed_from_another():
    b, _ = live()
    ids = [headers_of(envoy_decide(b, {"x-request-id": f"q{i}"}, BODY))[RESERVATION_HEADER] for i in range(3)]
    assert b.router.open_reservations == 3
    # the number of a neighbour with any other random part, or without one, releases nothing
    num, _, secret = ids[1].partition(".")
    for forged in (f"{num}.{'0' * 16}", f"{num}.{secret[:-1]}{'0' if secret[-1] != '0' else '1'}", num, f"{num}."):
        b.on_log_entry(entry("", forged, code=503, details="via_upstream"))
    assert b.router.open_reservations == 3
    b.on_log_entry(entry("", ids[1]))
    assert b.router.open_reservations == 2


def test_B_completion_periodic_entries_keep_a_long_request_s_reservation_past_the_safety_timeout():
    b, clock = live()
    rid = headers_of(envoy_decide(b, {"x-request-id": "long"}, BODY))[RESERVATION_HEADER]
    for _ in range(360):  # an hour of generation, logged every 10 s
        clock.t += 10
        b.on_log_entry(periodic("long", rid))
        b.tick()
    assert b.router.open_reservations == 1
    assert b.router.liveness_timeout_s is not None
    b.on_log_entry(entry("long", rid))  # the end
    assert b.router.open_reservations == 0 and b.router.liveness_timeouts == 0


def test_B_completion_a_reservation_no_entry_ever_names_expires_after_the_liveness_bound():
    b, clock = live()
    envoy_decide(b, {"x-request-id": "rogue"}, BODY)  # an ext_proc call no request follows
    live_rid = headers_of(envoy_decide(b, {"x-request-id": "real"}, BODY))[RESERVATION_HEADER]
    bound = b.liveness_bound_s()
    # the first answer: envoy.ext_proc_timeout_s, at least FLOW_FIRST_ANSWER_S with flow control on (the default)
    assert bound == pytest.approx(2 * 10 + FLOW_FIRST_ANSWER_S + 3 * 1 + 1)
    t0 = clock.t
    while clock.t < t0 + bound + 2:
        clock.t += 1
        if int(clock.t - t0) % 10 == 0:
            b.on_log_entry(periodic("real", live_rid))
        b.tick()
    assert b.router.liveness_timeouts == 1
    assert b.router.open_reservations == 1  # the real one, seen every 10 s, is kept


def test_B_completion_without_periodic_entries_nothing_expires_before_the_safety_timeout():
    # an Envoy configured without access_log_options (pasted snippets, a foreign gateway) never sends them:
    # its long requests must keep their reservations
    b, clock = live()
    envoy_decide(b, {"x-request-id": "q"}, BODY)
    for _ in range(300):
        clock.t += 10
        b.tick()
    assert b.router.open_reservations == 1 and b.router.liveness_timeout_s is None


@pytest.mark.parametrize("brain, field", [
    ({"grpc_socket": None}, "brain.grpc_socket: no gRPC listener"),
    ({"host": "0.0.0.0", "grpc_port": 9100}, "brain.host: plain TCP on 0.0.0.0"),
    ({"host": "10.1.2.3", "grpc_port": 9100, "grpc_socket": None}, "brain.host"),
    # loopback too: any local user reaches it (a forged access-log entry ejected a healthy replica)
    ({"host": "127.0.0.1", "grpc_port": 9100}, "brain.grpc_port: plain TCP on 127.0.0.1"),
    ({"tls_cert_file": "/c.pem"}, "brain.tls_key_file"),
    ({"tls_client_ca_file": "/ca.pem"}, "brain.tls_client_ca_file"),
    ({"host": "0.0.0.0", "grpc_port": 9100, "grpc_socket": None, "tls_cert_file": "/c", "tls_key_file": "/k",
      "tls_client_ca_file": "/ca"}, "envoy.brain_tls_cert_file"),
])
def test_a_brain_reachable_without_authentication_is_refused_naming_the_field(brain, field):
    with pytest.raises(ConfigError) as e:
        parse_config({"replicas": REPLICAS, "brain": brain})
    assert str(e.value).startswith(field)


@pytest.mark.parametrize("brain", [
    {},  # the default: the Unix socket only
    {"host": "127.0.0.1", "grpc_port": 9100, "insecure": True},  # TCP on loopback, said in so many words
    {"host": "0.0.0.0", "grpc_port": 9100, "insecure": True},  # said in so many words
    {"host": "0.0.0.0", "grpc_port": 9100, "grpc_socket": None, "tls_cert_file": "/c", "tls_key_file": "/k"},
])
def test_listeners_that_are_allowed(brain):
    cfg = parse_config({"replicas": REPLICAS, "brain": brain})
    assert cfg.brain.grpc_socket or cfg.brain.grpc_port is not None


def test_by_default_there_is_no_tcp_listener():
    cfg = parse_config({"replicas": REPLICAS})
    assert cfg.brain.grpc_port is None and cfg.brain.grpc_socket


def test_command_line_flags_pass_the_same_checks_as_the_file(tmp_path):
    """`warmroute brain --host 0.0.0.0 --grpc-port N` opened plaintext gRPC on every interface that check-config
    refuses in a file."""
    import subprocess
    import sys

    cfg = tmp_path / "w.yaml"
    cfg.write_text(f"replicas: [{{name: r0, url: 'http://127.0.0.1:8001'}}]\nbrain: {{grpc_socket: {tmp_path}/b.sock, "
                   f"admin_port: 0, metrics_port: 0, admin_token_file: {tmp_path}/t}}\n")
    p = subprocess.run([sys.executable, "-m", "extproc.cli", "brain", "--config", str(cfg), "--host", "0.0.0.0",
                        "--grpc-port", "0"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "brain.host: plain TCP on 0.0.0.0" in p.stderr, p.stderr


def _sharing(b):
    """A brain with sharing on, wired as the server wires it (without Redis: the test carries the events)."""
    outbox = b.router.share()
    b.releaser.forward = lambda num, digest, ended: outbox.events.append(("x" if ended else "a", num, digest))
    b.router.remote.on_foreign_end = b.releaser.end_forwarded
    return outbox


def test_log_entries_that_reach_another_brain_keep_the_owner_s_request_alive_and_then_end_it():
    """Several brain processes behind one Envoy: its one access-log stream goes to one of them. The owner of a
    long request hears of it through shared state: alive past its liveness bound, released at its end."""
    owner, clock = live()
    other, other_clock = live()
    out_owner, out_other = _sharing(owner), _sharing(other)
    rid = headers_of(envoy_decide(owner, {"x-request-id": "long"}, BODY))[RESERVATION_HEADER]
    owner.on_log_entry(periodic("warm-up", "0.0"))  # the owner has seen periodic entries: its liveness bound is on
    owner.tick()
    bound = owner.liveness_bound_s()
    out_owner.events.clear()
    t0 = clock.t
    while clock.t < t0 + 3 * bound:
        clock.t += 5
        other_clock.t = clock.t
        other.on_log_entry(periodic("long", rid))  # the stream is on the other brain
        events, out_other.events[:] = list(out_other.events), []
        assert events and all(e[0] == "a" for e in events)
        owner.router.remote.apply(owner.router, "other", events, 0.0, clock.t)
        owner.tick()
    assert owner.router.open_reservations == 1 and owner.router.liveness_timeouts == 0
    other.on_log_entry(entry("long", rid))
    owner.router.remote.apply(owner.router, "other", list(out_other.events), 0.0, clock.t)
    assert owner.router.open_reservations == 0
    # a forged digest (the number alone is guessable) ends nothing
    rid2 = headers_of(envoy_decide(owner, {"x-request-id": "q2"}, BODY))[RESERVATION_HEADER]
    owner.router.remote.apply(owner.router, "other", [("x", int(rid2.partition(".")[0]), "0" * 32)], 0.0, clock.t)
    assert owner.router.open_reservations == 1
