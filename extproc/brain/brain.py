"""The brain process: Envoy's ext_proc and access-log gRPC services around the routing core.

Per request Envoy opens an ext_proc stream and sends one message: the
buffered body, with the request headers the brain reads as attributes. The
brain answers with the chosen replica's cluster and a reservation id as
dynamic metadata (which Envoy's next filter copies into
``x-warmroute-cluster``) and as header mutations (which Envoy applies when
its config sends the headers too), and clears the route cache so Envoy
re-routes.

Envoy closes the ext_proc stream as soon as it needs nothing more (Envoy
>= 1.37), so the stream's end is not the request's end. The end comes from
Envoy's gRPC access-log service, which the brain also serves: each entry
carries the reservation id the brain set, the upstream cluster and address,
the response code and flags. That releases the reservation and feeds the
upstream-failure rule (SPEC B) without any round trip on the response path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import logging
import os
import secrets
import signal
import socket
import stat
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
from aiohttp import ClientSession, ClientTimeout, web
from envoy.config.core.v3 import base_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from ..config import AppConfig, ConfigError, load_config
from ..core import NO_HEALTHY, Reservation, Router, Transition, build_profile, hash_key
from ..envoy_config import (
    METADATA_NAMESPACE,
    REQUEST_ID_HEADER,
    RESERVATION_HEADER,
    ROUTING_HEADER,
    brain_headers,
    write_cds,
)
from .metrics import DecisionWindow, make_registry

GRPC_MAX_MESSAGE = 96 * 1024 * 1024  # request bodies of 32 MiB and more arrive in one message
GRPC_SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE),
    ("grpc.max_send_message_length", GRPC_MAX_MESSAGE),
    ("grpc.so_reuseport", 0),  # a second brain on the same port must fail, not share the traffic
]

log = logging.getLogger("warmroute")

# vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc; accept both.
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


@dataclass
class ScrapeResult:
    ok: bool
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    error: str = ""


def parse_vllm_metrics(text: str) -> ScrapeResult:
    """Sum vLLM's gauges over every label set (one per engine / model)."""
    running = waiting = 0.0
    kv: list[float] = []
    seen = False
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == RUNNING:
                    running += s.value
                    seen = True
                elif s.name == WAITING:
                    waiting += s.value
                elif s.name in KV_NAMES:
                    kv.append(s.value)
    except ValueError as e:
        return ScrapeResult(False, error=f"unparsable metrics: {e}")
    if not seen:
        return ScrapeResult(False, error=f"no {RUNNING} in /metrics")
    return ScrapeResult(True, int(round(running)), int(round(waiting)), max(kv) if kv else 0.0)


LOG_JSON = True


def _json_log(event: str, **fields) -> None:
    """One line per state change, rebind, drain and reload: JSON lines, or key=value text. Never prompt text."""
    if LOG_JSON:
        log.info(json.dumps({"ts": round(time.time(), 3), "event": event, **fields}, separators=(",", ":")))
    else:
        log.info(" ".join([event, *(f"{k}={v}" for k, v in fields.items())]))


class Brain:
    """Owns the router and the wall clock; every handler below is a thin shell around it."""

    def __init__(self, cfg: AppConfig, clock=time.monotonic, config_path: str | None = None):
        self.cfg = cfg
        self.clock = clock
        self.config_path = config_path
        self.router = Router(cfg.router, [r.name for r in cfg.replicas], self.clock())
        self.urls = {r.name: r.url for r in cfg.replicas}
        self.by_address = {f"{r.host}:{r.port}": r.name for r in cfg.replicas}
        self.epoch = secrets.token_hex(4)  # reservation ids from an earlier brain never match ours
        self.decisions: Counter[tuple[str, str]] = Counter()
        self.releases_by_log = 0
        self.unknown_log_entries = 0
        self.scrape_errors: dict[str, str] = {}
        # Envoy's x-request-id -> reservation. The access-log entry always carries the request id,
        # even when the client reset before Envoy applied our header (then the reservation id is
        # missing from the entry) or when our answer came after Envoy's ext_proc timeout.
        self.by_request_id: dict[str, Reservation] = {}
        self.router.listeners.append(self._on_transition)
        # metrics: the request path bumps these plain counters; the collector reads them at scrape time
        self.decisions_by_pin: Counter[str] = Counter()
        self.pin_events: Counter[tuple[str, str, str]] = Counter()
        self.scrapes: Counter[tuple[str, str]] = Counter()
        self.window = DecisionWindow()
        self.reloads = 0
        self.registry, self.decision_seconds, self.scrape_seconds = make_registry(self)
        self._zero_series()

    def _on_transition(self, t: Transition) -> None:
        _json_log("state_change", replica=t.replica, old=t.old.value, new=t.new.value, reason=t.reason,
                  cooldown_s=t.cooldown_s, streak=t.streak)

    # ----------------------------------------------------------- ext_proc path

    def decide(self, headers: dict[str, str], body: bytes | None, phase: str = "request_body") -> ep.ProcessingResponse:
        """Profile + select + reserve: one synchronous call (the atomic WLC reserve).

        ``phase`` is the ext_proc message being answered (``request_body`` or ``request_headers``).
        """
        t0 = time.perf_counter()
        now = self.clock()
        profile = build_profile(headers, body, self.cfg.router.profile)
        d = self.router.select(profile, now)
        self.decision_seconds.observe(time.perf_counter() - t0)
        name = d.replica_name or "-"
        self.decisions[(name, d.reason)] += 1
        self.decisions_by_pin[d.pin_kind or "none"] += 1
        self.window.add(name, now)
        for e in d.events:
            self.pin_events[(e.action, e.kind, e.cause)] += 1
            if e.action in ("rebind", "unpin"):
                _json_log(e.action, kind=e.kind, cause=e.cause, replica=d.replica_name)
        if d.reason == NO_HEALTHY:
            return no_healthy_response()
        request_id = headers.get(REQUEST_ID_HEADER)
        if request_id and request_id not in self.by_request_id:
            self.by_request_id[request_id] = d.reservation
        rid = f"{self.epoch}.{d.reservation.id}"
        out = ep.ProcessingResponse()
        common = getattr(out, phase).response
        # Applied only where Envoy sent the headers; in the one-message config it is the dynamic metadata
        # that routes, but a header mutation must be present for Envoy to honour clear_route_cache.
        common.header_mutation.set_headers.extend([_hv(ROUTING_HEADER, d.replica.name), _hv(RESERVATION_HEADER, rid)])
        common.clear_route_cache = True
        answer = out.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields
        answer["cluster"].string_value = d.replica.name
        answer["reservation"].string_value = rid
        return out

    # --------------------------------------------------------- access-log path

    def on_log_entry(self, entry) -> None:
        now = self.clock()
        common = entry.common_properties
        hdrs = entry.request.request_headers
        rid = hdrs.get(RESERVATION_HEADER, "")
        res = None
        if rid:
            epoch, _, num = rid.partition(".")
            if epoch == self.epoch and num.isdigit():
                res = self.router.reservation(int(num))
        by_id = self.by_request_id.get(entry.request.request_id)
        if by_id is not None and (res is None or res is by_id):
            del self.by_request_id[entry.request.request_id]
            res = res or by_id
        chosen = None
        if res is not None and not res.released:
            chosen = res.replica.name
            self.router.release(res, now)
            self.releases_by_log += 1
        flags = common.response_flags
        code = entry.response.response_code.value
        via_upstream = entry.response.response_code_details == "via_upstream"
        sock = common.upstream_remote_address.socket_address
        served_by = self.by_address.get(f"{sock.address}:{sock.port_value}") if sock.address else None
        failed = (
            flags.upstream_connection_failure
            or flags.upstream_remote_reset
            or flags.upstream_connection_termination
            or (via_upstream and code >= 500)
        )
        if chosen and common.upstream_request_attempt_count > 1 and served_by != chosen:
            # the chosen replica refused or reset and Envoy retried elsewhere
            self.router.on_upstream(chosen, False, now)
        if served_by:
            self.router.on_upstream(served_by, not failed, now)
        elif chosen and failed:
            self.router.on_upstream(chosen, False, now)
        elif not chosen and not served_by:
            self.unknown_log_entries += 1

    # ----------------------------------------------------------------- scraper

    async def scrape_once(self, session: ClientSession, name: str, url: str) -> ScrapeResult:
        t0 = time.perf_counter()
        r = await self._scrape(session, url)
        self.scrape_seconds.observe(time.perf_counter() - t0)
        self.scrapes[(name, "ok" if r.ok else "failed")] += 1
        return r

    async def _scrape(self, session: ClientSession, url: str) -> ScrapeResult:
        try:
            async with session.get(url + "/metrics") as resp:
                if resp.status != 200:
                    return ScrapeResult(False, error=f"HTTP {resp.status}")
                text = await resp.text()
        except asyncio.TimeoutError:
            return ScrapeResult(False, error="timeout")
        except Exception as e:  # connection refused, reset, DNS...: every one means "failed scrape"
            return ScrapeResult(False, error=type(e).__name__)
        return parse_vllm_metrics(text)

    async def scrape_loop(self) -> None:
        interval = self.cfg.router.health.scrape_interval_s
        timeout = ClientTimeout(total=max(0.05, min(2.0, interval * 0.8)))
        async with ClientSession(timeout=timeout) as session:
            while True:
                started = self.clock()
                names = list(self.urls)
                results = await asyncio.gather(*(self.scrape_once(session, n, self.urls[n]) for n in names))
                now = self.clock()
                for n, r in zip(names, results):
                    if r.ok:
                        self.scrape_errors.pop(n, None)
                    else:
                        self.scrape_errors[n] = r.error
                    self.router.on_scrape(n, r.ok, now, r.running, r.waiting, r.kv_usage)
                await asyncio.sleep(max(0.0, interval - (self.clock() - started)))

    def _zero_series(self) -> None:
        """Export every counter series from the start: rate() and alerts see 0, not an absent series."""
        for r in self.cfg.replicas:
            for reason in ("affinity", "load", "fallback"):
                self.decisions[(r.name, reason)] += 0
            for result in ("ok", "failed"):
                self.scrapes[(r.name, result)] += 0
        for kind in ("session", "prefix"):
            self.decisions_by_pin[kind] += 0
            self.pin_events[("spill", kind, "")] += 0
            self.pin_events[("pin", kind, "new")] += 0
            for cause in ("spills", "force", "dead"):
                self.pin_events[("rebind", kind, cause)] += 0
                self.pin_events[("unpin", kind, cause)] += 0
        self.decisions_by_pin["none"] += 0

    # ------------------------------------------------------------------ reload

    def reload(self) -> dict:
        """Re-read the config file without dropping in-flight requests.

        Added replicas join through the health machine (EJECTED, no cooldown);
        removed ones are forgotten (their reservations still release, pins to them
        rebind on next use); thresholds and TTLs change at once. With
        ``envoy.cds_path`` Envoy's clusters are rewritten too.
        """
        if not self.config_path:
            raise ConfigError("the brain was started without a config file")
        new = load_config(self.config_path)  # ConfigError: the old config stays
        new = dataclasses.replace(new, brain=self.cfg.brain)  # ports cannot change under a running server
        now = self.clock()
        old_names = {r.name for r in self.cfg.replicas}
        new_names = {r.name for r in new.replicas}
        for r in new.replicas:
            if r.name not in old_names:
                self.router.add_replica(r.name, now)
        for name in old_names - new_names:
            self.router.remove_replica(name)
        self.router.update_config(new.router)
        old_headers = brain_headers(self.cfg)
        self.cfg = new
        self.urls = {r.name: r.url for r in new.replicas}
        self.by_address = {f"{r.host}:{r.port}": r.name for r in new.replicas}
        if new.envoy.cds_path:
            write_cds(new)
        self._zero_series()
        self.reloads += 1
        info = {"added": sorted(new_names - old_names), "removed": sorted(old_names - new_names), "replicas": len(new_names)}
        if brain_headers(new) != old_headers:
            # Envoy sends only the headers its (static) ext_proc config names: until it runs a bootstrap rendered
            # from this file, a new session or tenant header never reaches the brain.
            info["envoy_config_stale"] = "profile.session_headers/tenant_header changed: re-render and restart Envoy"
        _json_log("config_reload", **info)
        return info

    async def tick_loop(self) -> None:
        n = 0
        while True:
            self.router.tick(self.clock())
            n += 1
            if n % 40 == 0:  # every ~10 s: forget request ids of reservations the safety timeout released
                for k in [k for k, r in self.by_request_id.items() if r.released]:
                    del self.by_request_id[k]
            await asyncio.sleep(0.25)

    # ------------------------------------------------------------------ views

    def state(self) -> dict:
        per = Counter()
        for (name, _reason), n in self.decisions.items():
            per[name] += n
        reps = self.router.snapshot()
        for r in reps:
            r["decisions"] = per.get(r["name"], 0)
            r["url"] = self.urls.get(r["name"])
            r["scrape_error"] = self.scrape_errors.get(r["name"])
            r["cooldown_remaining_s"] = max(0.0, r.pop("cooldown_until") - self.clock())
        return {
            "replicas": reps,
            "recent_transitions": [
                {"at_s_ago": round(self.clock() - t.at, 1), "replica": t.replica, "old": t.old.value, "new": t.new.value,
                 "reason": t.reason, "cooldown_s": t.cooldown_s}
                for t in list(self.router.transitions)[-20:]
            ],
            "decisions_by_reason": {f"{k[0]}/{k[1]}": v for k, v in sorted(self.decisions.items())},
            "open_reservations": self.router.open_reservations,
            "releases_by_access_log": self.releases_by_log,
            "safety_timeouts": self.router.safety_timeouts,
            "session_pins": len(self.router.session_pins),
            "prefix_pins": len(self.router.prefix_pins),
        }


def _hv(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


_NO_HEALTHY_BODY = json.dumps(
    {
        "error": {
            "message": "no healthy vLLM replica is available; retry shortly",
            "type": "service_unavailable",
            "code": "no_healthy_instances",
        }
    }
).encode()


def no_healthy_response() -> ep.ProcessingResponse:
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=http_status_pb2.ServiceUnavailable),
            headers=ep.HeaderMutation(set_headers=[_hv("content-type", "application/json"), _hv("retry-after", "5")]),
            body=_NO_HEALTHY_BODY,
            details="warmroute_no_healthy_instances",
        )
    )


def _headers_of(msg: ep.HttpHeaders) -> dict[str, str]:
    out = {}
    for h in msg.headers.headers:
        out[h.key] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


_ATTR_PREFIX, _ATTR_SUFFIX = "request.headers['", "']"


def _headers_from_attributes(req: ep.ProcessingRequest) -> dict[str, str]:
    """Headers Envoy sent as ``request.headers['name']`` attributes (absent headers are absent keys)."""
    out = {}
    for attrs in req.attributes.values():
        for key, value in attrs.fields.items():
            if key.startswith(_ATTR_PREFIX) and key.endswith(_ATTR_SUFFIX) and value.HasField("string_value"):
                out[key[len(_ATTR_PREFIX):-len(_ATTR_SUFFIX)].lower()] = value.string_value
    return out


_PASS = {
    "request_headers": ep.ProcessingResponse(request_headers=ep.HeadersResponse()),
    "request_trailers": ep.ProcessingResponse(request_trailers=ep.TrailersResponse()),
    "response_headers": ep.ProcessingResponse(response_headers=ep.HeadersResponse()),
    "response_body": ep.ProcessingResponse(response_body=ep.BodyResponse()),
    "response_trailers": ep.ProcessingResponse(response_trailers=ep.TrailersResponse()),
}


class ExternalProcessor(ep_grpc.ExternalProcessorServicer):
    """Decides on the first message that can be decided on, then ends the stream.

    With the shipped config that is the only message: the body, headers as attributes. A config
    that sends headers too (``request_header_mode: SEND``) also works: the headers are kept for the
    body, or decided on at once when no body follows. Ending the stream tells Envoy that the brain
    wants nothing more of this request.
    """

    def __init__(self, brain: Brain):
        self.brain = brain

    async def Process(self, request_iterator: AsyncIterator[ep.ProcessingRequest], context) -> None:
        headers: dict[str, str] = {}
        while True:
            req = await context.read()
            if req is grpc.aio.EOF:
                return
            kind = req.WhichOneof("request")
            if req.attributes:
                headers.update(_headers_from_attributes(req))
            if kind == "request_body":
                await context.write(self.brain.decide(headers, req.request_body.body))
                return
            if kind == "request_headers":
                headers.update(_headers_of(req.request_headers))
                if req.request_headers.end_of_stream:  # no body follows: decide on headers
                    await context.write(self.brain.decide(headers, None, "request_headers"))
                    return
            await context.write(_PASS[kind])


class AccessLogService(als_pb2_grpc.AccessLogServiceServicer):
    def __init__(self, brain: Brain):
        self.brain = brain

    async def StreamAccessLogs(self, request_iterator, context) -> als_pb2.StreamAccessLogsResponse:
        async for msg in request_iterator:
            for entry in msg.http_logs.log_entry:
                self.brain.on_log_entry(entry)
        return als_pb2.StreamAccessLogsResponse()


def admin_app(brain: Brain) -> web.Application:
    """Loopback-only admin HTTP: never on Envoy's traffic port."""
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
        _json_log("drain" if on else "undrain", replica=name)
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

    async def reload(_):
        try:
            return web.json_response(brain.reload())
        except ConfigError as e:
            _json_log("config_reload_failed", error=str(e))
            return web.json_response({"error": str(e)}, status=400)

    app.router.add_get("/state", state)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/pins/session/{session_id}", pin)
    app.router.add_post("/reload", reload)
    app.router.add_post("/replicas/{name}/drain", drain)
    app.router.add_post("/replicas/{name}/undrain", drain)
    return app


def metrics_app(brain: Brain) -> web.Application:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    app = web.Application()

    async def metrics(_):
        return web.Response(body=generate_latest(brain.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_get("/metrics", metrics)
    return app


def _claim_socket_path(path: str) -> str:
    """A socket file left by a brain that died is removed; one that a live process answers on is not."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise ConfigError(f"brain.grpc_socket: {path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)
        else:
            raise ConfigError(f"brain.grpc_socket: another process serves on {path}")
        finally:
            probe.close()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return path


async def run_brain(cfg: AppConfig, grpc_host: str, grpc_port: int, admin_port: int, ready_file: str | None = None,
                    config_path: str | None = None) -> None:
    brain = Brain(cfg, config_path=config_path)
    if cfg.envoy.cds_path:
        write_cds(cfg)  # before Envoy starts: it waits for its clusters
    server = grpc.aio.server(options=GRPC_SERVER_OPTIONS)
    ep_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(brain), server)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(AccessLogService(brain), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"{grpc_host}:{grpc_port}")
    if cfg.brain.grpc_socket:
        server.add_insecure_port("unix:" + _claim_socket_path(cfg.brain.grpc_socket))
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("envoy.service.ext_proc.v3.ExternalProcessor", health_pb2.HealthCheckResponse.SERVING)

    runner = web.AppRunner(admin_app(brain), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", admin_port)
    await site.start()
    admin = runner.addresses[0][1]
    mrunner = web.AppRunner(metrics_app(brain), access_log=None)
    await mrunner.setup()
    await web.TCPSite(mrunner, cfg.brain.metrics_host, cfg.brain.metrics_port).start()
    metrics_port = mrunner.addresses[0][1]
    loop = asyncio.get_running_loop()

    def on_hup() -> None:
        try:
            brain.reload()
        except ConfigError as e:
            _json_log("config_reload_failed", error=str(e))

    loop.add_signal_handler(signal.SIGHUP, on_hup)
    tasks = [asyncio.create_task(brain.scrape_loop()), asyncio.create_task(brain.tick_loop())]
    info = {"grpc_port": port, "admin_port": admin, "metrics_port": metrics_port, "pid": os.getpid()}
    # The ~50K objects of the imports and servers live as long as the process. Frozen, they are out of
    # the collector's sight: a full collection no longer stalls requests ~11 ms scanning them.
    gc.collect()
    gc.freeze()
    _json_log("brain_started", replicas=len(cfg.replicas), **info)
    if ready_file:
        tmp = ready_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, ready_file)
    try:
        await asyncio.Event().wait()
    finally:
        for t in tasks:
            t.cancel()
        await health_servicer.enter_graceful_shutdown()
        await server.stop(1.0)
        await runner.cleanup()
        await mrunner.cleanup()
        if cfg.brain.grpc_socket and os.path.exists(cfg.brain.grpc_socket):
            os.unlink(cfg.brain.grpc_socket)


def setup_logging(fmt: str = "json") -> None:
    global LOG_JSON
    LOG_JSON = fmt == "json"
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
