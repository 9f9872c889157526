"""Hostile and careless input on a live stack (issue 19, parts 2, 5, 8): a client cannot eject a replica whose
scrapes are healthy, any header bytes are routed by the brain, Envoy's own replies are JSON errors."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest

from extproc.contract import EXT_PROC_STAT_PREFIX
from extproc.tools.stack.local import http_get, http_post_json, wait_for

pytestmark = pytest.mark.integration


def post(s, body: bytes, headers: dict | None = None, path="/v1/chat/completions"):
    req = urllib.request.Request(s.url + path, data=body, headers={"content-type": "application/json",
                                                                   **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers.get("content-type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("content-type", ""), e.read()


def raw_post(s, session: bytes) -> tuple[int, str]:
    """A request whose session header carries bytes that are not UTF-8 (urllib would refuse to send them)."""
    body = b'{"model": "mock-coder-30b", "max_tokens": 2, "messages": [{"role": "user", "content": "hello there"}]}'
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nx-session-id: "
            + session
            + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n")
    port = int(s.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
        c.sendall(head + body)
        data = b""
        while chunk := c.recv(65536):
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(payload)["system_fingerprint"]  # the mock says who served


def fail_open_count(s) -> int:
    stats = json.loads(http_get(s.envoy_admin + "/stats?format=json"))["stats"]
    return sum(x.get("value", 0) for x in stats if x.get("name",
                                                         "").endswith(f"ext_proc.{EXT_PROC_STAT_PREFIX}.failure_mode_allowed"))


def decisions(s) -> int:
    return sum(r["decisions"] for r in s.state()["replicas"])


def test_bodies_that_make_a_replica_answer_500_eject_nothing(own_stack):
    s = own_stack(4)
    s.wait_all_live(30)
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    codes = [post(s, deep, {"x-session-id": f"deep-{i}"})[0] for i in range(12)]
    assert all(c >= 400 for c in codes), codes  # the requests fail, as they should
    st = s.state()
    assert [r["state"] for r in st["replicas"]] == ["LIVE"] * 4


def test_a_replica_that_answers_html_with_200_is_counted_failed_but_at_most_the_share_is_ejected(own_stack):
    s = own_stack(4)
    s.wait_all_live(30)
    for r in s.replicas[:2]:
        http_post_json(r.url + "/admin/fault", {"html": True})
    ok = b'{"model": "mock-coder-30b", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}'
    sent = iter(range(10_000))

    def one_more_then_ejected():
        post(s, ok, {"x-session-id": f"h{next(sent)}"})  # new sessions spread over the fleet
        return any(r["state"] == "EJECTED" for r in s.state()["replicas"][:2])

    wait_for(one_more_then_ejected, 60, "an HTML replica ejected")
    for k in range(40):
        post(s, ok, {"x-session-id": f"more-{k}"})
    states = [r["state"] for r in s.state()["replicas"]]
    assert states.count("EJECTED") == 1 and states[2:] == ["LIVE", "LIVE"]


def test_a_session_header_of_any_bytes_is_routed_by_the_brain_and_stays_sticky(own_stack):
    s = own_stack(4)
    s.wait_all_live(30)
    fo, d0 = fail_open_count(s), decisions(s)
    got = [raw_post(s, b"s-\xff\xfe-" + bytes([0x80 + i % 2])) for i in range(6)]
    assert [code for code, _ in got] == [200] * 6
    # two sessions, three turns each: each keeps its replica
    assert len({who for _, who in got[0::2]}) == 1 and len({who for _, who in got[1::2]}) == 1
    assert decisions(s) == d0 + 6 and fail_open_count(s) == fo  # decided by the brain, none failed open
    log = (s.dir / "brain.log").read_text()
    assert "Traceback" not in log


def test_envoy_s_own_replies_are_openai_errors_with_a_code(own_stack):
    s = own_stack(2, config={"envoy": {"max_body_bytes": 1024 * 1024}, "profile": {"max_body_bytes": 1024 * 1024}})
    s.wait_all_live(30)
    for headers, body, status in (
        ({"x-big": "a" * 70_000}, b"{}", 431),
        ({}, b"x" * (2 * 1024 * 1024), 413),
    ):
        code, ctype, raw = post(s, body, headers)
        assert code == status and ctype.startswith("application/json")
        err = json.loads(raw)["error"]
        assert err["status"] == status and err["code"] and err["message"]
    code, ctype, raw = post(s, b"{}", path="/metrics")  # warmroute's own 404 keeps its code
    assert code == 404 and json.loads(raw)["error"]["code"] == "path_not_served"
