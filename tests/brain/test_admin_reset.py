"""The admin API's prefix-cache reset (issue 45): the brain empties its view of a replica's cache only when the
engine says it emptied its own."""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from extproc.brain.admin import admin_app
from extproc.brain.brain import Brain
from extproc.config import parse_config
from extproc.core.engine_cache import EngineCache, Stored, chain, external, none_hash


def test_the_view_is_emptied_when_the_engine_emptied_its_cache_and_not_before():
    answers = [web.json_response({"success": False}), web.json_response({"success": True})]

    async def reset(_):
        return answers.pop(0)

    async def scene() -> None:
        engine = web.Application()
        engine.router.add_post("/reset_prefix_cache", reset)
        async with TestServer(engine, host="127.0.0.1") as es:
            b = Brain(parse_config({"replicas": [{"name": "r0", "url": str(es.make_url("")).rstrip("/")}]}))
            toks = tuple(range(64))
            ev = Stored(tuple(external(d) for d in chain(toks, 16, none_hash())), None, toks, 16)
            assert b.router.policy.apply_events("r0", 0, [ev], 0.0, EngineCache)
            resident = lambda: b.exact.replica_view("r0")["engines"][0]["resident_blocks"]  # noqa: E731
            async with TestClient(TestServer(admin_app(b), host="127.0.0.1")) as c:
                r = await c.post("/replicas/r0/reset_prefix_cache")  # blocks held: vLLM reset nothing
                assert r.status == 409 and resident() == 4
                r = await c.post("/replicas/r0/reset_prefix_cache")
                assert r.status == 200 and (await r.json())["reset"] is True and resident() == 0
                assert b.exact.replica_view("r0")["mode"] == "exact"  # emptied, still the engine's word
                assert (await c.post("/replicas/nope/reset_prefix_cache")).status == 404

    asyncio.run(scene())
