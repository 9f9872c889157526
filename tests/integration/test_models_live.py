"""Several models behind one Envoy: replicas learned from their own /v1/models and /openapi.json, requests only to
replicas that serve the body's model and the path's API (counted by Envoy), an unknown model answered 404 in vLLM's
shape, GET /v1/models the fleet's union, and an alias rewritten in the body the replica receives."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from extproc.tools.stack.local import Stack, http_get, wait_for

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
        assert status == 404 and doc == {"error": {"message": "The model `gpt-4o` does not exist. Valid aliases: chat, "
                                                   "coder.",
                                                   "type": "NotFoundError", "param": "model", "code": 404}}
        assert upstream_requests(s) == after  # refused at the edge: no replica was asked
        listed = json.loads(http_get(s.url + "/v1/models"))
        assert [m["id"] for m in listed["data"]] == ["assistant", "chat", "coder"]


def test_bodies_above_the_brain_s_limit_reach_only_replicas_of_their_model_and_charge_nothing_until_they_arrive():
    """Issue 43: a 3 MB body (Content-Length, its model last as the OpenAI SDK writes it) went to the other model's
    replicas 2-8 times in 8 (engine 404), a 4 MB chunked one failed open (1 in 8: 404), and a declaration whose body
    never came steered routing for as long as its connection stayed open. Envoy now reads such a body's model into
    metadata for the brain, and holds the headers until the body is all there."""
    import asyncio

    import aiohttp

    s = Stack(4, config=FAST, mock_args=["--speedup", "20"])
    s.replica_args = {"r0": ["--model", "coder"], "r1": ["--model", "coder"], "r2": ["--model", "chat"],
                      "r3": ["--model", "chat"]}
    with s:
        wait_for(lambda: all(r["state"] == "LIVE" for r in s.state()["replicas"]), 30, "all LIVE")
        wait_for(lambda: all(r.get("models") for r in s.state()["replicas"]), 10, "every replica's models read")

        def body(model: str, size: int) -> bytes:  # the SDK's key order: messages first, model after
            return json.dumps({"messages": [{"role": "user", "content": "def f(x):\n    return x\n" * (size // 24)}],
                              "model": model, "max_tokens": 2}).encode()

        decided = lambda: sum(r["decisions"] for r in s.state()["replicas"])  # noqa: E731

        async def run():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
                async def one(data, chunked: bool, model: str) -> int:
                    if chunked:
                        raw = data

                        async def gen():
                            for i in range(0, len(raw), 256 * 1024):
                                yield raw[i:i + 256 * 1024]
                        data = gen()
                    async with http.post(s.url + "/v1/chat/completions", data=data, headers={
                            "content-type": "application/json", "x-session-id": f"{model}-{chunked}"}) as r:
                        await r.read()
                        return r.status

                # a declaration whose body stops halfway and stays open: the brain is not asked meanwhile
                half = body("chat", 3_000_000)
                before = decided()

                async def held():
                    yield half[: len(half) // 2]
                    await asyncio.sleep(3600)

                stalled = asyncio.ensure_future(http.post(s.url + "/v1/chat/completions", data=held(), headers={
                    "content-type": "application/json", "content-length": str(len(half))}))
                got = []
                for model in ("chat", "coder"):
                    for chunked, size in ((False, 3_000_000), (True, 4_000_000)):
                        got += await asyncio.gather(*(one(body(model, size), chunked, model) for _ in range(4)))
                charged_while_held = decided() - before - 16
                stalled.cancel()
                return got, charged_while_held

        mark = upstream_requests(s)
        got, charged = asyncio.run(run())
        after = upstream_requests(s)
        sent = {r: after.get(r, 0) - mark.get(r, 0) for r in ("r0", "r1", "r2", "r3")}
        # every one answered by its model's engine (the mock answers 400 for a prompt past its context, never 404)
        assert 404 not in got, got
        assert sent["r0"] + sent["r1"] == 8 and sent["r2"] + sent["r3"] == 8, sent
        assert charged == 0, f"the held declaration was decided ({charged})"
