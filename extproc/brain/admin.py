"""Loopback-only admin HTTP (state, pins, drain, reload) and the read-only /metrics app."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..config import ConfigError
from ..core import hash_key
from . import logs

if TYPE_CHECKING:
    from .brain import Brain


def admin_app(brain: "Brain") -> web.Application:
    """Never on Envoy's traffic port: state-changing endpoints bind 127.0.0.1 only."""
    app = web.Application()

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
            raise web.HTTPNotFound(text=f"unknown replica {name!r}\n")
        logs.event("drain" if on else "undrain", replica=name)
        return web.json_response({"replica": name, "drained": on})

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
            info = brain.reload()
            if request.can_read_body:
                info["ignored_body"] = f"POST /reload re-reads {brain.config_path}; the request body is not a config"
            return web.json_response(info)
        except ConfigError as e:
            logs.event("config_reload_failed", error=str(e))
            return web.json_response({"error": str(e)}, status=400)

    app.router.add_get("/state", state)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/pins/session/{session_id}", pin)
    app.router.add_post("/reload", reload)
    app.router.add_post("/replicas/{name}/drain", drain)
    app.router.add_post("/replicas/{name}/undrain", drain)
    return app


def metrics_app(brain: "Brain") -> web.Application:
    app = web.Application()

    async def metrics(_):
        return web.Response(body=generate_latest(brain.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_get("/metrics", metrics)
    return app
