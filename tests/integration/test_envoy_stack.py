"""Real Envoy + brain + mock vLLM replicas, driven with the official openai SDK."""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.error
import urllib.request

import aiohttp
import openai
import pytest

from extproc.contract import FALLBACK_CLUSTER
from extproc.tools.stack.local import http_get, wait_for

from .conftest import quiet

pytestmark = pytest.mark.integration

SYSTEM = "You are a coding agent for the payments repository. Follow the house style. " * 30


def client(stack, **headers) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", default_headers=headers or None, max_retries=0,
                         timeout=60)


def chat(c: openai.OpenAI, system: str = SYSTEM, user: str = "fix the bug", stream: bool = False, **extra):
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    if not stream:
        r = c.chat.completions.create(model="mock-coder-30b", messages=msgs, max_tokens=8, **extra)
        assert r.choices[0].message.content
        return r.system_fingerprint
    served = None
    pieces = []
    for chunk in c.chat.completions.create(model="mock-coder-30b", messages=msgs, max_tokens=8, stream=True,
                                           stream_options={"include_usage": True}, **extra):
        served = chunk.system_fingerprint or served
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    assert pieces
    return served


def raw_post(stack, body: bytes, headers: dict | None = None, path: str = "/v1/chat/completions"):
    req = urllib.request.Request(stack.url + path, data=body, method="POST",
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def decisions(stack) -> int:
    return sum(r["decisions"] for r in stack.state()["replicas"])


def fallback_count(stack) -> int:
    return stack.envoy_stats().get(f"cluster.{FALLBACK_CLUSTER}.upstream_rq_total", 0)


@pytest.mark.parametrize("stream", [False, True])
def test_session_stickiness_by_header(stack, stream):
    c = client(stack, **{"x-session-id": f"sticky-header-{stream}"})
    served = []
    for i in range(6):
        quiet(stack)
        served.append(chat(c, system=f"unshared prompt {i} {stream}", stream=stream))
    assert len(set(served)) == 1, served
    assert served[0].startswith("r")


def test_session_stickiness_by_body_conversation_id(stack):
    c = client(stack)
    served = []
    for i in range(5):
        quiet(stack)
        served.append(chat(c, system=f"body session {i}", extra_body={"conversation_id": "conv-42"}))
    assert len(set(served)) == 1, served


def test_prefix_stickiness_shared_system_prompt_without_session(stack):
    c = client(stack)
    served = []
    for i in range(5):
        quiet(stack)
        served.append(chat(c, system=SYSTEM + " prefix-test", user=f"question {i}"))
    assert len(set(served)) == 1, served


def test_a_client_supplied_routing_header_is_ignored(stack):
    quiet(stack)
    c = client(stack, **{"x-warmroute-cluster": "r0"})
    served = [chat(c, system=f"spoof {i}") for i in range(8)]
    assert set(served) != {"r0"}, "the client chose its replica"
    # a bogus value must not turn into Envoy's 'no cluster' 503 either
    c2 = client(stack, **{"x-warmroute-cluster": "no-such-cluster", "x-warmroute-reservation": "0.1"})
    assert chat(c2).startswith("r")


def cluster_rq(stack, name: str) -> int:
    return stack.envoy_stats().get(f"cluster.{name}.upstream_rq_total", 0)


def test_a_client_cannot_choose_its_replica_when_the_brain_is_not_asked(stack):
    """Bodyless requests never reach the brain: a client's routing header must not route them either."""
    before = {n: cluster_rq(stack, n) for n in ("r3", "warmroute_brain", FALLBACK_CLUSTER)}
    for value in ["r3"] * 5 + ["warmroute_brain"] * 5:
        req = urllib.request.Request(stack.url + "/health", headers={"x-warmroute-cluster": value})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200
    assert cluster_rq(stack, "r3") == before["r3"]
    assert cluster_rq(stack, "warmroute_brain") - before["warmroute_brain"] < 10  # only the brain's own gRPC calls
    assert cluster_rq(stack, FALLBACK_CLUSTER) == before[FALLBACK_CLUSTER] + 10


def test_only_the_model_api_is_proxied_and_other_paths_get_a_404(stack):
    for method, path in [("GET", "/metrics"), ("POST", "/admin/fault"), ("POST", "/reset_prefix_cache"),
                         ("POST", "/sleep"), ("GET", "/v1/chat/completions/../../metrics")]:
        req = urllib.request.Request(stack.url + path, method=method, data=b"{}" if method == "POST" else None)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 404, path
        assert json.loads(e.value.read())["error"]["code"] == "path_not_served", path
    with urllib.request.urlopen(stack.url + "/health", timeout=10) as r:
        assert r.status == 200


def test_the_request_id_is_envoys_own_not_the_clients(stack):
    quiet(stack)
    ids = []
    for _ in range(2):
        status, headers, _ = raw_post(stack, json.dumps({"model": "mock-coder-30b", "max_tokens": 2, "messages": [
            {"role": "user", "content": "same id"}]}).encode(), {"x-request-id": "client-chosen"})
        assert status == 200
        ids.append({k.lower(): v for k, v in headers.items()}["x-request-id"])
    assert "client-chosen" not in ids and ids[0] != ids[1]
    quiet(stack)  # both reservations released by their own entries


def test_a_client_sent_tenant_header_never_reaches_the_brain(stack):
    """The tenant header is trusted: only the operator's auth layer may set it, Envoy drops a client's copy."""
    c = client(stack, **{"x-session-id": "tenant-spoof", "x-warmroute-tenant": "victim"})
    chat(c, system="spoofed tenant")
    with pytest.raises(urllib.error.HTTPError):
        stack.admin_get("/pins/session/tenant-spoof?tenant=victim", timeout=5)
    assert json.loads(stack.admin_get("/pins/session/tenant-spoof", timeout=5))["replica"].startswith("r")


def test_a_gzip_body_is_inflated_before_the_brain_and_one_past_the_inflate_ratio_is_a_413(stack):
    import gzip
    import random

    quiet(stack)
    rnd = random.Random(3)
    words = [rnd.choice(["def", "return", "self", "x", "value", "import", "class", "for", "in",
                         "if"]) + str(rnd.randrange(99))
             for _ in range(20000)]  # code-like text: compresses a few times, as a conversation does
    body = json.dumps({"model": "mock-coder-30b", "max_tokens": 2, "conversation_id": "gzip-conv",
                       "messages": [{"role": "user", "content": " ".join(words)}]}).encode()
    before = stack.state()["bodies"]
    status, _, out = raw_post(stack, gzip.compress(body), {"content-encoding": "gzip"})
    assert status == 200, out[:300]  # the replica got JSON it could read
    after = stack.state()["bodies"]
    assert after.get("ok", 0) == before.get("ok", 0) + 1  # the brain read the inflated body...
    stack.admin_get("/pins/session/gzip-conv", timeout=5)  # ...and its key
    # a prompt repeated 20,000 times inflates ~400x: past envoy.max_inflate_ratio (100) Envoy passes it on cut off,
    # and the brain answers what no replica could read with a 413 in OpenAI's shape
    repeated = json.dumps({"model": "mock-coder-30b", "messages": [{"role": "user", "content": "compressed " * 20000}]})
    status, _, out = raw_post(stack, gzip.compress(repeated.encode()), {"content-encoding": "gzip"})
    assert status == 413 and json.loads(out)["error"]["code"] == "body_inflates_too_far", out[:300]
    # a client cannot make the brain answer 413 for a plain body by naming the header
    status, _, _ = raw_post(stack, body, {"x-warmroute-inflated-from": "gzip"})
    assert status == 200
    # an encoding Envoy does not inflate (zstd, deflate, br, or gzip applied before another) reaches no replica:
    # 415 in OpenAI's shape, counted (the mock inflated deflate to 614-745 MB, and the brain priced it at bytes/4)
    for enc in ("zstd", "deflate", "br", "gzip, br", "identity, deflate"):
        status, _, out = raw_post(stack, b"\x28\xb5\x2f\xfd opaque", {"content-encoding": enc, "x-session-id": "z"})
        assert status == 415 and json.loads(out)["error"]["code"] == "unsupported_content_encoding", (enc, out[:300])
    assert stack.state()["bodies"].get("encoded", 0) == before.get("encoded", 0) + 5


def test_a_client_s_own_kv_transfer_params_never_reach_a_replica_in_a_body_of_any_size(stack):
    """Issue 59: a body the brain reads has them dropped (the replica answers it); one too big for the brain
    (brain_body_max_bytes, 2 MiB) is flagged by Envoy's json_to_metadata and answered 400 by the brain, and a big
    body without them still reaches its replica (an on_present ``value`` would have flagged every big body)."""
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.9", "remote_port": 9, "remote_request_id": "v"}
    small = json.dumps({"model": "mock-coder-30b", "max_tokens": 2, "messages": [{"role": "user", "content": "k"}],
                        "kv_transfer_params": params}).encode()
    status, _, out = raw_post(stack, small, {"x-session-id": "kv-small"})
    assert status == 200, out[:300]
    filler = [{"role": "user", "content": "lorem ipsum " * 1000}] * 300  # ~3.6 MB
    big = json.dumps({"model": "mock-coder-30b", "max_tokens": 2, "messages": filler,
                      "kv_transfer_params": params}).encode()
    assert len(big) > 2 * 2**20
    status, _, out = raw_post(stack, big, {"x-session-id": "kv-big"})
    assert status == 400 and json.loads(out)["error"]["code"] == "kv_transfer_params_not_allowed", out[:300]
    plain = json.dumps({"model": "mock-coder-30b", "max_tokens": 2, "messages": filler}).encode()
    status, _, out = raw_post(stack, plain, {"x-session-id": "kv-plain"})
    # it reached a replica: the mock's own answer (200, or its 400 for a prompt past its context), not the brain's
    assert status == 200 or json.loads(out)["error"].get("code") != "kv_transfer_params_not_allowed", out[:300]


def test_a_request_without_a_body_takes_the_fail_open_route_without_asking_the_brain(stack):
    before_d, before_f = decisions(stack), fallback_count(stack)
    allowed = stack.envoy_stats().get("http.ingress.ext_proc.warmroute.failure_mode_allowed", 0)
    with urllib.request.urlopen(stack.url + "/health", timeout=10) as r:  # (GET /v1/models is the brain's: the union)
        assert r.status == 200
    assert fallback_count(stack) == before_f + 1
    assert decisions(stack) == before_d
    # not a failure
    assert stack.envoy_stats().get("http.ingress.ext_proc.warmroute.failure_mode_allowed", 0) == allowed


def test_a_malformed_json_body_is_routed_by_headers(stack):
    before_d, before_f = decisions(stack), fallback_count(stack)
    pins_before = stack.state()["session_pins"]
    status, _, out = raw_post(stack, b'{"messages": [ this is not json', {"x-session-id": "malformed-1"})
    assert status == 400  # the replica's own answer to a bad body, not a proxy error: vLLM's (FastAPI's) words
    assert json.loads(out) == {"detail": "There was an error parsing the body"}
    assert decisions(stack) == before_d + 1 and fallback_count(stack) == before_f
    assert stack.state()["session_pins"] == pins_before + 1  # routed (and pinned) by the header key


def test_streaming_passes_through_chunk_by_chunk(own_stack):
    s = own_stack(2, mock_args=["--speedup", "0.3"])
    s.wait_all_live(30)
    c = client(s)
    t0 = time.monotonic()
    arrivals = []
    for chunk in c.chat.completions.create(model="mock-coder-30b", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=40, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic() - t0)
    assert len(arrivals) == 40
    # 40 tokens at 50 ms: a buffering proxy would deliver them all at ~2 s; streaming spreads them out
    assert arrivals[0] < arrivals[-1] / 2, arrivals[:3]


def test_every_reservation_is_released_after_disconnects_and_cut_streams(own_stack):
    s = own_stack(3, mock_args=["--speedup", "0.7"])
    s.wait_all_live(30)

    async def run():
        async with aiohttp.ClientSession() as http:
            async def full(i, stream):
                body = {"model": "mock-coder-30b", "max_tokens": 20, "stream": stream,
                        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"q{i}" * 300}]}
                async with http.post(s.url + "/v1/chat/completions", json=body,
                                     headers={"x-session-id": f"s{i % 7}"}) as r:
                    assert r.status == 200
                    await r.read()

            async def cut_mid_stream(i):
                body = {"model": "mock-coder-30b", "max_tokens": 200, "stream": True, "messages": [{"role": "user",
                                                                                                    "content": "long"}]}
                async with http.post(s.url + "/v1/chat/completions", json=body) as r:
                    await r.content.readline()  # first SSE line, then hang up
                    r.close()

            async def disconnect_before_response(i):
                body = {"model": "mock-coder-30b", "max_tokens": 200, "messages": [{"role": "user",
                                                                                    "content": "slow " * 100}]}
                try:
                    async with http.post(s.url + "/v1/chat/completions", json=body,
                                         timeout=aiohttp.ClientTimeout(total=0.15)) as r:
                        await r.read()
                except asyncio.TimeoutError:
                    pass

            jobs = []
            for i in range(60):
                kind = i % 4
                jobs.append(full(i, False) if kind == 0 else full(i, True) if kind == 1
                            else cut_mid_stream(i) if kind == 2 else disconnect_before_response(i))
            await asyncio.gather(*jobs)

    asyncio.run(run())
    try:
        st = wait_for(lambda: (x := s.state())["open_reservations"] == 0 and x, 20, "every reservation released")
    except Exception:  # say which, and what Envoy's access logger did, for whoever meets it next
        x = s.state()
        raise AssertionError((x["oldest_open_reservations"], x["released_at_issue"], x["unmatched_access_log_entries"],
                              {k: v for k, v in s.envoy_stats().items() if "access_log" in k})) from None
    # every reservation the brain made was released by its access-log entry: on its arrival, or as it was made when
    # the entry came first (a client gone while the brain decided), or as the same request's body call superseded a
    # header answer Envoy gave up on (a busy machine: CI once saw 55 of 56 by arrival); none by a timer. A client that
    # gave up before Envoy asked the brain made none
    made = sum(r["decisions"] for r in st["replicas"])
    by_entry = st["releases_by_access_log"] + st["released_at_issue"] + st["superseded_at_headers"]
    assert by_entry == made >= 45, (st["releases_by_access_log"], st["released_at_issue"], st["superseded_at_headers"])
    assert st["liveness_timeouts"] == 0 and st["released_envoy_gone"] == 0
    assert all(r["wlc_in_flight"] == 0 for r in st["replicas"]), st["replicas"]
    assert all(r["in_flight_requests"] == 0 for r in st["replicas"])
    assert st["safety_timeouts"] == 0
    # a client's reset or cut is an ending, not a fault of the brain's (warmroute_call_faults_total alerts on faults)
    metrics = http_get(s.brain_metrics).decode()
    faults = [line for line in metrics.splitlines()
              if line.startswith("warmroute_call_faults_total") and not line.endswith(" 0.0")]
    assert not faults, faults
    # Envoy reaches this brain by its Unix socket: every entry came to its log door, none over gRPC
    assert 'warmroute_access_log_entries_total{transport="grpc"} 0.0' in metrics
    assert 'warmroute_access_log_door_refused_total 0.0' in metrics


def test_a_killed_replica_is_retried_elsewhere_then_ejected_by_scraping_and_recovers(own_stack):
    # scrapes every 1 s: the brain keeps choosing r1 for a moment after it dies, so retries must cover it
    s = own_stack(3, config={"health": {"scrape_interval_s": 1.0}})
    s.wait_all_live(30)
    c = client(s)
    # a session living on r1: its next turn, sent the moment r1 dies, is the brain's choice of r1 for certain (a
    # new conversation would go where round-robin points, and by the second one the scrape may have seen r1 dead)
    sid = next(f"s{i}" for i in range(60) if chat(c, system=f"home {i}",
                                                  extra_headers={"x-session-id": f"s{i}"}) == "r1")
    quiet(s)
    chosen_before = s.replica_state("r1")["decisions"]
    s.kill_replica("r1")
    served = [chat(c, system=f"home {sid[1:]}", extra_headers={"x-session-id": sid})]
    served += [chat(c, system=f"during kill {i}") for i in range(6)]  # every one succeeds
    assert "r1" not in served
    assert s.replica_state("r1")["decisions"] > chosen_before, "the brain never chose r1: no retry was exercised"
    assert s.envoy_stats().get("cluster.r1.upstream_rq_retry", 0) >= 1  # Envoy retried on another replica
    wait_for(lambda: s.replica_state("r1")["state"] == "EJECTED", 10, "r1 EJECTED by scraping")
    before = s.replica_state("r1")["decisions"]
    served = [chat(c, system=f"after ejection {i}") for i in range(12)]
    assert "r1" not in served
    assert s.replica_state("r1")["decisions"] == before  # no user request reaches an EJECTED replica
    # recovery: scrapes alone bring it back (2 good scrapes after the cooldown, then the clean window)
    s.restart_replica("r1")
    wait_for(lambda: s.replica_state("r1")["state"] == "PROBING", 20, "r1 PROBING")
    wait_for(lambda: s.replica_state("r1")["state"] == "LIVE", 20, "r1 LIVE")
    quiet(s)
    served = {chat(c, system=f"after recovery {i}") for i in range(9)}
    assert "r1" in served


def test_the_brain_killed_traffic_continues_through_the_fail_open_route(own_stack):
    s = own_stack(2)
    s.wait_all_live(30)
    c = client(s)
    assert chat(c).startswith("r")
    before = fallback_count(s)
    s.brain.kill()
    served = [chat(c, system=f"no brain {i}") for i in range(6)]
    assert all(x.startswith("r") for x in served)
    assert fallback_count(s) >= before + 6  # counted in Envoy's stats as fail-open traffic
    # a client's routing header does not pick the replica while the brain is away
    r1_before = cluster_rq(s, "r1")
    spoof = client(s, **{"x-warmroute-cluster": "r1"})
    for i in range(5):
        chat(spoof, system=f"spoof without brain {i}")
    assert cluster_rq(s, "r1") == r1_before
    # C7: the fail-open route is a ring hash on the session header, so a session keeps its replica (cache)
    for sid in ("sess-a", "sess-b", "sess-c"):
        cs = client(s, **{"x-session-id": sid})
        assert len({chat(cs, system=f"{sid} turn {k}") for k in range(4)}) == 1
    stats = s.envoy_stats()
    assert stats.get("http.ingress.ext_proc.warmroute.failure_mode_allowed", 0) + \
        stats.get("cluster.warmroute_brain.upstream_cx_connect_fail", 0) >= 1

    # A new brain takes over the dead one's Unix socket, and Envoy routes through it again.
    assert os.path.exists(s.cfg.brain.grpc_socket)  # SIGKILL leaves the socket file behind
    s.start_brain()
    wait_for(s.brain_healthy_in_envoy, 30, "Envoy to see the new brain healthy")
    s.wait_all_live(30)
    before = fallback_count(s)
    assert chat(c, system="brain is back").startswith("r")
    assert fallback_count(s) == before
    assert sum(r["decisions"] for r in s.state()["replicas"]) == 1


def test_reservations_of_a_killed_envoy_are_released_within_seconds_and_never_twice(own_stack):
    import threading

    s = own_stack(2, mock_args=["--speedup", "1"])
    s.wait_all_live(30)
    c = client(s)
    assert chat(c).startswith("r")  # Envoy's access-log stream to the brain is open from here on
    wait_for(lambda: s.state()["open_reservations"] == 0 and s.state()["access_log_streams"] >= 1, 10,
             "an open log stream")
    before = s.state()

    def long_stream(i):
        try:
            for _ in c.chat.completions.create(model="mock-coder-30b", messages=[{"role": "user",
                                                                                  "content": f"long {i}"}],
                                               max_tokens=2000, stream=True):
                pass
        except Exception:
            pass  # Envoy dies under it

    threads = [threading.Thread(target=long_stream, args=(i,), daemon=True) for i in range(6)]
    for t in threads:
        t.start()
    wait_for(lambda: s.state()["open_reservations"] == 6, 30, "6 streams in flight")
    s.envoy.kill()
    wait_for(lambda: s.state()["open_reservations"] == 0, 10, "the dead Envoy's reservations released")
    after = s.state()
    assert after["released_envoy_gone"] - before["released_envoy_gone"] == 6
    assert after["releases_by_access_log"] == before["releases_by_access_log"]  # their entries died with Envoy
    for t in threads:
        t.join(30)
    # a new Envoy routes through the brain again; its requests release by the access log as before
    s.start_envoy()
    c2 = client(s, **{"x-session-id": "after-restart"})
    assert chat(c2, system="after restart").startswith("r")
    wait_for(lambda: s.state()["open_reservations"] == 0, 10, "release after the restart")
    final = s.state()
    assert final["releases_by_access_log"] == after["releases_by_access_log"] + 1
    assert final["released_envoy_gone"] == after["released_envoy_gone"]


def test_503_with_json_and_retry_after_when_no_replica_is_known(own_stack):
    s = own_stack(0)
    status, headers, body = raw_post(s, json.dumps({"model": "mock-coder-30b", "messages": [{"role": "user",
                                                                                             "content": "hi"}]}).encode())
    assert status == 503
    assert headers.get("retry-after") or headers.get("Retry-After")
    err = json.loads(body)["error"]
    assert err["code"] == "no_healthy_instances"
    with pytest.raises(openai.APIStatusError) as e:
        chat(client(s))
    assert e.value.status_code == 503


def test_a_config_that_also_sends_the_headers_message_routes_by_the_brain(own_stack):
    """Users on the two-message ext_proc mode (request headers, then body) keep working."""
    from extproc.envoy_config import bootstrap, extension_of

    import dataclasses

    s = own_stack(3, envoy=False)
    cfg = s.live_config()  # every turn through the body's call: the header path would decide turns 2-4 at their headers
    doc = bootstrap(dataclasses.replace(cfg, envoy=dataclasses.replace(cfg.envoy, header_path=False)))
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext = extension_of(next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"))
    ext["processing_mode"]["request_header_mode"] = "SEND"
    s.start_envoy(doc)
    s.wait_all_live(30)
    c = client(s, **{"x-session-id": "two-messages"})
    served = {chat(c, system=f"two messages {i}") for i in range(4)}
    assert len(served) == 1  # sticky by the header: the brain decided each one
    assert decisions(s) == 4 and fallback_count(s) == 0
    assert s.envoy_stats()["http.ingress.ext_proc.warmroute.stream_msgs_sent"] == 8  # headers + body, each
    wait_for(lambda: s.state()["open_reservations"] == 0, 10, "releases")
