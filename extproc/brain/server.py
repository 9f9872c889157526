"""Start the brain: gRPC (ext_proc, access log, health) on TCP and optionally a Unix socket, admin and
/metrics over HTTP, the scrape and tick loops (``BrainServer``). ``run_brain`` takes the config once: the CLI
has already written its overrides (host, ports) into it.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import socket
import stat

import grpc
from aiohttp import web
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ..config import AppConfig, ConfigError, brain_calls_max, first_answer_s, held_s, legs_s
from ..contract import header_door_socket, log_door_socket
from ..core import State
from ..core.bounded import within
from . import logs
from .admin import admin_app, metrics_app, write_admin_token
from .files import check_private_dir
from .brain import Brain
from .intake import Intake
from .decide import ExternalProcessor
from .header_door import Door, door_app, serve_door
from .log_door import serve_log_door
from .release import AccessLogService
from .shared import SharedState
from .wire import add_service
from ..discovery import Source, follow, make_source
from ..picker import EndpointPicker

GRPC_MAX_MESSAGE = 96 * 1024 * 1024  # request bodies of 32 MiB and more arrive in one message
GRPC_SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE),
    ("grpc.max_send_message_length", GRPC_MAX_MESSAGE),
    ("grpc.so_reuseport", 0),  # a second brain on the same port must fail, not share the traffic
]
ENVELOPE_BYTES = 1024 * 1024  # a body's message also carries the attributes and the protobuf framing



def response_key(cfg) -> bytes:
    """What minted stored-response ids are signed with: derived from the fleet's shared secret when brains share state
    (every brain reads every brain's ids), else the key in brain.response_key_file (made once, so a restarted brain
    still reads the ids it made), else this process's own."""
    import hashlib
    import hmac

    from ..core.apis import PROCESS_KEY
    from .files import read_secret_file, secret_in

    if cfg.shared_state.redis_url and cfg.shared_state.secret_file:
        secret = read_secret_file(cfg.shared_state.secret_file, "shared_state.secret_file")
        return hmac.new(secret, b"warmroute stored-response ids", hashlib.sha256).digest()
    if cfg.brain.response_key_file:
        return secret_in(cfg.brain.response_key_file, "brain.response_key_file")
    return PROCESS_KEY

def grpc_server_options(cfg: AppConfig) -> list[tuple[str, int]]:
    """The rendered Envoy's brain never needs a body above envoy.brain_body_max_bytes (larger ones take the
    headers-only route), so a larger message is refused by gRPC before it is read: an inflated gzip body, which
    carries no Content-Length to route by, cost the brain 670 ms of copying at 60 MiB. The endpoint picker's
    buffered gateways send whole bodies, up to envoy.max_body_bytes.
    gRPC also refuses calls the application has not taken yet past 1,000 (at random, CANCELLED), which Envoy fails
    open into the engines: in a burst the brain takes them late but takes them all, as many as Envoy's circuit
    breaker lets be."""
    calls = brain_calls_max(cfg)
    out = [*GRPC_SERVER_OPTIONS, ("grpc.server.max_pending_requests", calls),
           ("grpc.server.max_pending_requests_hard_limit", calls)]
    if cfg.brain.protocol == "endpoint-picker":
        return out
    cap = cfg.envoy.brain_body_max_bytes + ENVELOPE_BYTES
    return [(k, cap if k == "grpc.max_receive_message_length" else v) for k, v in out]


EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
READY_SERVICES = ("", "readiness", EXT_PROC_SERVICE)  # "liveness" is SERVING for the process's whole life
TICK_S = 0.25  # health timers and housekeeping; the request path ticks too when something is due


def claim_socket_path(path: str, group: str | None = None) -> str:
    """A socket file left by a brain that died is removed; one that a live process answers on is not. A
    directory made for it is the brain's own (0700; 0750 when a group may connect)."""
    path = os.path.abspath(path)
    if os.path.isdir(os.path.dirname(path)):  # before anything in it is touched
        check_private_dir(os.path.dirname(path), "brain.grpc_socket")
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
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        try:
            os.makedirs(directory, mode=0o750 if group else 0o700)
        except OSError as e:
            raise ConfigError(f"brain.grpc_socket: cannot create {directory} ({e.strerror}): set brain.grpc_socket to "
                              f"a "
                              "path this user may write, where Envoy connects") from None
        if group:
            os.chown(directory, -1, _gid(group))
    check_private_dir(directory, "brain.grpc_socket")  # nobody else may swap the socket for theirs
    return path


def _gid(group: str) -> int:
    import grp

    try:
        return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"brain.grpc_socket_group: no group {group!r} on this host") from None


def add_listeners(server, b) -> int | None:
    """The gRPC listeners the config asks for; the TCP port bound, if any.

    The socket file is born 0600 (0660 for a group): a umask around the bind, so no other user can connect in
    the moment between its creation and a chmod."""
    port = None
    if b.grpc_port is not None:
        addr = f"{b.host}:{b.grpc_port}"
        if b.tls_cert_file:
            port = server.add_secure_port(addr, server_credentials(b))
        else:
            port = server.add_insecure_port(addr)
    if b.grpc_socket:
        path = claim_socket_path(b.grpc_socket, b.grpc_socket_group)
        old = os.umask(0o117 if b.grpc_socket_group else 0o177)
        try:
            server.add_insecure_port("unix:" + path)
        finally:
            os.umask(old)
        if b.grpc_socket_group:
            os.chown(path, -1, _gid(b.grpc_socket_group))
        os.chmod(path, 0o660 if b.grpc_socket_group else 0o600)
    return port


def _read(field: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"brain.{field}: cannot read {path} ({e.strerror})") from None


def server_credentials(b) -> grpc.ServerCredentials:
    """TLS for the TCP listener; with ``tls_client_ca_file``, a client certificate it signed is required."""
    key, cert = _read("tls_key_file", b.tls_key_file), _read("tls_cert_file", b.tls_cert_file)
    ca = _read("tls_client_ca_file", b.tls_client_ca_file) if b.tls_client_ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def _libc_trim():
    """glibc's ``malloc_trim`` (None elsewhere): the C heap keeps the pages a burst's messages were read into
    (a flood of 2,000 uploads left the brain at 218 MB from 78, its objects long gone); this gives them back."""
    try:
        import ctypes

        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


async def _tick_loop(brain: Brain) -> None:
    n = 0
    trim = _libc_trim()
    while True:
        try:
            brain.tick()
            n += 1
            if n % 40 == 0:  # every ~10 s
                brain.ledger.forget_released()
                if trim is not None:  # off the loop: ctypes lets go of the GIL, decisions go on meanwhile
                    await asyncio.to_thread(trim, 0)
        except Exception as e:  # logged, and the timers go on
            logs.event("loop_error", loop="tick", error=f"{type(e).__name__}: {e}"[:200])
        await asyncio.sleep(TICK_S)


FLOW_TICK_S = 0.05  # flow control: how often the held requests are looked at again
FLOW_MIN_GAP_S = 0.01  # ... and at least this long between two looks, whatever wakes it


class FlowWaits:
    """Flow control's held calls: each waits on a future in its request's record (``Brain.held``), answered by
    ``Brain.let_go``."""

    def __init__(self, brain: Brain):
        self.brain = brain
        self.woken = asyncio.Event()  # a request ended: a held one may go now, not at the next tick

    def on_log_entry(self, entry) -> None:
        self.brain.on_log_entry(entry)
        # only an entry that freed something (a reservation released) may let a held request go: woken by every
        # entry, a flood's 1,900 refusals made an offer (up to 32 pricings) every 10 ms, a third of the brain's time
        # while the turns under way waited behind it (py-spy during `python -m bench flood`)
        if self.brain.held and self.brain.router.offer_due:
            self.woken.set()

    def wait(self, key: object) -> asyncio.Future:
        """The held request's answer, to await (called as soon as the brain said it holds it: nothing ran since)."""
        fut = self.brain.held[key].answer = asyncio.get_running_loop().create_future()
        return fut

    def cancel(self, key: object) -> None:
        self.brain.cancel(key)

    def let_go(self) -> None:
        for held, answer in self.brain.let_go():
            if held.answer is not None and not held.answer.done():
                held.answer.set_result(answer)

    async def loop(self) -> None:
        while True:
            try:
                self.let_go()
            except Exception as e:  # logged, and the queue goes on
                # the type alone: an error here may carry a held request's body in its message
                logs.event("loop_error", loop="flow_control", error=type(e).__name__)
            # every offer prices up to 32 held requests: a burst of request ends wakes it once per FLOW_MIN_GAP_S
            await asyncio.sleep(FLOW_MIN_GAP_S)
            try:  # within, not wait_for: a cancel that lands as a request end wakes it must end the loop
                await within(self.woken.wait(), FLOW_TICK_S - FLOW_MIN_GAP_S)
            except TimeoutError:
                pass
            self.woken.clear()


async def supervise(tasks: list[asyncio.Task], on_death) -> None:
    """Return once any background task ends (they never should), after ``on_death(task)``: a brain whose
    scraper or timers died must not go on answering SERVING with stale health."""
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for t in done:
        await on_death(t)


class BrainServer:
    """One brain process's servers and loops: ``start`` serves (gRPC, admin, /metrics) and starts the loops,
    ``serve`` returns only if a loop died, ``stop`` takes everything down in order."""

    def __init__(self, cfg: AppConfig, config_path: str | None = None):
        self.cfg = cfg
        self.brain = brain = Brain(cfg, config_path=config_path)
        brain.cds.write(cfg)  # before Envoy starts: it waits for its clusters
        self.server = grpc.aio.server(options=grpc_server_options(cfg))
        self.waits = FlowWaits(brain)
        self.health = health.aio.HealthServicer()
        self.shared: SharedState | None = None
        self.source: Source | None = None
        self.tasks: list[asyncio.Task] = []
        self.readying: asyncio.Task | None = None
        self.runners: list[web.BaseRunner | Door] = []  # each has its cleanup()
        self.info: dict = {}
        self.processor: ExternalProcessor | None = None  # the ext_proc front (the header door asks it too)
        self.ready = False  # SERVING: the header door's health check says so too
        self.door: str | None = None  # the header door's socket, when it serves one

    def _front(self):
        """The ext_proc service: the brain behind Envoy, or an endpoint picker's front."""
        cfg, brain, waits = self.cfg, self.brain, self.waits
        if cfg.brain.protocol == "endpoint-picker":
            def reset() -> None:
                brain.stats.picker_streams_reset += 1

            def end_picked(*args) -> None:  # a response's end: a held request may go now
                brain.picks.end(*args)
                if brain.held:
                    waits.woken.set()

            return EndpointPicker(brain.picks.pick, end_picked, cfg.envoy.brain_body_max_bytes, brain.clock, reset,
                                  wait=waits.wait, cancel=waits.cancel, hold_s=held_s(cfg),
                                  arrived=lambda res: brain.router.arrived(res, brain.clock()),
                                  pick_at_headers=brain.picks.pick_at_headers if cfg.envoy.header_path else None,
                                  early_reach=brain.picks.early_reach, connectors=brain.picks.connectors).Process
        self.processor = ExternalProcessor(brain.decide, cfg.envoy.brain_body_max_bytes, waits.wait, waits.cancel,
                                           held_s(cfg), brain.look, Intake(first_answer_s(cfg), brain.clock),
                                           legs_s(cfg), brain.at_headers if cfg.envoy.header_path else None,
                                           brain.stats.call_faults)
        return self.processor.Process

    def _envoy_gone(self, released: int) -> None:
        logs.event("envoy_access_log_closed", released_reservations=released,
                   open_reservations=self.brain.router.open_reservations)

    async def _set_ready(self, serving: bool) -> None:
        self.ready = serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in READY_SERVICES:
            await self.health.set(name, status)

    async def _become_ready(self) -> None:
        brain, cfg = self.brain, self.cfg
        # another brain's view first (snapshot + replay, bounded): a brain that joins a running fleet starts warm
        if self.shared is not None:
            await self.shared.warm_start()
            # and its own health view: every replica starts EJECTED here, and until one is LIVE its choices would be
            # fallbacks at random; meanwhile its Envoy asks the other brains (envoy.brain_failover), which know them
            h = cfg.router.health
            deadline = brain.clock() + h.probing_clean_window_s + 4 * h.scrape_interval_s
            while brain.router.replicas and brain.clock() < deadline and \
                    not any(r.state is State.LIVE for r in brain.router.replicas):
                await asyncio.sleep(0.1)
        await self._set_ready(True)

    async def _serve_http(self, app: web.Application, host: str, port: int) -> int:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        self.runners.append(runner)
        return runner.addresses[0][1]

    async def _serve_door(self) -> None:
        """The header door (``header_door``) beside the gRPC socket, when the header path asks there (the rendered
        Envoy does wherever it reaches the brain by a Unix socket)."""
        b, processor = self.cfg.brain, self.processor
        door = header_door_socket(b.grpc_socket) if b.grpc_socket else None
        if door is None or processor is None or processor.at_headers is None:
            return
        claim_socket_path(door, b.grpc_socket_group)
        handler = door_app(processor.at_header_call, lambda: self.ready, processor.faults)
        self.runners.append(await serve_door(handler, door, _gid(b.grpc_socket_group) if b.grpc_socket_group else None))
        self.door = door

    async def _serve_log_door(self, on_entry) -> None:
        """The log door (``log_door``) beside the gRPC socket: where Envoy reaches the brain by a Unix socket it sends
        its access-log entries there (the gRPC service stays, for an Envoy configured otherwise)."""
        b, brain = self.cfg.brain, self.brain
        path = log_door_socket(b.grpc_socket) if b.grpc_socket else None
        if path is None:
            return
        claim_socket_path(path, b.grpc_socket_group)
        self.runners.append(await serve_log_door(on_entry, brain.envoy, self._envoy_gone, brain.stats, path,
                                                 _gid(b.grpc_socket_group) if b.grpc_socket_group else None))

    async def _hup(self) -> None:
        try:
            await self.brain.reload_async()
        except ConfigError as e:
            logs.event("config_reload_failed", error=str(e))

    async def start(self, ready_file: str | None = None) -> dict:
        """Serve and start the loops; what was bound (``grpc_port``, ``admin_port``, ``metrics_port``, ``pid``),
        also written to ``ready_file``."""
        cfg, b, brain, server, waits = self.cfg, self.cfg.brain, self.brain, self.server, self.waits
        # not the generated add_*_to_server: a header of bytes that are not UTF-8 must not make Envoy's message
        # unreadable
        add_service(server, EXT_PROC_SERVICE, "Process", self._front(), "stream_stream", ep.ProcessingRequest,
                    ep.ProcessingResponse)
        on_entry = waits.on_log_entry if cfg.flow_control.enabled else brain.on_log_entry
        add_service(server, "envoy.service.accesslog.v3.AccessLogService", "StreamAccessLogs",
                    AccessLogService(on_entry, brain.envoy, self._envoy_gone, brain.stats).StreamAccessLogs,
                    "stream_unary", als_pb2.StreamAccessLogsMessage, als_pb2.StreamAccessLogsResponse)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        port = add_listeners(server, b)
        await server.start()
        brain.response_key = response_key(cfg)
        if cfg.shared_state.redis_url:
            self.shared = SharedState(cfg.shared_state, brain.router, brain.clock, brain.stats.shared)
            outbox = brain.router.outbox
            assert outbox is not None  # SharedState turned sharing on
            brain.releaser.forward = lambda num, digest, ended: outbox.events.append(("x" if ended else "a", num,
                                                                                       digest))
            brain.router.remote.on_foreign_end = brain.releaser.end_forwarded
        # the names gateways' endpoint-picker deployments probe: alive at once, ready once the fleet is known
        await self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        await self._set_ready(False)
        admin = await self._serve_http(admin_app(brain, write_admin_token(b.admin_token_file)), "127.0.0.1",
                                       b.admin_port)
        metrics_port = await self._serve_http(metrics_app(brain), b.metrics_host, b.metrics_port)
        await self._serve_door()
        await self._serve_log_door(on_entry)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(self._hup()))
        self.tasks = [asyncio.create_task(brain.scraper.loop(), name="scraper"),
                      asyncio.create_task(_tick_loop(brain), name="tick"),
                      asyncio.create_task(brain.exact.kv.loop(), name="kv_events")]
        if cfg.discovery.source != "static":
            self.source = source = make_source(cfg)
            first_sync = not brain.discovered

            def discovered(replicas) -> None:
                nonlocal first_sync
                brain.apply_discovered(replicas)
                if first_sync:
                    first_sync = False
                    loop.create_task(self._become_ready())

            self.tasks.append(asyncio.create_task(follow(source, cfg.discovery.interval_s, discovered,
                                                         brain.discovery_failed, brain.discovery_ok),
                                                  name="discovery"))
        if self.shared is not None:
            self.tasks.append(asyncio.create_task(self.shared.run(), name="shared_state"))
        if cfg.flow_control.enabled:
            self.tasks.append(asyncio.create_task(waits.loop(), name="flow_control"))
        # a static fleet is known now; the scraper runs, so the wait for a LIVE replica (shared state) can end. Held
        # here: a task nobody holds may be collected
        self.readying = asyncio.create_task(self._become_ready(), name="ready") if brain.discovered else None
        self.info = info = {"grpc_port": port, "admin_port": admin, "metrics_port": metrics_port, "pid": os.getpid()}
        # The ~50K objects of the imports and servers live as long as the process. Frozen, they are out of
        # the collector's sight: a full collection no longer stalls requests ~11 ms scanning them.
        gc.collect()
        gc.freeze()
        logs.event("brain_started", replicas=len(cfg.replicas), **info)
        if ready_file:
            tmp = ready_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump(info, f)
            os.replace(tmp, ready_file)
        return info

    async def _died(self, t: asyncio.Task) -> None:
        exc = None if t.cancelled() else t.exception()
        logs.event("background_task_died", task=t.get_name(), error=f"{type(exc).__name__}: {exc}"[:200] if exc else "")
        # Envoy's health check sees NOT_SERVING and fails open; the process then exits non-zero
        await self._set_ready(False)

    async def serve(self) -> None:
        """Until a background loop dies (they never should): then NOT_SERVING, and SystemExit(1)."""
        await supervise(self.tasks, self._died)
        raise SystemExit(1)

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        if self.readying is not None:
            self.readying.cancel()
        self.brain.exact.close()
        if self.source is not None:
            await self.source.close()
        if self.shared is not None:
            await self.shared.close()
        await self.brain.close_legs()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(1.0)
        for runner in self.runners:
            await runner.cleanup()
        for sock in (self.cfg.brain.grpc_socket, self.door):
            if sock and os.path.exists(sock):
                os.unlink(sock)


async def run_brain(cfg: AppConfig, ready_file: str | None = None, config_path: str | None = None) -> None:
    server = BrainServer(cfg, config_path)
    try:
        await server.start(ready_file)
        await server.serve()
    finally:
        await server.stop()
