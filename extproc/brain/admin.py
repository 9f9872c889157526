"""Loopback-only admin HTTP (state, pins, drain, reload) and the read-only /metrics app."""

from __future__ import annotations

import json
import os
import secrets
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..config import ConfigError
from ..core import hash_key
from . import logs
from .files import write_private_file

if TYPE_CHECKING:
    from .brain import Brain


def write_admin_token(path: str | None) -> str | None:
    """A fresh token in a file only the brain's user reads (0600 from its first byte), in a directory nobody else
    controls (``files.write_private_file``)."""
    if not path:
        return None
    token = secrets.token_urlsafe(24)
    path = os.path.abspath(path)
    try:
        write_private_file(path, token + "\n", "brain.admin_token_file")
    except OSError as e:
        raise ConfigError(f"brain.admin_token_file: cannot write {path} ({e.strerror}): set it to a path this user "
                          "may write, or null") from None
    return token


def admin_app(brain: "Brain", token: str | None = None) -> web.Application:
    """Never on Envoy's traffic port: the endpoints bind 127.0.0.1 only, and every one but /healthz wants ``token``
    (when there is one) as a bearer token."""

    @web.middleware
    async def authorized(request: web.Request, handler):
        # reads too: /state names every replica and its load, /pins answers whether a session id is in use
        if token is not None and request.path != "/healthz":
            got = request.headers.get("Authorization", "")
            if not secrets.compare_digest(got.encode(), f"Bearer {token}".encode()):
                return web.json_response({"error": "the admin API needs Authorization: Bearer <the token in "
                                                   "brain.admin_token_file>"}, status=401)
        return await handler(request)

    app = web.Application(middlewares=[authorized])

    async def state(_):
        return web.json_response(brain.state())

    async def healthz(_):
        return web.Response(text="ok\n")

    async def drain(request: web.Request):
        name = request.match_info["name"]
        on = request.path.endswith("/drain")
        try:
            brain.router.drain(name, on)
        except KeyError:
            raise web.HTTPNotFound(text=f"unknown replica {name!r}\n") from None
        logs.event("drain" if on else "undrain", replica=name)
        return web.json_response({"replica": name, "drained": on})

    async def reset_prefix_cache(request: web.Request):
        """The replica's engine told to empty its prefix cache (vLLM's POST /reset_prefix_cache, served with
        VLLM_SERVER_DEV_MODE=1) and, once it has, the brain's view of that cache emptied at once: an idle engine
        says so in its events only at its next step, after the next request was priced."""
        name = request.match_info["name"]
        url = brain.scraper.urls.get(name)
        if url is None:
            raise web.HTTPNotFound(text=f"unknown replica {name!r}\n")
        tls = brain.scraper.tls.get(name)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http, \
                    http.post(url + "/reset_prefix_cache", ssl=tls[0] if tls is not None else True,
                              server_hostname=tls[1] if tls is not None else None) as r:
                status, body = r.status, await r.content.read(2000)  # vLLM's answer is a line: no more
        except (aiohttp.ClientError, TimeoutError) as e:
            return web.json_response({"replica": name, "reset": False, "error": f"{type(e).__name__}: {e}"[:200]},
                                     status=502)
        try:  # vLLM answers 200 {"success": false} while blocks are held (running requests): nothing was reset
            done = status == 200 and json.loads(body or b"{}").get("success", True) is not False
        except (ValueError, AttributeError):
            done = status == 200
        if not done:
            return web.json_response({"replica": name, "reset": False, "engine_status": status,
                                      "engine_answer": body.decode(errors="replace")},
                                      status=409 if status == 200 else 502)
        brain.caches_reset(name)
        logs.event("prefix_cache_reset", replica=name)
        return web.json_response({"replica": name, "reset": True})

    async def pin(request: web.Request):
        """Look up a session pin by the raw session id; it is hashed here, as on the request path."""
        raw = request.match_info["session_id"]
        tenant = request.query.get("tenant")
        key = hash_key("session", tenant, raw)
        now = brain.clock()
        p = brain.router.session_pins.get(key, now)
        if p is None:
            raise web.HTTPNotFound(text="no live pin for that session\n")
        return web.json_response({"replica": p.replica.name, "idle_s": round(now - p.last_used, 3), "spills": p.spills,
                                  "ttl_s": brain.router.session_pins.ttl_s})

    async def reload(request: web.Request):
        try:
            info = await brain.reload_async()
            if request.can_read_body:
                info["ignored_body"] = f"POST /reload re-reads {brain.config_path}; the request body is not a config"
            return web.json_response(info)
        except ConfigError as e:
            logs.event("config_reload_failed", error=str(e))
            return web.json_response({"error": str(e)}, status=400)

    async def decisions(request: web.Request):
        """The last decisions, newest last: replica, engine, predicted TTFT, cached and prompt tokens, by Envoy's
        request id (the client's x-request-id). ``?request_id=`` picks one; ``?last=N`` (default 100)."""
        rid = request.query.get("request_id")
        if rid is not None:
            found = brain.recent_decisions(request_id=rid)
            if not found:
                raise web.HTTPNotFound(text="no recent decision for that request id\n")
            return web.json_response({"decisions": found})
        try:
            last = max(0, int(request.query.get("last", "100")))
        except ValueError:
            raise web.HTTPBadRequest(text="last: expected a whole number\n") from None
        return web.json_response({"decisions": brain.recent_decisions(last=last)})

    app.router.add_get("/state", state)
    app.router.add_get("/decisions", decisions)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/pins/session/{session_id}", pin)
    app.router.add_post("/reload", reload)
    app.router.add_post("/replicas/{name}/drain", drain)
    app.router.add_post("/replicas/{name}/undrain", drain)
    app.router.add_post("/replicas/{name}/reset_prefix_cache", reset_prefix_cache)
    return app


def metrics_app(brain: "Brain") -> web.Application:
    app = web.Application()

    async def metrics(_):
        return web.Response(body=generate_latest(brain.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_get("/metrics", metrics)
    return app
