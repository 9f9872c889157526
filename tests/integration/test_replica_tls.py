"""https:// replicas mean what they say (issue 19, part 6): Envoy and the scraper both speak TLS to them,
checking the replica's certificate against the configured CA."""

from __future__ import annotations

import json
import urllib.request

import pytest

from extproc.tools.stack.local import Stack, wait_for

from .conftest import FAST
from .test_brain_access import make_pki

pytestmark = pytest.mark.integration


def served_by(s, session: str) -> str:
    body = json.dumps({"model": "mock-coder-30b", "max_tokens": 2, "messages": [{"role": "user",
                                                                                 "content": "hi"}]}).encode()
    req = urllib.request.Request(s.url + "/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json", "x-session-id": session})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["system_fingerprint"]


def test_an_https_replica_is_scraped_and_served_over_tls_and_a_wrong_ca_keeps_it_out(tmp_path):
    pki = make_pki(tmp_path)
    (tmp_path / "other").mkdir()
    other = make_pki(tmp_path / "other")  # a CA that did not sign the replicas' certificate
    s = Stack(3, config=FAST, mock_args=["--speedup", "20"])
    tls = ["--tls-cert", pki["server.pem"], "--tls-key", pki["server.key"]]
    s.replica_args = {"r1": tls, "r2": tls}
    s.replica_config = {"r1": {"tls_ca_file": pki["ca.pem"]}, "r2": {"tls_ca_file": other["ca.pem"]}}
    try:
        s.start()
        assert [r.url.split(":")[0] for r in s.replicas] == ["http", "https", "https"]
        wait_for(lambda: s.replica_state("r1")["state"] == "LIVE" and s.replica_state("r0")["state"] == "LIVE", 30,
                 "r0 and the https replica r1 LIVE")
        err = s.replica_state("r2").get("scrape_error") or ""
        assert s.replica_state("r2")["state"] != "LIVE" and "Certificate" in err, err
        who = {served_by(s, f"t{i}") for i in range(12)}
        assert "r1" in who and "r2" not in who  # Envoy reached r1 over TLS
    finally:
        s.stop()
