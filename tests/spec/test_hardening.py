"""Hardening, third round (issue 30): nothing a client declares moves routing, and long bodies are routed by the
model the engine reads. Each test here was seen failing on the code before the change."""

from __future__ import annotations

import json
import math
from collections import Counter

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.config import parse_config
from extproc.contract import METADATA_NAMESPACE
from extproc.core.profile import build_profile, engine_model, replace_model
from extproc.core.config import ProfileConfig
from extproc.core.toplevel import UNKNOWN, scan_model

from ..helpers import envoy_decide, live_brain

REPLICAS = [{"name": f"r{i}", "url": f"http://127.0.0.1:{8001 + i}"} for i in range(4)]


def _cluster(out) -> str:
    return out.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields["cluster"].string_value


def _predicted(brain, now: float) -> dict[str, tuple[float, int, float]]:
    """Per replica: the predicted prefill wait ahead, pending KV tokens and in-flight work the brain holds."""
    pol = brain.router.policy
    out = {}
    for r in brain.router.replicas:
        s = pol.state_of(r)
        out[r.name] = (round(max(0.0, s.prefill_busy_until - now), 6), s.pending_tokens, round(s.work_s, 6))
    return out


def _small(i: int) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "system", "content": "agent " * 50},
                                                    {"role": "user", "content": f"question {i} " * 20}]})


def _route_twenty(brain) -> list[int]:
    """How 20 conversations of their own (nothing cached in common) spread: requests per replica, sorted."""
    out = Counter()
    for i in range(20):
        body = orjson.dumps({"model": "m", "messages": [{"role": "system", "content": f"agent {i} " * 50}]})
        out[brain.choose({"x-session-id": f"s{i}"}, body).replica_name] += 1
    return sorted(out.values())


def test_a_declared_size_is_bounded_and_every_prediction_it_made_is_taken_back_when_it_ends():
    """The probe: four header-only requests declaring 60 MB (and one 10^15), closed at once (a 413, a reset)."""
    brain = live_brain(parse_config({"replicas": REPLICAS}))
    fresh = live_brain(parse_config({"replicas": REPLICAS}))
    now = brain.clock()
    for name in ("r0", "r1", "r2", "r3"):
        brain.models.learned(name, [{"id": "m", "object": "model", "max_model_len": 8192}])
        fresh.models.learned(name, [{"id": "m", "object": "model", "max_model_len": 8192}])
    idle = _predicted(brain, now)
    probes = []
    for i, size in enumerate(["60000000"] * 4 + ["1" + "0" * 15]):
        d = brain.choose({"x-session-id": f"probe{i}", "content-length": size, ":path": "/v1/chat/completions"}, None)
        assert d.reservation.provisional
        probes.append(d)
    # what a declared size is charged is bounded by what the model takes: 8,192 tokens, not 15 million
    rate = brain.cfg.router.warm.prefill_tokens_per_s
    assert all(w <= 5 * 8192 / rate for w, _, _ in _predicted(brain, now).values())
    for d in probes:
        brain.router.release(d.reservation, now)
    assert _predicted(brain, now) == idle
    assert _route_twenty(brain) == _route_twenty(fresh) == [5, 5, 5, 5]


def test_a_prediction_is_taken_back_whatever_ends_the_request_first():
    """An ordinary request that ends before its predicted prefill did leaves nothing queued ahead of others."""
    brain = live_brain(parse_config({"replicas": REPLICAS}))
    now = brain.clock()
    idle = _predicted(brain, now)
    ds = [brain.choose({"x-session-id": f"s{i}"}, _small(i)) for i in range(12)]
    assert _predicted(brain, now) != idle
    for d in reversed(ds):  # out of order: each takes back only its own part
        brain.router.release(d.reservation, now)
    assert _predicted(brain, now) == idle


def test_an_estimate_from_a_body_is_bounded_by_the_largest_max_model_len_too():
    brain = live_brain(parse_config({"replicas": REPLICAS}))
    for name in ("r0", "r1", "r2", "r3"):
        brain.models.learned(name, [{"id": "m", "object": "model", "max_model_len": 4096}])
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 400_000}]})
    assert brain.choose({}, body).reservation.weight_milli == brain.router.weight_milli(4096)
    p = build_profile({"content-length": "9" * 5000}, None, ProfileConfig())
    assert p.tokens == ProfileConfig().max_prompt_tokens and p.provisional


# ---------------------------------------------------------------- the model the engine reads


def _openai_sdk_body(content_bytes: int, model: str = "coder") -> bytes:
    """The OpenAI Python SDK's layout: messages first, then model, then the tools (10 KB) last."""
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": "d" * 200,
                                               "parameters": {"type": "object",
                                                              "properties": {"x": {"type": "string"}}}}}
             for i in range(40)]
    turns = max(1, content_bytes // 2000)
    messages = [{"role": "system", "content": "You are a coding agent."}] + [
        {"role": "user" if k % 2 else "assistant",
         "content": "def f(x):\n    return \"x\" * 2\n" * 70} for k in range(turns)]
    return json.dumps({"messages": messages, "model": model, "stream": True, "tools": tools}).encode()


def _two_model_brain():
    reps = [{**REPLICAS[0], "models": ["coder"]}, {**REPLICAS[1], "models": ["coder"]},
            {**REPLICAS[2], "models": ["chat"]}, {**REPLICAS[3], "models": ["chat", "café-lora", "org/x"]}]
    return live_brain(parse_config({"replicas": reps}))


@pytest.mark.parametrize("size", [300_000, 2_000_000])
def test_a_long_openai_sdk_body_is_routed_by_its_model(size):
    brain = _two_model_brain()
    for i in range(4):
        body = _openai_sdk_body(size, "coder" if i % 2 else "chat")
        assert len(body) >= size * 0.9
        got = _cluster(envoy_decide(brain, {"x-session-id": f"s{i}"}, body))
        assert got in (("r0", "r1") if i % 2 else ("r2", "r3"))


@pytest.mark.parametrize("body,want", [
    (b'{"model": "coder", "messages": [], "model": "chat"}', "chat"),  # engines read the last duplicate
    (b'{"metadata": {"model": "coder"}, "messages": [], "model": "chat"}', "chat"),  # nested keys are not it
    (b'{"model": "chat", "temperature": NaN, "messages": []}', "chat"),  # json.loads reads NaN
    (b'{"model": "caf\\u00e9-lora", "messages": []}', "caf\u00e9-lora"),
    (b'{"model": "org\\/x", "messages": []}', "org/x"),
    (b'{"m\\u006fdel": "chat", "messages": []}', "chat"),
])
def test_the_model_is_the_top_level_one_the_engine_reads(body, want):
    assert engine_model(body) == json.loads(body)["model"] == want
    brain = _two_model_brain()
    out = envoy_decide(brain, {}, body)
    assert not out.HasField("immediate_response")  # served somewhere: never the brain's 404
    assert _cluster(out) in (("r0", "r1") if want == "coder" else ("r2", "r3"))


def test_a_body_no_parser_reads_goes_where_a_name_it_may_mean_is_served_never_404():
    brain = _two_model_brain()
    broken = b'{"messages": [{"role": "user", "content": "hi"}], "model": "coder", "tools": [tru'
    assert engine_model(broken) is UNKNOWN
    for _ in range(8):
        assert _cluster(envoy_decide(brain, {}, broken)) in ("r0", "r1")
    anything = b'{"model": "nobody-serves-this", "x": ['
    assert not envoy_decide(brain, {}, anything).HasField("immediate_response")


def test_an_alias_in_a_body_with_duplicates_is_rewritten_where_the_engine_reads_it():
    body = b'{"model": "a", "messages": [{"model": "keep"}], "model": "alias", "n": NaN}'
    new = replace_model(body, "served")
    assert json.loads(new)["model"] == "served" and json.loads(new)["messages"] == [{"model": "keep"}]
    assert math.isnan(json.loads(new)["n"])


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(["model", "m", "x", "mo\"del"]), inner,
                                                                max_size=4),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["model", "messages", "metadata", "modèl", "x"]), _json_values), max_size=6),
       st.booleans(), st.sampled_from(["", " ", "\n  "]))
def test_the_scanner_agrees_with_json_loads_on_the_top_level_model(pairs, ascii_only, ws):
    """Duplicates included: the pairs are written as they come, so a key may repeat."""
    body = ("{" + ws + ("," + ws).join(json.dumps(k, ensure_ascii=ascii_only) + ws + ":" + ws
                                       + json.dumps(v, ensure_ascii=ascii_only) for k, v in pairs) + ws + "}").encode()
    want = json.loads(body).get("model")
    want = want if isinstance(want, str) and 0 < len(want) <= 256 else None
    got, span = scan_model(body)
    assert got == want
    assert engine_model(body) == (json.loads(body).get("model") if isinstance(json.loads(body).get("model"), str)
                                  and json.loads(body).get("model") else None)
    if want is not None:
        assert json.loads(body[span[0]:span[1]]) == want


# ---------------------------------------------------------------- upstreams as real servers behave


def test_replica_connections_close_before_the_engines_keep_alive_and_any_early_reset_is_retried():
    from extproc.config import ConfigError
    from extproc.envoy_config import render
    from extproc.envoy_config.picker import pool_cluster

    cfg = parse_config({"replicas": REPLICAS})
    for cluster in (*render.replica_clusters(cfg), pool_cluster(cfg)):
        opts = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        idle = float(opts["common_http_protocol_options"]["idle_timeout"].rstrip("s"))
        assert 0 < idle < 5.0  # vLLM's and SGLang's uvicorn close a keep-alive connection idle 5 s
    retry_on = render.routes(cfg)[-1]["route"]["retry_policy"]["retry_on"].split(",")
    assert "reset" in retry_on and "connect-failure" in retry_on
    with pytest.raises(ConfigError, match=r"^envoy\.upstream_idle_timeout_s: "):
        parse_config({"replicas": REPLICAS, "envoy": {"upstream_idle_timeout_s": 30}})


# ---------------------------------------------------------------- the small ones


def test_session_pins_are_bounded_least_recently_used_first_and_counted():
    brain = live_brain(parse_config({"replicas": REPLICAS, "pins": {"max_pins": 50}}))
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    brain.choose({"x-session-id": "kept"}, body)
    for i in range(200):
        brain.choose({"x-session-id": f"invented-{i}"}, body)
        if i % 10 == 0:
            brain.choose({"x-session-id": "kept"}, body)  # used now and then: never the least recent
    pins = brain.router.session_pins
    assert len(pins) == 50 and pins.evicted == 151
    from extproc.core import hash_key
    assert pins.get(hash_key("session", None, "kept"), brain.clock()) is not None
    assert 'warmroute_pin_evictions_total{kind="session"} 151.0' in __import__("prometheus_client").generate_latest(
        brain.registry).decode()


def test_a_client_s_data_parallel_rank_is_dropped_at_the_edge():
    from extproc.contract import DP_RANK_HEADER
    from extproc.envoy_config import render

    removed = [m.get("remove") for m in render.early_header_mutation(parse_config({"replicas": REPLICAS}))[0]
               ["typed_config"]["mutations"]]
    assert DP_RANK_HEADER in removed


# ---------------------------------------------------------------- replica answers bounded in depth and content


def test_a_replica_answer_nested_100000_deep_is_refused_not_a_crash():
    from extproc.brain.scraper import parse_models, parse_openapi_paths

    deep = '{"data": ' + "[" * 100_000 + "]" * 100_000 + "}"
    assert parse_models(deep) is None
    assert parse_openapi_paths('{"paths": ' + "{\"a\": " * 100_000 + "1" + "}" * 100_001) is None


def test_model_ids_and_paths_with_escape_codes_or_newlines_are_not_kept():
    from extproc.brain.scraper import parse_models, parse_openapi_paths

    models = parse_models(json.dumps({"data": [{"id": "ok-model", "root": "\x1b[31mred"},
                                               {"id": "evil\nmodel"}, {"id": "\x1b]0;title\x07"}]}))
    assert models == [{"id": "ok-model"}]
    assert parse_openapi_paths(json.dumps({"paths": {"/v1/chat/completions": {}, "/v1/x\r\nSet-Cookie: a": {},
                                                     "/v1/a b": {}}})) == ["/v1/chat/completions"]


def test_many_path_templates_match_as_one_walk_and_agree_with_the_segment_matcher():
    import random

    from extproc.core.models import ModelCatalog, path_matches, path_pattern

    rnd = random.Random(7)
    words = ["v1", "responses", "x", "{id}", "{a}{b}", "models", "chat", "c"]
    templates = {"r0": set(), "r1": set()}
    for _ in range(2000):
        segs = [rnd.choice(words) for _ in range(rnd.randint(1, 5))]
        p = "/" + "/".join(segs) + ("*" if rnd.random() < 0.2 else "")
        templates[rnd.choice(["r0", "r1"])].add(p)
    c = ModelCatalog()
    c.configure({"r0": templates["r0"], "r1": templates["r1"], "r2": ["/only/here"]},
                {"r0": templates["r0"], "r1": templates["r1"], "r2": ["/only/here"]})
    for _ in range(500):
        path = "/" + "/".join(rnd.choice(["v1", "responses", "x", "abc", "chat", "cz",
                                          ""]) for _ in range(rnd.randint(1, 6)))
        want = {r for r, ps in templates.items()
                if any((p == path) if isinstance(path_pattern(p), str) else path_matches(path_pattern(p),
                                                                                         path) for p in ps)}
        got = c._serving_path(path)
        assert (got if got is not None else {"r0", "r1", "r2"}) == want | ({"r2"} if path == "/only/here" else set())


# ---------------------------------------------------------------- files and sockets in directories we do not own


def test_a_socket_or_token_directory_another_user_owns_or_may_write_is_refused(tmp_path):
    import os

    from extproc.brain.admin import write_admin_token
    from extproc.brain.server import claim_socket_path
    from extproc.config import ConfigError

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)  # nobody's
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    for d, why in ((theirs, "belongs to another user"), (shared, "may be written by other users")):
        with pytest.raises(ConfigError, match=f"^brain.grpc_socket: .*{why}"):
            claim_socket_path(str(d / "brain.sock"))
        with pytest.raises(ConfigError, match=f"^brain.admin_token_file: .*{why}"):
            write_admin_token(str(d / "admin.token"))
    mine = tmp_path / "mine"
    token = write_admin_token(str(mine / "admin.token"))
    assert (mine / "admin.token").read_text().strip() == token
    assert (mine / "admin.token").stat().st_mode & 0o777 == 0o600 and mine.stat().st_mode & 0o777 == 0o700
    assert [p.name for p in mine.iterdir()] == ["admin.token"]  # no temporary file left


def test_the_token_is_never_written_through_a_planted_link(tmp_path):
    import os

    from extproc.brain.admin import write_admin_token

    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    os.symlink(victim, d / "admin.token")  # the old name a link to somebody's file
    os.symlink(victim, d / f"admin.token.{os.getpid()}.tmp")  # and the temporary name a brain used to predict
    write_admin_token(str(d / "admin.token"))
    assert victim.read_text() == "precious\n" and not (d / "admin.token").is_symlink()
    assert (d / "admin.token").stat().st_mode & 0o777 == 0o600


def test_a_request_whose_end_came_before_its_decision_leaves_no_reservation():
    """A client that sends headers declaring 60 MB and is gone at once: Envoy's access-log entry can reach the brain
    before the brain has decided; the reservation made after it is released as it is made, not 25 s later."""
    from tests.brain.test_service import entry

    brain = live_brain(parse_config({"replicas": REPLICAS}))
    brain.on_log_entry(entry(request_id="gone-at-once", code=0, details="downstream_remote_disconnect"))
    headers = {"x-request-id": "gone-at-once", "content-length": "60000000", "x-session-id": "probe"}
    out = envoy_decide(brain, headers, None, "request_headers")
    assert _cluster(out)  # answered as usual (Envoy no longer listens)
    assert brain.router.open_reservations == 0 and brain.state()["released_at_issue"] == 1
    now = brain.clock()
    assert all(v == (0.0, 0, 0.0) for v in _predicted(brain, now).values())
    envoy_decide(brain, {**headers, "x-request-id": "another"}, None, "request_headers")
    assert brain.router.open_reservations == 1  # an ordinary request keeps its reservation
