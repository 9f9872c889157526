"""The one YAML config file: replicas, key sources, TTLs and thresholds.

Every default is SPEC.md's number (they live in ``extproc.core.config``).
A bad file raises ``ConfigError`` whose message is one line naming the
field, e.g. ``pins.session_ttl_s: expected a number >= 0, got 'soon'``.
"""

from __future__ import annotations

import dataclasses
import re
import reprlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from .contract import RESERVED_NAME_PREFIX
from .core.config import TENANT_SOURCES, HealthConfig, PinConfig, ProfileConfig, RouterConfig, WarmConfig
from .core.models import MAX_PATH_CHARS, Target
from .core.policy import POLICIES, PRODUCTION

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


ENGINES = ("vllm", "sglang", "none", "auto")


class ConfigError(ValueError):
    """One line that names the offending field."""


MAX_CONFIG_BYTES = 1024 * 1024  # a config file is a few KiB; a bigger one is a mistake or an attack
MAX_ALIASES = 64  # YAML aliases (*name) in one file: enough for shared blocks, far from a "billion laughs"


def _short(value: Any, limit: int = 60) -> str:
    """A value as an error message may show it: repr, cut to ``limit`` characters (a value may be huge)."""
    if isinstance(value, (dict, list)) and len(value) > 8:
        return f"<a {type(value).__name__} of {len(value)} items>"
    r = repr(value) if not isinstance(value, (dict, list)) else reprlib.repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses more than MAX_ALIASES aliases: an anchor chain 9 deep expands to 10^9 values
    wherever the document is walked (this module's checks, an error message)."""

    def __init__(self, stream):
        super().__init__(stream)
        self.aliases = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                mark = self.peek_event().start_mark
                raise ConfigError(f"line {mark.line + 1}: more than {MAX_ALIASES} YAML aliases (*name); write the "
                                  "values out")
        return super().compose_node(parent, index)


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    name: str  # the replica's name in logs, metrics and the admin API; also its Envoy cluster name
    url: str  # base URL of the engine's OpenAI server; /metrics (or /health) is read from it
    # whose /metrics to read: "vllm", "sglang", or "none" (health from /health, load from the brain's own
    # in-flight requests: any OpenAI-compatible server); "auto": whichever /metrics has, else "none"
    # (docs/guide.md "Engines" says what routing each one gets)
    engine: str = "vllm"
    # (https:// replicas; Envoy and the brain's scrapes use the same settings)
    tls_ca_file: str | None = None  # the CA bundle that signed the replica's certificate (null: the system's)
    tls_sni: str | None = None  # the name to ask for and check in its certificate (null: the URL's host)
    tls_cert_file: str | None = None  # a client certificate to present, when the replica asks for one
    tls_key_file: str | None = None  # the private key of tls_cert_file
    # the model names it serves; empty: whatever its GET /v1/models lists (re-read at every health scrape)
    models: tuple[str, ...] = ()
    # the API paths it serves (exact, '/v1/responses/{id}', or a prefix ending in '*'); empty: what its
    # /openapi.json lists (vLLM registers routes by the model's tasks), any path when it has none
    paths: tuple[str, ...] = ()

    @property
    def tls(self) -> bool:
        return self.url.startswith("https://")

    @property
    def sni(self) -> str:
        return self.tls_sni or self.host

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        u = urlsplit(self.url)
        return u.port or (443 if u.scheme == "https" else 80)


@dataclass(frozen=True, slots=True)
class BrainConfig:
    """Where the brain listens, and who may talk to it (docs/guide.md "Who may reach which port").

    Whoever reaches the gRPC services can move routing (forge access-log entries, open and release
    reservations), so by default there is no TCP listener: Envoy on the same host uses the Unix socket,
    which only the brain's user (and ``grpc_socket_group``) may open. A brain on another host listens on TCP
    with TLS, mutual TLS recommended; plain TCP beyond loopback is refused unless ``insecure`` says so.
    """

    host: str = "127.0.0.1"  # address of the gRPC TCP listener, when grpc_port is set
    # the gRPC TCP port (ext_proc, access log, health); unset: no TCP listener at all. 0 lets the OS pick
    grpc_port: int | None = None
    admin_port: int = 9101  # state-changing endpoints: always 127.0.0.1
    # The brain writes a fresh random token here at start (mode 0600); POST /reload and drain / undrain need it
    # as "Authorization: Bearer <token>", so a local user who reaches the loopback port cannot drain the fleet.
    # null: those endpoints take any caller on loopback
    admin_token_file: str | None = "/run/warmroute/admin.token"
    # endpoint-picker: true when the gateway in front strips flow_control.priority_header and the tenant header from
    # what clients send and sets them itself. Else the brain ignores both as a picker (behind a foreign gateway
    # nobody strips them: any client could make itself critical, or another tenant), unless the trust_downstream_*
    # settings say clients may set them
    trust_gateway_headers: bool = False
    # The key stored-response ids are signed with (made at first start, mode 0600): an id without its MAC never picks
    # a replica. Keep it across restarts (a Secret in Kubernetes) or follow-ups to earlier responses get 404. With
    # several brains, the key comes from shared_state.secret_file instead. null: a new key each start
    response_key_file: str | None = "/run/warmroute/response.key"
    metrics_host: str = "127.0.0.1"  # read-only /metrics for Prometheus; 0.0.0.0 to scrape from elsewhere
    metrics_port: int = 9102  # the port of the read-only Prometheus /metrics
    # Envoy on the same host connects here (about 0.1 ms a request less than TCP loopback). Mode 0600, or 0660
    # with grpc_socket_group; a directory the brain creates for it is 0700 (0750 with the group). null: TCP only
    grpc_socket: str | None = "/run/warmroute/brain.sock"
    grpc_socket_group: str | None = None  # a group (name or number) whose members, e.g. Envoy's user, may connect
    tls_cert_file: str | None = None  # PEM certificate of the TCP listener: with tls_key_file, gRPC over TLS
    tls_key_file: str | None = None  # PEM private key of tls_cert_file
    # PEM CA bundle: clients (Envoy) must present a certificate it signed (mutual TLS, recommended over a network)
    tls_client_ca_file: str | None = None
    # true: allow plain TCP (loopback included: every local user reaches it). Anyone who reaches the port can then
    # eject replicas and open or release reservations: only where nobody else does
    insecure: bool = False
    # "envoy": the Envoy that `warmroute envoy-config` renders (one message per request, release by access log).
    # "endpoint-picker": the Gateway API Inference Extension's protocol, for any gateway that speaks it
    # (docs/kubernetes.md): the answer is x-gateway-destination-endpoint, release is read from the response
    protocol: str = "envoy"
    # endpoint-picker: how many more endpoints follow the pick in the answer, for the gateway's retries
    picker_fallbacks: int = 2


PROTOCOLS = ("envoy", "endpoint-picker")
DISCOVERY_SOURCES = ("static", "dns", "kubernetes")


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    """Where the replica set comes from (docs/kubernetes.md "Discovery"). A source that fails keeps the last
    set it gave; a replica it adds starts EJECTED and earns LIVE from its scrapes; one it drops gets nothing new."""

    source: str = "static"  # static: the replicas list; dns: the records of dns_name; kubernetes: an InferencePool's pods
    interval_s: float = 10.0  # DNS is resolved again this often; Kubernetes lists again this often besides its watch
    port: int = 8000  # the engines' port (dns; kubernetes reads the pool's targetPorts or the slices' ports)
    scheme: str = "http"  # http or https, for discovered replicas
    engine: str = "vllm"  # the engine of every discovered replica (vllm, sglang, none)
    dns_name: str | None = None  # dns: e.g. the headless Service vllm.llm.svc.cluster.local
    dns_servers: tuple[str, ...] = ()  # dns: "ip" or "ip:port" to ask; empty: the system's resolvers
    namespace: str | None = None  # kubernetes: where the pool (or Service) and its pods are; null: the pod's own
    inference_pool: str | None = None  # kubernetes: an InferencePool (inference.networking.k8s.io/v1) to follow
    service: str | None = None  # kubernetes: or a Service, whose EndpointSlices name the pods
    # kubernetes: a kubeconfig file; null: the pod's service account (in-cluster)
    kubeconfig: str | None = None


@dataclass(frozen=True, slots=True)
class EnvoyConfig:
    """What the rendered Envoy bootstrap needs beyond the replica list."""

    listen_host: str = "0.0.0.0"  # where the rendered Envoy listens for clients
    listen_port: int = 8080  # the clients' port (the OpenAI API)
    # Envoy's admin interface: a Unix socket (mode 0600) in the brain's private directory, never a TCP port (any local
    # user could POST /quitquitquit to a loopback port and stop the data plane). `warmroute top` reads it there
    admin_path: str = "/run/warmroute/envoy-admin.sock"
    # A read-only listener for Prometheus: GET /stats/prometheus (Envoy's own metrics) and nothing else, proxied to the
    # admin socket. null: none
    stats_port: int | None = None
    stats_host: str = "127.0.0.1"  # where stats_port listens (0.0.0.0 to scrape from elsewhere)
    max_body_bytes: int = 64 * 1024 * 1024  # Envoy's 1 MiB default answers 413 to long contexts
    # past this Envoy fails open to the bounded ring-hash route. With flow control on, at least FLOW_FIRST_ANSWER_S:
    # in a burst the brain reads each call late, and one that fails open lands in the engines ahead of the sessions
    # under way (flow control exists to keep them there); a hung brain leaves Envoy's cluster at its health checks
    ext_proc_timeout_s: float = 1.0
    # ext_proc calls (and access-log streams) in flight to the brain at most; past it Envoy fails open at once. The
    # brain decides ~1,000 requests a second on a core: more than this waiting would outlast ext_proc_timeout_s
    brain_max_in_flight: int = 256
    stream_idle_timeout_s: float = 900.0  # a stalled replica must not hang a client forever; 0 disables
    upstream_connect_timeout_s: float = 1.0  # a replica that does not accept within this is retried elsewhere
    access_log_flush_s: float = 0.01  # how late a reservation may be released after the request ends
    # Envoy logs every request still in flight this often (access_log_flush_interval), so a reservation no entry
    # names for 2x this + ext_proc and connect timeouts is a lost or rogue call and is released; 0: never
    access_log_periodic_s: float = 10.0
    brain_health_check_interval_s: float = 1.0  # how often Envoy asks the brain's gRPC health
    retries: int = 2  # on connect failure / reset before any response byte, each on another replica
    # An upstream connection idle this long is closed by Envoy, before the engine closes it: vLLM's uvicorn drops a
    # keep-alive connection idle 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), SGLang's uvicorn 5 s too, and a request Envoy
    # writes on a connection the engine is closing comes back reset. 3 s leaves the engine's timer 2 s of margin
    # on a busy machine; a new connection costs a loopback or LAN handshake
    upstream_idle_timeout_s: float = 3.0
    # A gzip request body may inflate to at most this many times its compressed size (JSON chat bodies compress 3-20x;
    # a repeated prompt up to ~100x). Envoy inflates each piece it reads at once, before any buffer limit is seen, so
    # this is the bound on what one upload costs: 1,032 (zlib's ceiling) let 20 uploads of 61 KB take 1.4 GB. A body
    # past it is answered 413
    max_inflate_ratio: int = 100
    # Envoy's heap is bounded by its overload manager: past 85% of this it resets the streams that hold the most
    # buffered bytes (a decompression bomb, bodies that never end), past 95% it refuses new requests with a 503,
    # never crashing. 1 GiB holds fifteen bodies of max_body_bytes at once
    max_heap_bytes: int = 1024 * 1024 * 1024
    # C7: the fail-open route's ring hash lets a replica hold this % of the mean load before it passes requests on
    fail_open_hash_balance_factor: int = 150
    # With a path, replica clusters live in this file (Envoy watches its directory) and the brain
    # rewrites it on reload, so Envoy learns added and removed replicas without a restart.
    cds_path: str | None = None
    # Bodies with a Content-Length above this reach the brain as headers only (session header, size): a body of
    # tens of MiB costs the brain ~70 ms of gRPC copying on its event loop, and a few at once would push small
    # requests past ext_proc_timeout_s. The prefix chain reads at most the first 1 MiB anyway; the seed policy loses
    # the body's keys (A3: conversation_id, the system prompt) above it: raise it to profile.max_body_bytes to keep them.
    brain_body_max_bytes: int = 2 * 1024 * 1024
    # Paths served through the listener (exact, a '{name}' segment for any one segment, or a prefix when the entry
    # ends in '*'); others get a 404. docs/apis.md decides every path of vLLM 0.32
    # from Envoy: a replica's operational endpoints (/metrics, /reset_prefix_cache, /sleep, ...) stay private.
    allowed_paths: tuple[str, ...] = (
        "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/responses/{id}", "/v1/responses/{id}/cancel",
        "/v1/messages",
        "/v1/messages/count_tokens", "/v1/embeddings",
        "/v1/models", "/v1/audio/transcriptions", "/v1/audio/translations", "/v1/score", "/v1/rerank",
        "/rerank", "/v2/rerank", "/score", "/pooling", "/classify", "/tokenize", "/detokenize", "/health",
    )
    # The tenant header is stripped from what clients send unless a proxy in front of Envoy sets it (true here
    # only when that proxy overwrites whatever the client sent).
    trust_downstream_tenant_header: bool = False
    # (the client side of the brain's TLS, when Envoy reaches it over TCP with brain.tls_cert_file set)
    brain_tls_ca_file: str | None = None  # the CA that signed the brain's certificate (null: the system's bundle)
    brain_tls_sni: str | None = None  # the name Envoy asks for and checks in the brain's certificate (null: brain.host)
    brain_tls_cert_file: str | None = None  # Envoy's client certificate, for a brain that asks (tls_client_ca_file)
    brain_tls_key_file: str | None = None  # the private key of brain_tls_cert_file
    # more brains sharing state (shared_state) that this Envoy spreads requests over, beside the brain of this
    # config: "unix:/path/brain.sock" or "ip:port" each. Several brain processes on one host (one core each), or
    # several pickers (a Kubernetes gateway reaches the picker Deployment's replicas through its Service instead)
    brain_endpoints: tuple[str, ...] = ()
    # the other brains sharing state (shared_state), asked when this Envoy's own brain is down instead of failing
    # open to the ring hash (Envoy's priority failover; its access log follows): "unix:/path.sock" or "ip:port"
    brain_failover: tuple[str, ...] = ()
    # `envoy-config --mode endpoint-picker`: how Envoy sends bodies to the brain. "full-duplex" is what Inference
    # Extension gateways send (FULL_DUPLEX_STREAMED both ways): a brain that dies takes the requests in flight with
    # it. "buffered" (request BUFFERED, response STREAMED) fails open at any moment: Envoy holds what it sent
    picker_body_mode: str = "buffered"


@dataclass(frozen=True, slots=True)
class SharedStateConfig:
    """Several brains, one view (README "Running several brains"): each brain ships what its decisions change
    (session homes, indexed blocks, reservations; hashes and replica names only) through Redis and applies the
    others'. A decision never waits for Redis; without Redis every brain routes on its own view. Off by default:
    one brain needs no Redis."""

    # redis://[user@]host:port/db, rediss:// for TLS, unix:///path.sock; null: no sharing
    redis_url: str | None = None
    password_file: str | None = None  # a file holding the password (AUTH / the ACL user's); never in the config
    username: str | None = None  # an ACL user (Redis 6+); the URL's user works too
    tls_ca_file: str | None = None  # rediss://: the CA bundle that signed Redis's certificate (null: the system's)
    tls_cert_file: str | None = None  # rediss://: a client certificate, when Redis asks for one (tls-auth-clients)
    tls_key_file: str | None = None  # rediss://: the client certificate's key
    key_prefix: str = "warmroute:"  # every key this fleet's brains use; another fleet on the same Redis takes another
    brain_id: str | None = None  # how the others name this brain; null: host name, process id and a random part
    # a brain ships its changes this often (the others see them this much later, plus transit). Each flush is a Redis
    # round trip on the brain's one core: at 5 ms they cost a saturated brain 10-25% of its requests/s, at 20 ms ~5%
    flush_ms: float = 20.0
    heartbeat_s: float = 1.0  # a brain with nothing to ship says it is alive this often
    peer_timeout_s: float = 5.0  # another brain silent this long is gone: its requests in flight count no more
    stream_max_entries: int = 200_000  # the change stream is trimmed to about this many entries (Redis memory)
    snapshot_every_s: float = 30.0  # one brain writes the whole view this often (a starting brain reads it)
    warm_start_timeout_s: float = 20.0  # a starting brain reports ready after this at most, warmed or not
    timeout_s: float = 2.0  # a Redis command slower than this counts as Redis down (reconnect with backoff)
    # A file (mode 0600) holding the secret every brain of the fleet signs its entries and snapshots with (HMAC-SHA256):
    # what does not verify is dropped and counted, so whoever can write to Redis cannot steer routing or speak as
    # another brain. null: unsigned (logged at start; then only Redis's own authentication guards the stream)
    secret_file: str | None = None
    # a snapshot inflates to at most this many bytes (100K sessions: ~30 MB); a larger one is refused, not read
    snapshot_max_bytes: int = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class FlowControlConfig:
    """Flow control (issue 34; on): a session turn that needs new room in a cache (a new session, or one that must
    prefill most of its context again) and fits on no replica beside the active sessions' contexts waits in the
    brain, which holds Envoy's ext_proc call (or, as an endpoint picker, the gateway's pick) open, and goes to the
    first replica where it fits, in the queue's order (class, tenants by the tokens they were served, then
    arrival); a turn that keeps its cache, a one-shot and critical work are never held. One predicted to miss
    its deadline (x-warmroute-ttft-slo-ms, or its class's) is refused at once; held too long, 429 with Retry-After.
    With hold_on_wait, a request is also held while every replica would make it wait longer than its own prefill.
    Measured in the simulator (docs/routing.md "Flow control")."""

    enabled: bool = True  # false: every request is placed at once, as before flow control
    max_requests: int = 10_000  # requests held at most; past it a newcomer gets 429 with Retry-After
    # their bodies' bytes at most. On by default, so sized for the shipped pod (2 GiB limit): each held body also
    # keeps its parsed profile (its block hashes, about half the body's size again)
    max_bytes: int = 256 << 20
    # a request held this long is answered 429 with Retry-After (Envoy's timer is extended so). As an endpoint
    # picker, keep it below the gateway's ext_proc message timeout unless the gateway sets max_message_timeout
    # (the pick asks for this long, + 5 s): a gateway that gives up first fails the request itself
    wait_s: float = 30.0
    # also hold a request whose wait on the best replica passes its own prefill there (half of it, sheddable),
    # not only a new session that fits nowhere: shortens a burst's tail on some fleets, costs throughput in lasting
    # overload (docs/routing.md "Flow control")
    hold_on_wait: bool = False
    sheddable_wait_s: float = 10.0  # a sheddable request is held this long at most (never longer than wait_s)
    retry_after_s: int = 2  # what a 429 tells the client to wait
    # the request's class, "critical" (never held), "standard" (the default) or "sheddable" (held sooner), from a
    # header only a trusted filter sets: Envoy strips it from what clients send unless trusted below
    priority_header: str = "x-warmroute-priority"
    trust_downstream_priority_header: bool = False  # true: clients may set it themselves (a trusted network)


FLOW_FIRST_ANSWER_S = 5.0


@dataclass(frozen=True, slots=True)
class AppConfig:
    replicas: tuple[ReplicaSpec, ...] = ()
    router: RouterConfig = field(default_factory=RouterConfig)
    brain: BrainConfig = field(default_factory=BrainConfig)
    envoy: EnvoyConfig = field(default_factory=EnvoyConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    shared_state: SharedStateConfig = field(default_factory=SharedStateConfig)
    flow_control: FlowControlConfig = field(default_factory=FlowControlConfig)  # issue 34: on; holds new sessions that fit nowhere
    # models.aliases: a client's model name -> the served names it goes to, with weights (a canary's share)
    aliases: tuple[tuple[str, tuple[Target, ...]], ...] = ()
    source: str = "<defaults>"
    # A reload that would leave no replica is refused unless the file says so: a config caught half-written
    # (an empty file) must not take the fleet out.
    allow_no_replicas: bool = False


_SECTIONS = {"health": HealthConfig, "pins": PinConfig, "profile": ProfileConfig, "warm": WarmConfig}
# RouterConfig's own scalar fields live under "routing:".
_ROUTING_FIELDS = {f.name for f in dataclasses.fields(RouterConfig)} - set(_SECTIONS)


def _coerce(path: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (tp,) = [a for a in args if a is not type(None)]
        return _coerce(path, value, tp)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true or false, got {_short(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        raise ConfigError(f"{path}: expected a whole number >= 0, got {_short(value)}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
            return float(value)
        raise ConfigError(f"{path}: expected a number >= 0, got {_short(value)}")
    if tp is str:
        if isinstance(value, str) and value:
            return value
        raise ConfigError(f"{path}: expected a non-empty string, got {_short(value)}")
    if origin is tuple:
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"{path}: expected a list of non-empty strings, got {_short(value)}")
        return tuple(v.lower() if "header" in path else v for v in value)
    raise ConfigError(f"{path}: unsupported type")  # pragma: no cover - a programming error


def _fill(section: str, cls: type, raw: Any, allowed: set[str] | None = None) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{section}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = allowed if allowed is not None else {f.name for f in dataclasses.fields(cls)}
    out = {}
    for key, value in raw.items():
        if key not in names:
            raise ConfigError(f"{section}.{key}: unknown field (known: {', '.join(sorted(names))})")
        out[key] = _coerce(f"{section}.{key}", value, hints[key])
    return out


def _replicas(raw: Any) -> tuple[ReplicaSpec, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError(f"replicas: expected a list, got {type(raw).__name__}")
    seen: set[str] = set()
    out = []
    for i, item in enumerate(raw):
        where = f"replicas[{i}]"
        if not isinstance(item, dict):
            raise ConfigError(f"{where}: expected a mapping with name and url")
        known = {"name", "url", "engine", "tls_ca_file", "tls_sni", "tls_cert_file", "tls_key_file", "models", "paths"}
        extra = set(item) - known
        if extra:
            raise ConfigError(f"{where}.{sorted(extra)[0]}: unknown field (known: {', '.join(sorted(known))})")
        tls = {k: item[k] for k in known - {"name", "url", "engine", "models", "paths"} if item.get(k) is not None}
        models = item.get("models") or []
        if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
            raise ConfigError(f"{where}.models: expected a list of model names, got {_short(models)}")
        paths = item.get("paths") or []
        if not isinstance(paths, list) or not all(isinstance(p, str) and p.startswith("/") and " " not in p
                                                  and len(p) <= MAX_PATH_CHARS for p in paths):
            raise ConfigError(f"{where}.paths: expected a list of paths like /v1/chat/completions, "
                              f"/v1/responses/{{id}} or /v1/*, got {_short(paths)}")
        for k, v in tls.items():
            if not isinstance(v, str) or not v:
                raise ConfigError(f"{where}.{k}: expected a non-empty string, got {_short(v)}")
        engine = item.get("engine", "vllm")
        if engine not in ENGINES:
            raise ConfigError(f"{where}.engine: expected one of {', '.join(ENGINES)}, got {_short(engine)}")
        name = item.get("name")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ConfigError(f"{where}.name: expected letters, digits, '_', '.', '-' (<= 63), got {_short(name)}")
        if name in seen:
            raise ConfigError(f"{where}.name: duplicate replica name {_short(name)}")
        if name.startswith(RESERVED_NAME_PREFIX):
            raise ConfigError(f"{where}.name: names starting with {RESERVED_NAME_PREFIX!r} are reserved")
        seen.add(name)
        url = item.get("url")
        parts = urlsplit(url) if isinstance(url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"{where}.url: expected an http(s) URL like http://127.0.0.1:8000, got {_short(url)}")
        if parts.username is not None or parts.password is not None:
            # never echo them: the URL would be shown in /state, logs and errors
            raise ConfigError(f"{where}.url: credentials in the URL are not supported (they would be shown in "
                              "/state and logs); give the replica's base URL")
        if parts.path.rstrip("/") or parts.query or parts.fragment:
            raise ConfigError(f"{where}.url: a path, query or fragment is not supported (Envoy would send traffic "
                              f"to / while the brain scraped the path); give the server's base URL, got {_short(url)}")
        if parts.scheme == "http" and tls:
            raise ConfigError(f"{where}.{sorted(tls)[0]}: TLS settings need an https:// URL")
        if ("tls_cert_file" in tls) != ("tls_key_file" in tls):
            raise ConfigError(f"{where}.tls_key_file: tls_cert_file and tls_key_file go together")
        try:
            parts.port
        except ValueError:
            raise ConfigError(f"{where}.url: bad port in {_short(url)}") from None
        out.append(ReplicaSpec(name, url.rstrip("/"), engine, **tls, models=tuple(models), paths=tuple(paths)))
    return tuple(out)


_LOOPBACK = ("127.", "localhost", "::1")


def first_answer_s(cfg: "AppConfig") -> float:
    """How long Envoy waits for the brain's first answer to a call (envoy.ext_proc_timeout_s, see there)."""
    t = cfg.envoy.ext_proc_timeout_s
    return max(t, FLOW_FIRST_ANSWER_S) if cfg.flow_control.enabled else t


def brain_calls_max(cfg: "AppConfig") -> int:
    """Envoy's calls in flight to one brain at most (its circuit breaker): with flow control, the calls it may hold
    count on top of brain_max_in_flight."""
    return cfg.envoy.brain_max_in_flight + (cfg.flow_control.max_requests if cfg.flow_control.enabled else 0)


def is_loopback(host: str) -> bool:
    return host.startswith(_LOOPBACK) or host == "[::1]"


def check_brain_access(brain: BrainConfig, envoy: EnvoyConfig) -> None:
    """Who may reach the brain's gRPC: a Unix socket on this host, or TCP with TLS beyond loopback."""
    if brain.grpc_socket is None and brain.grpc_port is None:
        raise ConfigError("brain.grpc_socket: no gRPC listener: set grpc_socket (Envoy on this host) or grpc_port "
                          "(with TLS for another host)")
    if (brain.tls_cert_file is None) != (brain.tls_key_file is None):
        raise ConfigError("brain.tls_key_file: tls_cert_file and tls_key_file go together")
    if brain.tls_client_ca_file is not None and brain.tls_cert_file is None:
        raise ConfigError("brain.tls_client_ca_file: mutual TLS needs the brain's own tls_cert_file and tls_key_file")
    if brain.grpc_port is not None and brain.tls_cert_file is None and not brain.insecure:
        # loopback is no exception: any local user reaches it, forges access-log entries and ejects replicas
        field = "brain.grpc_port" if is_loopback(brain.host) else "brain.host"
        raise ConfigError(f"{field}: plain TCP on {brain.host} lets anyone who reaches it move routing: set "
                          "tls_cert_file and tls_key_file (and tls_client_ca_file for mutual TLS), use grpc_socket, or "
                          "insecure: true")
    if (envoy.brain_tls_cert_file is None) != (envoy.brain_tls_key_file is None):
        raise ConfigError("envoy.brain_tls_key_file: brain_tls_cert_file and brain_tls_key_file go together")
    if brain.tls_client_ca_file is not None and brain.grpc_socket is None and envoy.brain_tls_cert_file is None:
        raise ConfigError("envoy.brain_tls_cert_file: the brain asks for a client certificate (brain.tls_client_ca_file)"
                          "; give Envoy one")


def parse_config(doc: Any, source: str = "<dict>") -> AppConfig:
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    known = {"replicas", "routing", "brain", "envoy", "discovery", "models", "allow_no_replicas", "shared_state",
             "flow_control", *_SECTIONS}
    for key in doc:
        if key not in known:
            raise ConfigError(f"{key}: unknown section (known: {', '.join(sorted(known))})")
    kwargs: dict[str, Any] = {}
    for section, cls in _SECTIONS.items():
        kwargs[section] = cls(**_fill(section, cls, doc.get(section)))
    kwargs.update(_fill("routing", RouterConfig, doc.get("routing"), _ROUTING_FIELDS))
    router = RouterConfig(**kwargs)
    if router.token_weight_unit < 1:
        raise ConfigError("routing.token_weight_unit: expected a whole number >= 1")
    if router.profile.chars_per_token <= 0:
        raise ConfigError("profile.chars_per_token: expected a number > 0")
    if router.pins.max_pins < 1:
        raise ConfigError("pins.max_pins: expected a whole number >= 1")
    if router.profile.max_prompt_tokens < 1:
        raise ConfigError("profile.max_prompt_tokens: expected a whole number >= 1")
    if router.policy not in POLICIES:
        raise ConfigError(f"routing.policy: expected one of {', '.join(PRODUCTION)} (or an ablation: "
                          f"{', '.join(p for p in POLICIES if p not in PRODUCTION)}), got {_short(router.policy)}")
    if router.profile.block_chars != 64:
        # the router, the mock and the simulator share one block function of 64-byte blocks
        raise ConfigError("profile.block_chars: only 64 is supported (16 tokens at 4 characters a token)")
    if not 1.0 <= router.warm.balance_factor:
        raise ConfigError("warm.balance_factor: expected a number >= 1 (1.25-1.5 is typical)")
    if not 0.0 < router.warm.kv_pressure <= 1.0:
        raise ConfigError("warm.kv_pressure: expected a number in (0, 1]")
    for f in ("prefill_tokens_per_s", "decode_s_per_token", "load_refresh_s", "cache_tokens", "arrival_window_s",
              "busy_wait_s"):
        if getattr(router.warm, f) <= 0:
            raise ConfigError(f"warm.{f}: expected a number > 0")
    if router.health.scrape_interval_s <= 0:
        raise ConfigError("health.scrape_interval_s: expected a number > 0")
    for f in ("max_metrics_bytes", "max_metrics_series", "max_engines"):
        if getattr(router.health, f) < 1:
            raise ConfigError(f"health.{f}: expected a whole number >= 1")
    brain = BrainConfig(**_fill("brain", BrainConfig, doc.get("brain")))
    if isinstance(doc.get("envoy"), dict) and "admin_port" in doc["envoy"]:
        raise ConfigError("envoy.admin_port: Envoy's admin listens on a Unix socket now (envoy.admin_path, mode 0600: "
                          "a local user could stop Envoy through a TCP port); for Prometheus set envoy.stats_port")
    envoy = EnvoyConfig(**_fill("envoy", EnvoyConfig, doc.get("envoy")))
    for section, obj in (("brain", brain), ("envoy", envoy)):
        for f in dataclasses.fields(obj):
            if f.name.endswith("_port") and (getattr(obj, f.name) or 0) > 65535:
                raise ConfigError(f"{section}.{f.name}: expected a port number 0..65535")
    check_brain_access(brain, envoy)
    if brain.grpc_socket is not None and not 0 < len(brain.grpc_socket.encode()) <= 100:
        raise ConfigError("brain.grpc_socket: expected a path of 1..100 bytes (Unix sockets allow 107)")
    for i, path in enumerate(envoy.allowed_paths):
        if not path.startswith("/") or "*" in path[:-1] or any(c in path for c in " ?#"):
            raise ConfigError(f"envoy.allowed_paths[{i}]: expected a path like /v1/chat/completions (a trailing '*' "
                              f"for a prefix), got {_short(path)}")
    if router.profile.tenant_source not in TENANT_SOURCES:
        raise ConfigError(f"profile.tenant_source: expected one of {', '.join(TENANT_SOURCES)}, got "
                          f"{_short(router.profile.tenant_source)}")
    if router.profile.tenant_source == "header" and not router.profile.tenant_header:
        raise ConfigError("profile.tenant_header: tenant_source 'header' needs a header name")
    if envoy.fail_open_hash_balance_factor < 100:
        raise ConfigError("envoy.fail_open_hash_balance_factor: expected a whole number >= 100 (Envoy's minimum)")
    if not envoy.admin_path or not 0 < len(envoy.admin_path.encode()) <= 100:
        raise ConfigError("envoy.admin_path: expected a Unix socket path of 1..100 bytes (Envoy's admin is never a TCP "
                          "port)")
    if not 1 <= envoy.max_inflate_ratio <= 1032:
        raise ConfigError("envoy.max_inflate_ratio: expected a whole number 1..1032 (zlib inflates at most 1032:1)")
    if envoy.max_heap_bytes < 4 * envoy.max_body_bytes:
        raise ConfigError("envoy.max_heap_bytes: expected at least 4x envoy.max_body_bytes (a few bodies at once, and "
                          "Envoy's own ~100 MB)")
    if not 0 < envoy.upstream_idle_timeout_s < 5:
        raise ConfigError("envoy.upstream_idle_timeout_s: expected a number of seconds in (0, 5): below the engines' "
                          "5 s keep-alive")
    if envoy.brain_body_max_bytes < 1024:
        raise ConfigError("envoy.brain_body_max_bytes: expected a whole number >= 1024")
    if router.profile.max_body_bytes > envoy.max_body_bytes:
        raise ConfigError("profile.max_body_bytes: must not exceed envoy.max_body_bytes")
    allow = doc.get("allow_no_replicas", False)
    if not isinstance(allow, bool):
        raise ConfigError(f"allow_no_replicas: expected true or false, got {_short(allow)}")
    if envoy.picker_body_mode not in ("buffered", "full-duplex"):
        raise ConfigError(f"envoy.picker_body_mode: expected buffered or full-duplex, got {_short(envoy.picker_body_mode)}")
    for field_ in ("brain_endpoints", "brain_failover"):
        for i, ep in enumerate(getattr(envoy, field_)):
            host, _, port = ep.rpartition(":")
            if not (ep.startswith("unix:/") or (_is_ip(host.strip("[]")) and port.isdigit() and 0 < int(port) < 65536)):
                raise ConfigError(f"envoy.{field_}[{i}]: expected unix:/path.sock or ip:port, got {_short(ep)}")
    if brain.protocol not in PROTOCOLS:
        raise ConfigError(f"brain.protocol: expected one of {', '.join(PROTOCOLS)}, got {_short(brain.protocol)}")
    discovery = _discovery(doc.get("discovery"))
    replicas = _replicas(doc.get("replicas"))
    if brain.protocol == "endpoint-picker" and discovery.source == "static":
        for i, r in enumerate(replicas):
            if not _is_ip(r.host):
                # the gateway is told "ip:port" and matches it against its own endpoints: a name would match none
                raise ConfigError(f"replicas[{i}].url: brain.protocol endpoint-picker answers ip:port; give the "
                                  f"replica's IP address (or discovery: dns), got {_short(r.url)}")
    shared = _shared_state(doc.get("shared_state"))
    if envoy.brain_endpoints and not shared.redis_url:
        raise ConfigError("envoy.brain_endpoints: several brains behind one Envoy share their sessions and in-flight "
                          "work only through shared_state (set shared_state.redis_url)")
    if envoy.brain_failover and not shared.redis_url:
        raise ConfigError("envoy.brain_failover: another brain knows this one's sessions only through shared_state "
                          "(set shared_state.redis_url)")
    flow = _flow_control(doc.get("flow_control"))
    return AppConfig(replicas, router, brain, envoy, discovery, shared, flow, _aliases(doc.get("models")), source,
                     allow)


def _flow_control(raw: Any) -> FlowControlConfig:
    c = FlowControlConfig(**_fill("flow_control", FlowControlConfig, raw))
    if c.max_requests < 1 or c.max_bytes < 1:
        raise ConfigError("flow_control.max_requests, max_bytes: expected whole numbers >= 1")
    if not 0 < c.wait_s <= 3600:
        raise ConfigError(f"flow_control.wait_s: expected a number of seconds in (0, 3600], got {c.wait_s}")
    if not 0 < c.sheddable_wait_s <= 3600:
        raise ConfigError(f"flow_control.sheddable_wait_s: expected a number of seconds in (0, 3600], got "
                          f"{c.sheddable_wait_s}")
    if c.retry_after_s < 1:
        raise ConfigError("flow_control.retry_after_s: expected a whole number >= 1")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9-]*", c.priority_header or ""):
        raise ConfigError(f"flow_control.priority_header: expected a header name, got {_short(c.priority_header)}")
    return c


def _aliases(raw: Any) -> tuple[tuple[str, tuple[Target, ...]], ...]:
    """models: {aliases: {client name: served name | [{model: served name, weight: n}, ...]}}"""
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise ConfigError(f"models: expected a mapping, got {type(raw).__name__}")
    for key in raw:
        if key != "aliases":
            raise ConfigError(f"models.{key}: unknown field (known: aliases)")
    aliases = raw.get("aliases") or {}
    if not isinstance(aliases, dict):
        raise ConfigError(f"models.aliases: expected a mapping of client name to served name(s), got {_short(aliases)}")
    out = []
    for alias, value in aliases.items():
        where = f"models.aliases.{alias}"
        if not isinstance(alias, str) or not alias:
            raise ConfigError(f"models.aliases: expected model names as keys, got {_short(alias)}")
        if isinstance(value, str) and value:
            out.append((alias, (Target(value, 1.0),)))
            continue
        if not isinstance(value, list) or not value:
            raise ConfigError(f"{where}: expected a served model name or a list of {{model, weight}}, got {_short(value)}")
        targets = []
        for i, t in enumerate(value):
            if not isinstance(t, dict) or set(t) - {"model", "weight"} or not isinstance(t.get("model"), str) \
                    or not t["model"]:
                raise ConfigError(f"{where}[{i}]: expected {{model: <served name>, weight: <number > 0>}}, got {_short(t)}")
            w = t.get("weight", 1)
            if isinstance(w, bool) or not isinstance(w, (int, float)) or w <= 0:
                raise ConfigError(f"{where}[{i}].weight: expected a number > 0, got {_short(w)}")
            targets.append(Target(t["model"], float(w)))
        out.append((alias, tuple(targets)))
    return tuple(out)


def _is_ip(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _shared_state(raw: Any) -> SharedStateConfig:
    c = SharedStateConfig(**_fill("shared_state", SharedStateConfig, raw))
    if c.redis_url is not None:
        u = urlsplit(c.redis_url)
        if u.scheme not in ("redis", "rediss", "unix") or not (u.hostname or u.path):
            raise ConfigError(f"shared_state.redis_url: expected redis://host:port/db, rediss://... or "
                              f"unix:///path, got {_short(c.redis_url)}")
        if u.password:
            raise ConfigError("shared_state.redis_url: a password in the URL would be shown wherever the config is; "
                              "put it in shared_state.password_file")
    for f in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
        if getattr(c, f) is not None and not (c.redis_url or "").startswith("rediss://"):
            raise ConfigError(f"shared_state.{f}: TLS needs a rediss:// redis_url")
    for f in ("flush_ms", "heartbeat_s", "peer_timeout_s", "snapshot_every_s", "timeout_s"):
        if getattr(c, f) <= 0:
            raise ConfigError(f"shared_state.{f}: expected a number > 0")
    if c.peer_timeout_s < 2 * c.heartbeat_s:
        raise ConfigError("shared_state.peer_timeout_s: expected at least twice heartbeat_s (one late heartbeat "
                          "must not end a brain)")
    if c.stream_max_entries < 1000:
        raise ConfigError("shared_state.stream_max_entries: expected a whole number >= 1000")
    if c.brain_id is not None and not _NAME_RE.match(c.brain_id):
        raise ConfigError(f"shared_state.brain_id: expected letters, digits, '.', '_' or '-', got {_short(c.brain_id)}")
    return c


def _discovery(raw: Any) -> DiscoveryConfig:
    d = DiscoveryConfig(**_fill("discovery", DiscoveryConfig, raw))
    if d.source not in DISCOVERY_SOURCES:
        raise ConfigError(f"discovery.source: expected one of {', '.join(DISCOVERY_SOURCES)}, got {_short(d.source)}")
    if d.scheme not in ("http", "https"):
        raise ConfigError(f"discovery.scheme: expected http or https, got {_short(d.scheme)}")
    if d.engine not in ENGINES:
        raise ConfigError(f"discovery.engine: expected one of {', '.join(ENGINES)}, got {_short(d.engine)}")
    if not 0 < d.port <= 65535:
        raise ConfigError(f"discovery.port: expected a port number 1..65535, got {d.port}")
    if d.interval_s < 0.05:
        raise ConfigError(f"discovery.interval_s: expected a number >= 0.05, got {d.interval_s}")
    if d.source == "dns" and not d.dns_name:
        raise ConfigError("discovery.dns_name: source dns needs the name to resolve (e.g. a headless Service)")
    for i, s in enumerate(d.dns_servers):
        host, _, port = s.rpartition(":") if s.count(":") == 1 else (s, "", "")
        if not _is_ip(host or s) or (port and not (port.isdigit() and 0 < int(port) <= 65535)):
            raise ConfigError(f"discovery.dns_servers[{i}]: expected an IP address or ip:port, got {_short(s)}")
    if d.source == "kubernetes" and (d.inference_pool is None) == (d.service is None):
        raise ConfigError("discovery.inference_pool: source kubernetes follows one InferencePool or one service; "
                          "name exactly one")
    return d


def load_config(path: str | Path) -> AppConfig:
    p = Path(path)
    try:
        if p.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{p}: larger than {MAX_CONFIG_BYTES} bytes; a config file is a few KiB")
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{p}: cannot read ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not UTF-8 text") from None
    try:
        doc = yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader with an alias bound
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise ConfigError(f"{p}:{where}: {problem}") from None
    return parse_config(doc, str(p))
