"""Several models behind one Envoy: replicas learned from their own /v1/models and /openapi.json, requests only to
replicas that serve the body's model and the path's API (counted by Envoy), an unknown model answered 404 in vLLM's
shape, GET /v1/models the fleet's union, and an alias rewritten in the body the replica receives."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from extproc.tools.stack import Stack, http_get, wait_for

from .conftest import FAST

pytestmark = pytest.mark.integration


def post(stack, model: str, session: str, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    doc = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": f"{session} hi"}]}
    if path == "/v1/embeddings":
        doc = {"model": model, "input": f"{session} hi"}
    req = urllib.request.Request(stack.url + path, data=json.dumps(doc).encode(),
                                 headers={"content-type": "application/json", "x-session-id": session})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def upstream_requests(stack) -> dict[str, int]:
    out = {}
    for line in http_get(stack.envoy_admin + "/stats?filter=upstream_rq_total$").decode().splitlines():
        name, _, value = line.partition(": ")
        if name.startswith("cluster.r"):
            out[name.split(".")[1]] = int(value)
    return out


def test_requests_reach_only_replicas_serving_their_model_and_path():
    config = {**FAST, "models": {"aliases": {"assistant": [{"model": "chat", "weight": 1}]}}}
    s = Stack(5, config=config, mock_args=["--speedup", "20"])
    # r4 serves "chat" as a pooling model (vLLM --runner pooling): embeddings, and no completion routes
    s.replica_args = {"r0": ["--model", "coder"], "r1": ["--model", "coder"], "r2": ["--model", "chat"],
                      "r3": ["--model", "chat"], "r4": ["--model", "chat", "--runner", "pooling"]}
    with s:
        wait_for(lambda: all(r["state"] == "LIVE" for r in s.state()["replicas"]), 30, "all LIVE")
        wait_for(lambda: all(r.get("models") and r.get("paths") for r in s.state()["replicas"]), 10,
                 "every replica's models and paths read")
        before = upstream_requests(s)
        for i in range(12):
            assert post(s, "coder", f"c{i}")[0] == 200
            status, doc = post(s, "assistant", f"a{i}")  # an alias: the body says "chat" when it reaches r2/r3
            assert status == 200 and doc["model"] == "chat"
        for i in range(4):
            status, doc = post(s, "chat", f"e{i}", "/v1/embeddings")
            assert status == 200 and doc["data"][0]["object"] == "embedding", (status, doc)
        after = upstream_requests(s)
        sent = {r: after.get(r, 0) - before.get(r, 0) for r in ("r0", "r1", "r2", "r3", "r4")}
        assert sent["r0"] + sent["r1"] == 12 and sent["r2"] + sent["r3"] == 12 and sent["r4"] == 4, sent
        status, doc = post(s, "coder", "x", "/v1/embeddings")  # coder's replicas generate: none embeds
        assert status == 404 and doc["error"]["type"] == "NotFoundError" and "/v1/embeddings" in doc["error"]["message"]
        assert upstream_requests(s) == after
        status, doc = post(s, "gpt-4o", "x")
        # vLLM 0.32's answer (tests/fixtures/vllm-0.32/errors.json), naming the fleet's models
        assert status == 404 and doc == {"error": {"message": "The model `gpt-4o` does not exist. Valid aliases: chat, coder.",
                                                   "type": "NotFoundError", "param": "model", "code": 404}}
        assert upstream_requests(s) == after  # refused at the edge: no replica was asked
        listed = json.loads(http_get(s.url + "/v1/models"))
        assert [m["id"] for m in listed["data"]] == ["assistant", "chat", "coder"]
