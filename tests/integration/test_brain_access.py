"""Who may talk to the brain, on real processes: the socket only its user opens, no TCP listener by default,
mutual TLS when the brain is reached over TCP, and reservations no access-log entry names expiring."""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
from pathlib import Path

import grpc
import openai
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from extproc.config import first_answer_s
from bench.faults.hostile import connect_as
from extproc.tools.stack.local import wait_for

pytestmark = pytest.mark.integration


def _listening_tcp_ports(pid: int) -> list[int]:
    """TCP ports the process listens on: its socket inodes matched against the kernel's tables."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # LISTEN
                ports.append(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def test_by_default_the_brain_s_grpc_is_a_socket_only_its_user_may_open(own_stack):
    sock_dir = tempfile.mkdtemp(prefix="wr-sock-")
    os.chmod(sock_dir, 0o755)  # anyone may look in: the socket's own mode must be what keeps them out
    path = os.path.join(sock_dir, "brain.sock")
    try:
        s = own_stack(2, config={"brain": {"grpc_socket": path}})
        assert s.brain_ports["grpc_port"] is None
        # the metrics and admin ports are HTTP on loopback; nothing speaks gRPC over TCP
        admin = {s.brain_ports["admin_port"], s.brain_ports["metrics_port"]}
        assert set(_listening_tcp_ports(s.brain.popen.pid)) <= admin
        assert os.stat(path).st_mode & 0o777 == 0o600
        assert connect_as(path) == "PermissionError"
        s.wait_all_live(30)
        # and Envoy, the brain's user here, routes through it
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
        before = sum(r["decisions"] for r in s.state()["replicas"])
        c.chat.completions.create(model="mock-coder-30b", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert sum(r["decisions"] for r in s.state()["replicas"]) == before + 1
    finally:
        for p in Path(sock_dir).iterdir():
            p.unlink()
        os.rmdir(sock_dir)


def test_a_socket_group_lets_its_members_in(own_stack, tmp_path):
    sock_dir = tempfile.mkdtemp(prefix="wr-sock-")
    os.chmod(sock_dir, 0o755)
    path = os.path.join(sock_dir, "brain.sock")
    try:
        own_stack(1, config={"brain": {"grpc_socket": path, "grpc_socket_group": "nogroup"}}, envoy=False)
        assert os.stat(path).st_mode & 0o777 == 0o660
        assert connect_as(path) == "connected"  # nobody's group is nogroup
    finally:
        for p in Path(sock_dir).iterdir():
            p.unlink()
        os.rmdir(sock_dir)


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(d: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, with openssl."""
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=test-ca", cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth"),
                      ("client", "extendedKeyUsage=clientAuth")):
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=d)
    return {k: str(d / k) for k in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


def _process(target: str, creds=None) -> None:
    """One ext_proc call, as a rogue client would make it."""
    async def go():
        ch = grpc.aio.secure_channel(target, creds) if creds else grpc.aio.insecure_channel(target)
        try:
            stub = ep_grpc.ExternalProcessorStub(ch)
            call = stub.Process(timeout=5)
            await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(body=b'{"messages": []}',
                                                                           end_of_stream=True)))
            await call.read()
            await call.done_writing()
        finally:
            await ch.close()
    asyncio.run(go())


def mutual_tls(pki: dict[str, str], **brain) -> dict:
    """The brain on TCP with a certificate, asking for Envoy's; Envoy presenting it."""
    return {
        "brain": {"grpc_socket": None, "grpc_port": 0, "host": "127.0.0.1", "tls_cert_file": pki["server.pem"],
                  "tls_key_file": pki["server.key"], "tls_client_ca_file": pki["ca.pem"], **brain},
        "envoy": {"brain_tls_ca_file": pki["ca.pem"], "brain_tls_cert_file": pki["client.pem"],
                  "brain_tls_key_file": pki["client.key"], "brain_tls_sni": "127.0.0.1"},
    }


def test_over_tcp_the_brain_wants_mutual_tls_and_envoy_presents_its_certificate(own_stack, tmp_path):
    pki = make_pki(tmp_path)
    s = own_stack(2, config=mutual_tls(pki))
    s.wait_all_live(30)
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
    before = sum(r["decisions"] for r in s.state()["replicas"])
    for _ in range(3):
        c.chat.completions.create(model="mock-coder-30b", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert sum(r["decisions"] for r in s.state()["replicas"]) == before + 3  # Envoy got through, over mTLS
    # their reservations end with Envoy's access-log entries, a moment after the responses (later on a busy machine)
    wait_for(lambda: s.state()["open_reservations"] == 0, 30, "the three requests released")
    target = f"127.0.0.1:{s.brain_ports['grpc_port']}"
    ca = Path(pki["ca.pem"]).read_bytes()
    for creds in (None, grpc.ssl_channel_credentials(root_certificates=ca)):  # plaintext; TLS without a client cert
        with pytest.raises(grpc.aio.AioRpcError):
            _process(target, creds)
    assert s.state()["open_reservations"] == 0  # none of them opened a reservation
    client = grpc.ssl_channel_credentials(ca, Path(pki["client.key"]).read_bytes(),
                                          Path(pki["client.pem"]).read_bytes())
    _process(target, client)  # a holder of a client certificate is let in
    assert s.state()["open_reservations"] == 1


def test_a_reservation_no_request_follows_expires_and_a_long_stream_keeps_its_own(own_stack):
    s = own_stack(2, config={"envoy": {"access_log_periodic_s": 0.5}}, mock_args=["--speedup", "1"])
    s.wait_all_live(30)
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
    stream = c.chat.completions.create(model="mock-coder-30b", messages=[{"role": "user",
                                                                          "content": "write a long story"}],
                                       max_tokens=1500, stream=True)  # outlasts the bound (~10 s)
    it = iter(stream)
    next(it)  # streaming: Envoy logs it every 0.5 s from now on
    bound = wait_for(lambda: s.state()["liveness_bound_s"], 10, "Envoy's first periodic entry")
    # twice the log period, Envoy's wait for the brain, a connect timeout per try, and a second's slack
    assert bound == pytest.approx(2 * 0.5 + first_answer_s(s.cfg) + 3 * 1 + 1)
    _process("unix:" + s.cfg.brain.grpc_socket)  # an ext_proc call whose request never comes
    assert s.state()["open_reservations"] == 2
    wait_for(lambda: s.state()["liveness_timeouts"] == 1, bound + 10, "the rogue reservation to expire", every=0.2)
    st = s.state()
    assert st["open_reservations"] == 1  # the stream, older than the bound, keeps its reservation
    n = sum(1 for _ in it)
    assert n > 10
    wait_for(lambda: s.state()["open_reservations"] == 0, 10, "the stream's release")
    assert s.state()["liveness_timeouts"] == 1


def test_the_admin_api_changes_nothing_without_the_token_only_the_brain_s_user_reads(own_stack):
    import json
    import urllib.error

    from extproc.tools.stack.local import http_post_json

    s = own_stack(2, envoy=False)
    token_file = s.cfg.brain.admin_token_file
    assert os.stat(token_file).st_mode & 0o777 == 0o600
    for token in (None, "guess"):
        with pytest.raises(urllib.error.HTTPError) as e:
            http_post_json(s.brain_admin + "/replicas/r0/drain", {}, token=token)
        assert e.value.code == 401
    assert not any(r["drained"] for r in s.state()["replicas"])  # reading stays open
    assert json.loads(s.admin_post("/replicas/r0/drain"))["drained"] is True
    assert s.replica_state("r0")["drained"]


def test_as_an_endpoint_picker_over_mutual_tls_and_the_health_probe_speaks_it(own_stack, tmp_path):
    """Gateways reach pickers over TLS: the picker-shape Envoy gets through with its certificate, a client
    without one does not, and `warmroute health` (the pod's probe) checks readiness over the same TLS."""
    from extproc.brain.healthcheck import check

    pki = make_pki(tmp_path)
    s = own_stack(2, config=mutual_tls(pki, protocol="endpoint-picker"))
    s.wait_all_live(30)
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
    before = sum(r["decisions"] for r in s.state()["replicas"])
    for _ in range(3):
        c.chat.completions.create(model="mock-coder-30b", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    st = wait_for(lambda: (x := s.state())["open_reservations"] == 0 and x, 20, "the picks released")
    assert sum(r["decisions"] for r in st["replicas"]) == before + 3 and st["releases_by_response"] >= 3
    target = f"127.0.0.1:{s.brain_ports['grpc_port']}"
    with pytest.raises(grpc.aio.AioRpcError):
        _process(target, None)
    ok, line = check(target, "readiness", ca=pki["ca.pem"], cert=pki["client.pem"], key=pki["client.key"],
                     name="127.0.0.1")
    assert ok, line
    assert not check(target, "readiness")[0]  # plaintext is refused
