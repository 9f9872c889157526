"""The brain's image, built the way `make image` builds it (deploy/image.sh), started from its own entrypoint
and routing a request behind Envoy in the endpoint-picker shape. Docker cannot run here: buildah builds and
runs it (`--isolation chroot`, the host's network), as a platform team's docker or podman would."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest

from extproc.tools.stack.local import Stack, wait_for

from ..helpers import stop_group
from .conftest import FAST

# one test, so one worker of make test builds the image (two workers built the same tag at once and one's
# teardown removed it under the other's build; xdist's loadgroup does not group tests under pytest 9)
pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
TAG = "localhost/warmroute:test"


def _engine() -> str | None:
    if shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        return None  # docker builds fine, but this test runs the container the buildah way only
    return "buildah" if shutil.which("buildah") else None


@pytest.fixture(scope="module")
def image():
    if _engine() is None:
        pytest.skip("buildah is not installed (make system-deps installs buildah and mmdebstrap)")
    out = subprocess.run([str(ROOT / "deploy" / "image.sh"), TAG], cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    doc = json.loads(subprocess.run(["buildah", "inspect", "--type", "image", TAG], capture_output=True, text=True,
                                    check=True).stdout)
    yield doc
    # the image this test made goes (~500 MB each run); the Debian base stays, the next build reuses it
    subprocess.run(["buildah", "rmi", TAG], capture_output=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_brain_started_from_the_image_runs_as_non_root_and_routes_a_request(image, tmp_path):
    conf = image["OCIv1"]["config"]
    assert conf["User"] == "10001:10001"
    assert conf["Entrypoint"][:2] == ["warmroute", "brain"]
    assert image["Docker"]["config"]["Healthcheck"]["Test"][:3] == ["CMD", "warmroute", "health"]
    grpc_port = free_port()
    cfg = {k: dict(v) for k, v in FAST.items()}
    cfg["brain"] = {"protocol": "endpoint-picker", "grpc_socket": None, "grpc_port": grpc_port, "insecure": True,
                    "admin_token_file": "/tmp/warmroute/admin.token", "response_key_file": "/tmp/warmroute/response.key"}
    cfg["envoy"]["cds_path"] = None  # the brain in the container cannot write Envoy's CDS file on this host
    s = Stack(2, config=cfg, mock_args=["--speedup", "20"])
    ctr = proc = None
    try:
        s.replicas = [s.start_replica(f"r{i}") for i in range(2)]
        config_path = s.write_config()
        mount = tmp_path / "etc"
        mount.mkdir()
        mount.chmod(0o755)
        (mount / "warmroute.yaml").write_text(config_path.read_text())
        (mount / "warmroute.yaml").chmod(0o644)
        ctr = subprocess.run(["buildah", "from", TAG], capture_output=True, text=True, check=True).stdout.strip()
        entry = image["OCIv1"]["config"]["Entrypoint"]
        log = open(tmp_path / "brain.log", "wb")
        proc = subprocess.Popen(["buildah", "run", "--isolation", "chroot", "--network", "host",
                                 "-v", f"{mount}:/etc/warmroute:ro", ctr, "--", *entry],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        health = [str(ROOT / ".venv" / "bin" / "warmroute"), "health", "--target", f"127.0.0.1:{grpc_port}"]
        wait_for(lambda: subprocess.run(health, capture_output=True).returncode == 0 or proc.poll() is not None,
                 60, "the brain in the container to be ready")
        assert proc.poll() is None, (tmp_path / "brain.log").read_text()[-2000:]
        s.brain_ports = {"grpc_port": grpc_port}
        s.start_envoy()
        body = json.dumps({"model": "mock-coder-30b", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}).encode()
        req = urllib.request.Request(s.url + "/v1/chat/completions", body, {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            answer = json.loads(r.read())
        assert r.status == 200 and answer["system_fingerprint"] in ("r0", "r1")
        assert b"brain_started" in (tmp_path / "brain.log").read_bytes()
    finally:
        if proc is not None:
            stop_group(proc, signal.SIGTERM, 15)
        if ctr:
            subprocess.run(["buildah", "rm", ctr], capture_output=True)
        s.stop()
