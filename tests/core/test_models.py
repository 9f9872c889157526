"""Several models in one fleet: each request goes only to replicas that serve its body's model, a model none
serves is answered as vLLM answers it, GET /v1/models lists the fleet's, and aliases map a client's name to
served names (weighted, for canaries)."""

from __future__ import annotations

import json
from collections import Counter

import orjson
import pytest

from extproc.config import ConfigError, parse_config
from extproc.contract import METADATA_NAMESPACE
from extproc.core.models import ModelCatalog, Target
from extproc.core.profile import build_profile, replace_model
from extproc.core.config import ProfileConfig
from extproc.picker.front import EndpointPicker

from ..helpers import envoy_decide, live_brain

REPLICAS = [{"name": f"r{i}", "url": f"http://127.0.0.1:{8001 + i}"} for i in range(4)]


def catalog(**aliases) -> ModelCatalog:
    c = ModelCatalog(aliases, seed=1)
    c.configure({"r0": (), "r1": (), "r2": (), "r3": ()})
    for name, models in (("r0", ["coder"]), ("r1", ["coder"]), ("r2", ["chat", "chat-ft"]), ("r3", ["chat"])):
        c.learned(name, [{"id": m, "object": "model"} for m in models])
    return c


def test_a_request_goes_only_to_replicas_serving_its_model():
    c = catalog()
    assert c.resolve("coder").replicas == {"r0", "r1"}
    assert c.resolve("chat").replicas == {"r2", "r3"}
    assert c.resolve(None).replicas is None  # no model named: anywhere (vLLM serves its own)
    one = ModelCatalog()
    one.configure({"r0": ("m",), "r1": ("m",)})
    assert one.resolve("m").replicas is None  # served everywhere: no subset to cut
    assert c.resolve("nope").unknown


def test_a_replica_whose_models_are_not_known_yet_may_take_a_model_no_known_replica_serves():
    c = catalog()
    c.configure({"r0": (), "r1": (), "r2": (), "r3": (), "r4": ()})  # r4 new: not scraped yet
    assert c.resolve("coder").replicas == {"r0", "r1"}  # known servers first
    assert c.resolve("nope").replicas == {"r4"}  # not refused while a replica could still serve it
    c.learned("r4", [])
    assert c.resolve("nope").unknown


def test_configured_models_are_not_overwritten_by_scrapes_and_a_failed_read_keeps_the_last_list():
    c = ModelCatalog()
    c.configure({"r0": ("base",), "r1": ()})
    c.learned("r0", [{"id": "other"}])
    c.learned("r1", [{"id": "chat"}])
    c.learned("r1", None)  # /v1/models could not be read this time
    assert c.resolve("base").replicas == {"r0"} and c.resolve("chat").replicas == {"r1"}


def test_an_alias_splits_sessions_by_weight_and_keeps_each_session_on_its_target():
    c = catalog(assistant=(Target("chat", 90.0), Target("chat-ft", 10.0)))
    picks = Counter(c.resolve("assistant", f"s{i}".encode()).model for i in range(2000))
    assert 0.85 < picks["chat"] / 2000 < 0.95 and picks["chat-ft"] > 0
    first = c.resolve("assistant", b"s7")
    assert all(c.resolve("assistant", b"s7").model == first.model for _ in range(20))
    r = c.resolve("assistant", b"s1")
    assert r.rewritten and r.replicas == ({"r2"} if r.model == "chat-ft" else {"r2", "r3"})


def test_the_union_lists_each_model_once_and_the_aliases_whose_targets_exist():
    c = catalog(assistant=(Target("chat", 1.0),), ghost=(Target("gone", 1.0),))
    assert [m["id"] for m in c.union()] == ["assistant", "chat", "chat-ft", "coder"]


def test_the_body_s_model_is_read_parsed_or_not_and_rewritten_in_place():
    body = orjson.dumps({"model": "assistant", "messages": [{"role": "user", "content": "x" * 10}]})
    assert build_profile({}, body, ProfileConfig()).model == "assistant"
    big = ProfileConfig(parse_max_bytes=10)  # not parsed: read from its head
    assert build_profile({}, body, big).model == "assistant"
    new = replace_model(body, "chat-ft")
    assert json.loads(new) == {**json.loads(body), "model": "chat-ft"}
    assert replace_model(b'{"messages": []}', "x") is None


def test_aliases_in_the_config_and_their_errors():
    cfg = parse_config({"replicas": REPLICAS[:1], "models": {"aliases": {
        "coder": "qwen", "chat": [{"model": "a", "weight": 9}, {"model": "b", "weight": 1}]}}})
    assert dict(cfg.aliases) == {"coder": (Target("qwen", 1.0),), "chat": (Target("a", 9.0), Target("b", 1.0))}
    for bad, field in (({"aliases": {"x": [{"model": "a", "weight": 0}]}}, "models.aliases.x[0].weight"),
                       ({"aliases": {"x": []}}, "models.aliases.x"), ({"alias": {}}, "models.alias"),
                       ({"aliases": {"x": [{"name": "a"}]}}, "models.aliases.x[0]")):
        with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
            parse_config({"replicas": REPLICAS[:1], "models": bad})
    with pytest.raises(ConfigError, match=r"replicas\[0\].models"):
        parse_config({"replicas": [{**REPLICAS[0], "models": "coder"}]})


def _brain(**models_cfg):
    reps = [{**REPLICAS[0], "models": ["coder"]}, {**REPLICAS[1], "models": ["coder"]},
            {**REPLICAS[2], "models": ["chat"]}, {**REPLICAS[3], "models": ["chat", "chat-ft"]}]
    # flow control off: these requests never end, and a new session behind a queue on every replica would wait
    return live_brain(parse_config({"replicas": reps, "flow_control": {"enabled": False},
                                    **({"models": models_cfg} if models_cfg else {})}))


def _cluster(out) -> str:
    return out.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields["cluster"].string_value


def test_the_brain_routes_by_model_answers_404_as_vllm_does_and_lists_the_union():
    brain = _brain()
    for i in range(20):
        body = orjson.dumps({"model": "chat", "messages": [{"role": "user", "content": f"q{i}"}]})
        assert _cluster(envoy_decide(brain, {"x-session-id": f"s{i}"}, body)) in ("r2", "r3")
    out = envoy_decide(brain, {}, orjson.dumps({"model": "nope", "messages": []}))
    assert out.immediate_response.status.code == 404
    assert json.loads(out.immediate_response.body) == {"error": {
        "message": "The model `nope` does not exist. Valid aliases: chat, chat-ft, coder.", "type": "NotFoundError",
        "param": "model", "code": 404}}
    assert brain.state()["decisions_by_reason"].get("-/model_not_found") == 1
    models = envoy_decide(brain, {":method": "GET", ":path": "/v1/models"}, None, "request_headers")
    assert models.immediate_response.status.code == 200
    assert [m["id"] for m in json.loads(models.immediate_response.body)["data"]] == ["chat", "chat-ft", "coder"]


def test_an_alias_is_rewritten_in_the_body_the_replica_gets():
    brain = _brain(aliases={"assistant": [{"model": "chat-ft"}]})
    body = orjson.dumps({"model": "assistant", "messages": [{"role": "user", "content": "hi"}]})
    out = envoy_decide(brain, {"x-session-id": "s"}, body)
    assert _cluster(out) == "r3"
    assert json.loads(out.request_body.response.body_mutation.body)["model"] == "chat-ft"


async def _picker_answer(brain, body: bytes) -> list:
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    picker = EndpointPicker(brain.picks.pick, brain.picks.end, 1 << 20)
    st_headers = ep.ProcessingRequest(request_headers=ep.HttpHeaders(end_of_stream=False))
    st_body = ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))
    from extproc.picker.front import _Stream

    st = _Stream()
    return [*await picker._step(st, st_headers, None), *await picker._step(st, st_body, None)]


def test_the_picker_answers_404_for_an_unknown_model_and_sends_the_rewritten_body():
    import asyncio

    brain = _brain(aliases={"assistant": [{"model": "chat-ft"}]})
    out = asyncio.run(_picker_answer(brain, orjson.dumps({"model": "nope", "messages": []})))
    assert out[0].immediate_response.status.code == 404
    body = orjson.dumps({"model": "assistant", "messages": [{"role": "user", "content": "hi"}]})
    out = asyncio.run(_picker_answer(brain, body))
    sent = b"".join(o.request_body.response.body_mutation.streamed_response.body for o in out[1:])
    assert json.loads(sent)["model"] == "chat-ft"
    lengths = [h.header.raw_value for h in out[0].request_headers.response.header_mutation.set_headers
               if h.header.key == "content-length"]
    assert lengths == [str(len(sent)).encode()]


def test_a_replica_s_models_list_is_bounded_whatever_it_sends():
    """What the brain keeps of a /v1/models answer: ids and a few fields of bounded size, at most MAX_MODELS."""
    from extproc.brain.scraper import MAX_MODEL_FIELD_CHARS, MAX_MODELS, parse_models

    long = "x" * (MAX_MODEL_FIELD_CHARS + 1)
    got = parse_models(json.dumps({"data": [
        {"id": "m", "parent": None, "root": long, "max_model_len": 32768, "extra": {"nested": "dropped"}},
        {"id": long}, {"id": ""}, {"id": 7}, "not an object"]}))
    assert got == [{"id": "m", "max_model_len": 32768}]
    assert parse_models(json.dumps({"data": [{"id": f"m{i}"} for i in range(MAX_MODELS + 1)]})) is None
    for bad in ("<html>", "[]", '{"data": {}}', '{"object": "list"}'):
        assert parse_models(bad) is None


# ---------------------------------------------------------------- the path's API


def test_a_request_goes_only_to_replicas_serving_its_path_and_model():
    """vLLM registers routes by the model's tasks: a pooling replica has /v1/embeddings and no chat."""
    c = catalog()
    chat_paths = ["/v1/chat/completions", "/v1/completions", "/v1/responses/{response_id}", "/v1/models"]
    c.learned_paths("r0", chat_paths)
    c.learned_paths("r1", ["/v1/embeddings", "/pooling", "/v1/models"])
    c.learned_paths("r2", chat_paths)
    # r3: no /openapi.json read yet: any path
    assert c.resolve("coder", path="/v1/chat/completions").replicas == {"r0"}
    assert c.resolve("coder", path="/v1/embeddings").replicas == {"r1"}
    assert c.resolve(None, path="/v1/embeddings").replicas == {"r1", "r3"}  # no model: every replica of the path
    assert c.resolve("chat", path="/v1/responses/resp_123").replicas == {"r2", "r3"}  # a {param} is one segment
    assert c.resolve("chat", path="/v1/responses/a/b").replicas == {"r3"}
    assert c.resolve("chat", path="/v1/chat/completions").replicas == {"r2", "r3"}
    c.learned_paths("r3", chat_paths)
    res = c.resolve("chat", path="/v1/embeddings")
    assert res.replicas == frozenset() and res.unserved_path == "/v1/embeddings" and not res.unknown
    assert c.resolve("nope", path="/v1/chat/completions").unknown  # the model is what is missing
    assert c.resolve("coder").replicas == {"r0", "r1"}  # no path given (a caller that has none): models only


def test_paths_configured_win_and_prefixes_match():
    c = ModelCatalog()
    c.configure({"r0": (), "r1": ()}, {"r0": ("/v1/*",)})
    assert c.learned_paths("r0", ["/pooling"]) is False  # configured: scrapes do not change it
    c.learned_paths("r1", ["/pooling"])
    assert c.resolve(None, path="/v1/anything/at/all").replicas == {"r0"}
    assert c.resolve(None, path="/pooling").replicas == {"r1"}
    c.learned_paths("r1", None)  # a restart without /openapi.json: any path again
    assert c.resolve(None, path="/pooling").replicas == {"r1"}
    c.configure({"r0": (), "r1": ()})  # r0's paths no longer configured: to be learned; r1 keeps what it listed
    assert c.paths_of("r0") is None and c.resolve(None, path="/pooling").replicas is None
    c.learned_paths("r1", ["/pooling"])
    c.configure({"r0": ()})
    assert c.paths_of("r1") is None and c.resolve(None, path="/pooling").replicas is None


def test_the_brain_answers_404_for_a_path_no_replica_of_the_model_serves():
    reps = [{**REPLICAS[0], "models": ["m"], "paths": ["/v1/chat/completions"]},
            {**REPLICAS[1], "models": ["m"], "paths": ["/v1/embeddings"]}]
    brain = live_brain(parse_config({"replicas": reps}))
    body = orjson.dumps({"model": "m", "input": "hi"})
    for i in range(6):
        assert _cluster(envoy_decide(brain, {":path": "/v1/embeddings?x=1", "x-session-id": f"s{i}"}, body)) == "r1"
        assert _cluster(envoy_decide(brain, {":path": "/v1/chat/completions", "x-session-id": f"s{i}"}, body)) == "r0"
    out = envoy_decide(brain, {":path": "/v1/audio/transcriptions"}, body)
    assert out.immediate_response.status.code == 404
    err = json.loads(out.immediate_response.body)["error"]
    assert err["type"] == "NotFoundError" and "/v1/audio/transcriptions" in err["message"]
    assert brain.state()["decisions_by_reason"].get("-/path_not_served") == 1
    assert [r["paths"] for r in brain.state()["replicas"]] == [["/v1/chat/completions"], ["/v1/embeddings"]]


def test_the_picker_answers_404_for_a_path_no_replica_serves():
    import asyncio

    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from envoy.config.core.v3 import base_pb2

    reps = [{**REPLICAS[0], "paths": ["/v1/chat/completions"]}, {**REPLICAS[1], "paths": ["/v1/chat/completions"]}]
    brain = live_brain(parse_config({"replicas": reps}))
    picker = EndpointPicker(brain.picks.pick, brain.picks.end, 1 << 20)
    from extproc.picker.front import _Stream

    async def ask(path: str):
        st = _Stream()
        hs = ep.HttpHeaders(end_of_stream=False, headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=":path", raw_value=path.encode())]))
        body = ep.ProcessingRequest(request_body=ep.HttpBody(body=b'{"input": "x"}', end_of_stream=True))
        head = await picker._step(st, ep.ProcessingRequest(request_headers=hs), None)
        return [*head, *await picker._step(st, body, None)]

    out = asyncio.run(ask("/v1/embeddings"))
    assert out[-1].immediate_response.status.code == 404
    assert "/v1/embeddings" in json.loads(out[-1].immediate_response.body)["error"]["message"]
    out = asyncio.run(ask("/v1/chat/completions"))
    assert not any(o.HasField("immediate_response") for o in out)


def test_a_replica_s_openapi_paths_are_bounded_and_configured_paths_are_checked():
    from extproc.brain.scraper import parse_openapi_paths
    from extproc.core.models import MAX_PATH_CHARS, MAX_PATHS

    doc = {"paths": {"/v1/chat/completions": {"post": {}}, "/" + "x" * MAX_PATH_CHARS: {}, "relative": {}}}
    assert parse_openapi_paths(json.dumps(doc)) == ["/v1/chat/completions"]
    assert parse_openapi_paths(json.dumps({"paths": {f"/p{i}": {} for i in range(MAX_PATHS + 1)}})) is None
    for bad in ("<html>", "[]", '{"paths": []}', '{"paths": {}}', '{"info": {}}'):
        assert parse_openapi_paths(bad) is None
    for paths in ("/v1/chat/completions", ["v1/chat"], ["/a b"], [7]):
        with pytest.raises(ConfigError, match=r"^replicas\[0\]\.paths: "):
            parse_config({"replicas": [{**REPLICAS[0], "paths": paths}]})


def test_a_hostile_path_template_costs_a_linear_match():
    """Templates come from whatever answers a replica's /openapi.json: `/{a}{b}...x` compiled to a regex
    backtracked for minutes on a 40-character path (the brain's event loop with it). Matched by segments, a
    segment holding a parameter is any one non-empty segment."""
    from extproc.core.models import path_matches, path_pattern

    c = ModelCatalog()
    c.configure({"r0": (), "r1": ()})
    c.learned_paths("r0", ["/" + "{a}" * 80 + "x", "/v1/files/{id}.json"])
    c.learned_paths("r1", ["/v1/chat/completions"])
    assert c.resolve(None, path="/" + "y" * 250).replicas == {"r0"}
    assert c.resolve(None, path="/v1/files/abc").replicas == {"r0"}
    assert c.resolve(None, path="/v1/files/abc/more").unserved_path == "/v1/files/abc/more"
    prefix = path_pattern("/v1/resp*")
    assert path_matches(prefix, "/v1/responses/r1") and path_matches(prefix, "/v1/resp")
    assert not path_matches(prefix, "/v2/responses") and not path_matches(path_pattern("/{id}"), "/")


def test_the_brain_remembers_what_it_decided_by_envoy_s_request_id_and_forgets_past_its_bound():
    from extproc.brain.decision_log import RECENT_DECISIONS

    brain = _brain()
    body = orjson.dumps({"model": "chat", "messages": [{"role": "user", "content": "q"}]})
    out = envoy_decide(brain, {"x-request-id": "rid-1", "x-session-id": "s"}, body)
    got = brain.recent_decisions(request_id="rid-1")
    assert [d["replica"] for d in got] == [_cluster(out)] and got[0]["model"] == "chat"
    for i in range(RECENT_DECISIONS):
        envoy_decide(brain, {"x-request-id": f"other-{i}"}, body)
    assert brain.recent_decisions(request_id="rid-1") == []  # bounded: the oldest went
    assert len(brain.recent_decisions(last=10 ** 9)) == RECENT_DECISIONS
    assert [d["request_id"] for d in brain.recent_decisions(last=2)] == [f"other-{RECENT_DECISIONS - 2}",
                                                                         f"other-{RECENT_DECISIONS - 1}"]
