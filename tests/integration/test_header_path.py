"""The header path on a real Envoy (issue 61): a turn of a session under way is routed at its request headers and its
body streams to its home unread; every other request reads its body, as before. Each request's path is read from the
brain's own record of it (GET /decisions by the x-request-id Envoy gave it), never from a cumulative counter."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from extproc.tools.stack.local import Stack, http_get, wait_for

from .conftest import FAST

pytestmark = pytest.mark.integration

MODEL = "mock-coder-30b"


def post(stack, doc: dict, headers: dict | None = None, path: str = "/v1/chat/completions") -> tuple[int, dict, dict]:
    req = urllib.request.Request(stack.url + path, data=json.dumps(doc).encode(), method="POST",
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, json.loads(e.read() or b"{}")


def decided(stack, headers: dict) -> dict:
    """The brain's record of the request whose response carried these headers."""
    rid = headers["x-request-id"]
    rows = json.loads(stack.admin_get(f"/decisions?request_id={rid}"))["decisions"]
    assert rows, f"the brain decided no request {rid}"
    return rows[-1]


def conversation(turns: int, size: int = 2000, model: str = MODEL) -> dict:
    """A chat body of ``turns`` exchanges, each ``size`` characters: the next turn extends the last one."""
    msgs = [{"role": "system", "content": "You are the house coding agent. " * 40}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"turn {i}: " + "tool output line\n" * (size // 17)})
        if i < turns - 1:
            msgs.append({"role": "assistant", "content": f"answer {i}"})
    return {"model": model, "max_tokens": 4, "messages": msgs}


def upstream_bodies(stack) -> int:
    """How many requests Envoy's body ext_proc call carried (its stat; the header path's call is another prefix)."""
    stats = http_get(stack.envoy_admin + "/stats?filter=ext_proc").decode()
    return sum(int(line.split(": ")[1]) for line in stats.splitlines()
               if ".ext_proc.warmroute.streams_started" in line)


@pytest.fixture(scope="module")
def one_model():
    with Stack(3, config=FAST, mock_args=["--speedup", "20"]) as s:
        s.wait_all_live(30)
        wait_for(lambda: all(r.get("models") for r in s.state()["replicas"]), 10, "every replica's models read")
        yield s


def test_turns_under_way_are_routed_at_their_headers_and_reach_their_home_whole(one_model):
    s = one_model
    sid = {"x-session-id": "agent-1"}
    status, h, first = post(s, conversation(1), sid)
    assert status == 200 and decided(s, h)["path"] == "body"  # a new session: its body decides where it lives
    home = first["system_fingerprint"]
    for turns in range(2, 7):
        doc = conversation(turns)
        status, h, out = post(s, doc, sid)
        d = decided(s, h)
        assert status == 200 and d["path"] == "headers", d
        assert out["system_fingerprint"] == home == d["replica"]
        # the replica read the whole body the client sent: the same prompt as the same body read by the brain
        status, h2, again = post(s, doc)  # no session header: the body path, anywhere
        assert status == 200 and decided(s, h2)["path"] == "body"
        assert out["usage"]["prompt_tokens"] == again["usage"]["prompt_tokens"]
        # and its context was there
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # a turn of a few hundred KB streams through unbuffered, and is still its home's
    big = conversation(7, size=60_000)
    status, h, out = post(s, conversation(6, size=60_000), sid)  # grows past the last turn by more than 32K tokens
    assert status == 200 and decided(s, h)["path"] == "body"
    home = out["system_fingerprint"]  # the cost model may move a turn that new: wherever it went is its home now
    # an agent's next turn comes seconds later, once Envoy has logged this one's end: sent back to back, the next one
    # would find this one's predicted prefill still booked there (priced at the prior rate while another replica had
    # learned its own, it was 18 s of a wait that had ended) and rightly go elsewhere
    wait_for(lambda: s.state()["open_reservations"] == 0, 10, "the last turn's reservation released")
    status, h, out = post(s, big, sid)
    assert status == 200 and decided(s, h)["path"] == "headers" and out["system_fingerprint"] == home
    # each one's reservation went back when Envoy logged its end, as a body-read turn's does
    wait_for(lambda: s.state()["open_reservations"] == 0, 10, "every reservation released")


def test_what_the_headers_cannot_decide_reads_its_body(one_model):
    s = one_model
    sid = {"x-session-id": "agent-2"}
    status, h, first = post(s, conversation(1), sid)
    assert status == 200
    # stored Responses: a follow-up's home is its response's; the brain reads every Responses body
    status, h, _ = post(s, {"model": MODEL, "input": "hello", "max_output_tokens": 4}, sid, "/v1/responses")
    assert status == 200 and decided(s, h)["path"] == "body"
    # a conversation compacted to less than it was: priced from its text
    post(s, conversation(6), sid)
    status, h, _ = post(s, conversation(2), sid)
    assert status == 200 and decided(s, h)["path"] == "body"
    # a model the fleet does not serve, mid-session: the replica's own 404 (the header path goes only to the home)
    status, h, out = post(s, conversation(3, model="another-model"), sid)
    assert status == 404 and "another-model" in json.dumps(out)
    # the Messages API takes it too
    status, h, _ = post(s, {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi " * 300}]},
                        {"x-session-id": "agent-3", "anthropic-version": "2023-06-01"}, "/v1/messages")
    assert status == 200 and decided(s, h)["path"] == "body"
    status, h, _ = post(s, {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi " * 310}]},
                        {"x-session-id": "agent-3", "anthropic-version": "2023-06-01"}, "/v1/messages")
    assert status == 200 and decided(s, h)["path"] == "headers"


def test_a_turn_whose_home_is_gone_reads_its_body_and_moves(own_stack):
    s = own_stack(3)
    s.wait_all_live(30)
    sid = {"x-session-id": "agent-dead-home"}
    status, h, first = post(s, conversation(1), sid)
    home = first["system_fingerprint"]
    status, h, _ = post(s, conversation(2), sid)
    assert decided(s, h)["path"] == "headers"
    s.kill_replica(home)
    wait_for(lambda: s.replica_state(home)["state"] != "LIVE", 20, "the home ejected")
    status, h, out = post(s, conversation(3), sid)
    d = decided(s, h)
    assert status == 200 and d["path"] == "body" and out["system_fingerprint"] != home


def test_several_models_take_the_header_path_only_by_a_model_header():
    config = {**FAST, "profile": {"model_header": "x-model"}}
    s = Stack(4, config=config, mock_args=["--speedup", "20"])
    s.replica_args = {"r0": ["--model", "coder"], "r1": ["--model", "coder"], "r2": ["--model", "chat"],
                      "r3": ["--model", "chat"]}
    with s:
        wait_for(lambda: all(r["state"] == "LIVE" and r.get("models") for r in s.state()["replicas"]), 30, "all LIVE")
        sid = "multi-1"
        status, h, first = post(s, conversation(1, model="coder"), {"x-session-id": sid})
        assert status == 200 and first["system_fingerprint"] in ("r0", "r1")
        # no model header: the body names the model
        status, h, _ = post(s, conversation(2, model="coder"), {"x-session-id": sid})
        assert status == 200 and decided(s, h)["path"] == "body"
        status, h, out = post(s, conversation(3, model="coder"), {"x-session-id": sid, "x-model": "coder"})
        assert status == 200 and decided(s, h)["path"] == "headers"
        assert out["system_fingerprint"] == first["system_fingerprint"]
        # the client changes model mid-session: its home does not serve it, the body decides, among chat's replicas
        status, h, out = post(s, conversation(4, model="chat"), {"x-session-id": sid, "x-model": "chat"})
        assert status == 200 and decided(s, h)["path"] == "body" and out["system_fingerprint"] in ("r2", "r3")


def door_calls(stack) -> dict[str, int]:
    """Envoy's counts of the header path's calls by how they ended: at the brain's header door (ext_authz) or by gRPC."""
    stats = stack.envoy_stats()
    out = {k.rpartition(".")[2]: v for k, v in stats.items() if k.startswith("http.ingress.ext_authz.warmroute_headers.")}
    out["grpc"] = sum(v for k, v in stats.items() if ".ext_proc.warmroute_headers.streams_started" in k)
    return out


def test_where_envoy_reaches_the_brain_by_a_socket_the_headers_are_asked_at_the_door(one_model):
    s = one_model
    sid = {"x-session-id": "agent-door"}
    post(s, conversation(1), sid)
    before = door_calls(s)
    for turns in range(2, 6):
        status, h, _ = post(s, conversation(turns), sid)
        assert status == 200 and decided(s, h)["path"] == "headers"
    after = door_calls(s)
    assert after["ok"] - before.get("ok", 0) >= 4  # each asked over HTTP (the module's other tests run before or after)
    assert after["grpc"] == 0 and not after.get("error") and not after.get("failure_mode_allowed")


def test_the_brain_s_refusal_at_the_door_reaches_the_client_in_the_api_s_shape(own_stack):
    """A tenant past its cap, asked at its headers with a body over the look's size: refused there (ext_authz denied,
    the body never sent to the brain), with the brain's JSON and Retry-After, in OpenAI's shape and Anthropic's."""
    s = own_stack(2, config={"flow_control": {"tenant_tokens_per_minute": 2500},
                             "envoy": {"trust_downstream_tenant_header": True}})
    s.wait_all_live(30)
    tenant = {"x-warmroute-tenant": "noisy"}
    big = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "fix it. " * 10_000}]}
    codes = [post(s, big, {**tenant, "x-session-id": f"n{i}"})[0] for i in range(3)]
    assert codes[-1] == 429, codes  # 80 KB bodies: a few thousand tokens each, past the tenant's 2,500 a minute
    before = door_calls(s)
    status, headers, doc = post(s, big, {**tenant, "x-session-id": "n-chat"})
    assert status == 429 and doc["error"]["code"] == "tenant_over_cap" and int(headers["retry-after"]) >= 1, doc
    status, headers, doc = post(s, {**big, "model": MODEL}, {**tenant, "x-session-id": "n-msg",
                                                             "anthropic-version": "2023-06-01"}, "/v1/messages")
    assert status == 429 and doc["type"] == "error" and doc["error"]["type"] == "rate_limit_error", doc
    assert door_calls(s).get("denied", 0) - before.get("denied", 0) == 2  # both refused at their headers
    # another tenant's turns go on
    assert post(s, conversation(1), {"x-warmroute-tenant": "quiet", "x-session-id": "q"})[0] == 200
    wait_for(lambda: s.state()["open_reservations"] == 0, 30, "every reservation released")


def test_where_envoy_reaches_the_brain_over_tcp_the_headers_are_asked_by_grpc(own_stack):
    s = own_stack(2, config={"brain": {"grpc_socket": None}})
    s.wait_all_live(30)
    sid = {"x-session-id": "agent-tcp"}
    post(s, conversation(1), sid)
    status, h, _ = post(s, conversation(2), sid)
    assert status == 200 and decided(s, h)["path"] == "headers"
    calls = door_calls(s)
    assert calls["grpc"] >= 2 and not calls.get("ok")
    # and the access log goes over gRPC too (no log door over TCP): both turns released by it
    wait_for(lambda: s.state()["open_reservations"] == 0, 30, "both turns released")
    metrics = http_get(s.brain_metrics).decode()
    assert 'warmroute_access_log_entries_total{transport="door"} 0.0' in metrics
    assert s.state()["releases_by_access_log"] == 2
