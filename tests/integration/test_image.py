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


def _the_charts_init_container_renders_envoys_bootstrap(tmp: Path) -> None:
    """The Helm chart's standalone shape renders Envoy's bootstrap at pod start: its init container's command, run
    from this image on the chart's own config, writes a bootstrap Envoy accepts."""
    from tests.repo.test_chart import MATRIX, render, the
    from tests.envoy_config.test_envoy_config import envoy_binary

    tmp.mkdir()
    docs = render(MATRIX["standalone-defaults"], tmp)
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and "warmroute.yaml" in d["data"])
    [init] = the(docs, "Deployment", "wr-warmroute-envoy")["spec"]["template"]["spec"]["initContainers"]
    etc, out = tmp / "etc", tmp / "rendered"
    for d in (etc, out):
        d.mkdir()
        d.chmod(0o777)  # the image's user writes there, as into the pod's emptyDir
    (etc / "warmroute.yaml").write_text(cm["data"]["warmroute.yaml"])
    (etc / "warmroute.yaml").chmod(0o644)
    ctr = subprocess.run(["buildah", "from", TAG], capture_output=True, text=True, check=True).stdout.strip()
    try:
        r = subprocess.run(["buildah", "run", "--isolation", "chroot", "-v", f"{etc}:/etc/warmroute:ro",
                            "-v", f"{out}:/etc/envoy/rendered", ctr, "--", *init["command"]],
                           capture_output=True, text=True, timeout=120)
    finally:
        subprocess.run(["buildah", "rm", ctr], capture_output=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    text = (out / "envoy.yaml").read_text()
    # the pod's paths on this host: the Secret's CA and the admin socket's emptyDir
    ca = tmp / "ca.crt"
    ca.write_text(Path("/etc/ssl/certs/ca-certificates.crt").read_text())
    (tmp / "envoy.yaml").write_text(text.replace("/etc/envoy/tls/ca.crt", str(ca)).replace("/run/warmroute/",
                                                                                           f"{tmp}/"))
    v = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(tmp / "envoy.yaml"), "-l", "error"],
                       capture_output=True, text=True, timeout=60)
    assert v.returncode == 0, v.stdout[-2000:] + v.stderr[-2000:]


def test_the_brain_started_from_the_image_runs_as_non_root_and_routes_a_request(image, tmp_path):
    conf = image["OCIv1"]["config"]
    assert conf["User"] == "10001:10001"
    assert conf["Entrypoint"][:2] == ["warmroute", "brain"]
    assert image["Docker"]["config"]["Healthcheck"]["Test"][:3] == ["CMD", "warmroute", "health"]
    _the_charts_init_container_renders_envoys_bootstrap(tmp_path / "chart")
    grpc_port = free_port()
    cfg = {k: dict(v) for k, v in FAST.items()}
    cfg["brain"] = {"protocol": "endpoint-picker", "grpc_socket": None, "grpc_port": grpc_port, "insecure": True,
                    "admin_token_file": "/tmp/warmroute/admin.token",
                    "response_key_file": "/tmp/warmroute/response.key"}
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
        log = open(tmp_path / "brain.log", "wb")  # noqa: SIM115 (the brain's log while it runs, closed below)
        proc = subprocess.Popen(["buildah", "run", "--isolation", "chroot", "--network", "host",
                                 "-v", f"{mount}:/etc/warmroute:ro", ctr, "--", *entry],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        health = [str(ROOT / ".venv" / "bin" / "warmroute"), "health", "--target", f"127.0.0.1:{grpc_port}"]
        wait_for(lambda: subprocess.run(health, capture_output=True).returncode == 0 or proc.poll() is not None,
                 60, "the brain in the container to be ready")
        assert proc.poll() is None, (tmp_path / "brain.log").read_text()[-2000:]
        s.brain_ports = {"grpc_port": grpc_port}
        s.start_envoy()
        body = json.dumps({"model": "mock-coder-30b", "max_tokens": 4, "messages": [{"role": "user",
                                                                                     "content": "hi"}]}).encode()
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
