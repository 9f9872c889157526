"""The config's sections as dataclasses: every field, its default and, in its comment, what it does (the reference:
``make docs`` writes docs/configuration.md from these comments)."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from ..core.config import RouterConfig
from ..core.models import Target


ENGINES = ("vllm", "sglang", "none", "auto")


class ConfigError(ValueError):
    """One line that names the offending field."""


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
    # prefill/decode disaggregation: "prefill" takes only prefill legs, "decode" only requests (and their decode
    # legs), "both" either (docs/routing.md "Prefill/decode disaggregation")
    role: str = "both"
    # exact mode on an engine that does not list its KV event publishers at GET /kv_event_sources (vLLM before
    # 0.32, or a port the brain must reach another way): each data-parallel engine's (publisher, replay) endpoints,
    # as the config's ``kv_events: {endpoint, replay_endpoint, data_parallel_size}`` names them (ports offset by the
    # rank, as vLLM offsets them); empty: asked at /kv_event_sources
    kv_events: tuple[tuple[str, str | None], ...] = ()

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

    # static: the replicas list; dns: the records of dns_name; kubernetes: an InferencePool's pods
    source: str = "static"
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
    # exact mode where the engines do not list their KV event publishers at /kv_event_sources (vLLM before 0.32):
    # every discovered replica's publisher at this port of its own address (its replay socket at the next field's;
    # data-parallel ranks at the ports after, as vLLM offsets them); null: asked at /kv_event_sources. A Kubernetes
    # pod may name its own: the annotations warmroute.io/kv-events-port and warmroute.io/kv-events-replay-port
    kv_events_port: int | None = None  # the publisher's port on each replica (null: asked at /kv_event_sources)
    kv_events_replay_port: int | None = None  # its replay socket's port there (null: none)
    kv_events_data_parallel_size: int = 1  # engines per replica: their publishers at the ports after, by rank


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
    # the body's keys (A3: conversation_id, the system prompt) above it: raise it to profile.max_body_bytes to keep
    # them.
    brain_body_max_bytes: int = 2 * 1024 * 1024
    # The header path (docs/architecture.md, "Two paths"): a request that names a session in a header and declares
    # its size is first asked about with its headers alone; a turn whose home takes it is routed there at once and its
    # body streams to the replica unread (no buffer, no second call). Others read their body as before, at the price of
    # one header-sized call. false: every body goes through the brain.
    header_path: bool = True
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
    # what does not verify is dropped and counted, so whoever can write to Redis cannot steer routing. Each brain
    # also signs with a key of its own (made at start), so that no brain, secret or not, writes as another.
    # null: unsigned by the fleet (logged at start; then only Redis's own authentication guards the stream)
    secret_file: str | None = None
    # a snapshot inflates to at most this many bytes (100K sessions and 30 replicas' indexes: ~30 MB; 256 MiB took a
    # starting brain to 1.1-1.5 GB); a larger one is refused, not read
    snapshot_max_bytes: int = 64 * 1024 * 1024
    # other brains heard from at once at most: an origin past it is not applied until one falls silent (a peer with
    # the fleet's secret could otherwise make up origins, each with its own bounded share)
    max_peers: int = 64
    # one other brain's requests in flight at most (its open reservations); past it its new ones are not counted
    peer_max_reservations: int = 8192


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
    # a tenant's engine tokens a minute at most (its prompts' uncached part and their answers), across brains; over
    # it, 429 with Retry-After before anything is read or priced (docs/routing.md "Tenant caps"). 0: no cap. Only
    # requests that name a tenant (profile.tenant_source) are capped, never critical work
    tenant_tokens_per_minute: int = 0
    # per tenant, by its name as profile.tenant_header gives it: its own tokens a minute (0: none), instead of the above
    tenant_caps: tuple[tuple[str, int], ...] = ()


FLOW_FIRST_ANSWER_S = 5.0


@dataclass(frozen=True, slots=True)
class ExactCacheConfig:
    """The engines' own word on their caches (issue 45; on): the brain subscribes to the KV events each vLLM
    replica lists at GET /kv_event_sources (vLLM started with --kv-events-config), re-hashes every stored block
    and, for an engine whose hashes verify, prices a request's cached tokens by what that engine holds rather than
    by the brain's own model of its cache. A request is priced so when its model's tokenizer is listed below; an
    engine whose hashes do not verify, or that publishes nothing, is estimated as before (/state says which and
    why). docs/routing.md "The engine's own word"."""

    enabled: bool = True
    # the engines' seed for a chain's first parent: their PYTHONHASHSEED if they run with one (it must match)
    hash_seed: str = "vllm-none-hash"
    # the engines' --prefix-caching-hash-algo: sha256 (vLLM's default) is reproduced; any other is estimated
    hash_algo: str = "sha256"
    # served model -> the directory the engine loads it from (its tokenizer.json and chat template): that model's
    # chat requests are tokenized as the engine does. A model not listed here is estimated
    tokenizers: tuple[tuple[str, str], ...] = ()
    # served model -> the chat template file its engines were started with (vLLM's --chat-template), when it is
    # not the one in the model's directory
    chat_templates: tuple[tuple[str, str], ...] = ()
    # a larger body is estimated, always
    max_body_bytes: int = 16 << 20
    # a turn with more text to tokenize than this (characters after what its session's last turn tokenized) is
    # tokenized in a worker process: that request is estimated, the session's next turns extend it. On the event
    # loop a turn costs ~0.5-1.5 µs a token of new text (32K characters: ~10-30 ms), a 130K-token first turn 0.4-0.6 s
    inline_chars: int = 32 << 10


@dataclass(frozen=True, slots=True)
class AppConfig:
    replicas: tuple[ReplicaSpec, ...] = ()
    router: RouterConfig = field(default_factory=RouterConfig)
    brain: BrainConfig = field(default_factory=BrainConfig)
    envoy: EnvoyConfig = field(default_factory=EnvoyConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    shared_state: SharedStateConfig = field(default_factory=SharedStateConfig)
    # issue 34: on; holds new sessions that fit nowhere
    flow_control: FlowControlConfig = field(default_factory=FlowControlConfig)
    # models.aliases: a client's model name -> the served names it goes to, with weights (a canary's share)
    aliases: tuple[tuple[str, tuple[Target, ...]], ...] = ()
    source: str = "<defaults>"
    # A reload that would leave no replica is refused unless the file says so: a config caught half-written
    # (an empty file) must not take the fleet out.
    allow_no_replicas: bool = False
    exact_cache: ExactCacheConfig = field(default_factory=ExactCacheConfig)  # issue 45: on where engines publish


def first_answer_s(cfg: "AppConfig") -> float:
    """How long Envoy waits for the brain's first answer to a call (envoy.ext_proc_timeout_s, see there)."""
    t = cfg.envoy.ext_proc_timeout_s
    return max(t, FLOW_FIRST_ANSWER_S) if cfg.flow_control.enabled else t


# what an extended Envoy timer gives beyond the brain's own bound (a hold's wait_s, a prefill leg's timeout): the
# brain answers first (a 429, a local prefill), never Envoy's timer failing the request open
TIMER_SLACK_S = 5.0


def held_s(cfg: "AppConfig") -> float:
    """How long the brain may keep a held request's call open (Envoy's timer extended)."""
    return cfg.flow_control.wait_s + TIMER_SLACK_S


def legs_s(cfg: "AppConfig") -> float:
    """How long the brain may keep a disaggregated request's call open for its prefill leg (Envoy's timer extended)."""
    return cfg.router.disaggregation.prefill_timeout_s + TIMER_SLACK_S


def max_message_s(cfg: "AppConfig") -> float | None:
    """The longest a call's timer may be extended to (Envoy's max_message_timeout): a held request's wait, a
    prefill leg's; None: never extended."""
    out = [held_s(cfg)] if cfg.flow_control.enabled else []
    if cfg.router.disaggregation.enabled and cfg.brain.protocol != "endpoint-picker":
        out.append(legs_s(cfg))
    return max(out) if out else None


def brain_calls_max(cfg: "AppConfig") -> int:
    """Envoy's calls in flight to one brain at most (its circuit breaker): with flow control, the calls it may hold
    count on top of brain_max_in_flight."""
    return cfg.envoy.brain_max_in_flight + (cfg.flow_control.max_requests if cfg.flow_control.enabled else 0)
