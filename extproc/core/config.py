"""Routing parameters. Every default is a number from SPEC.md (section noted).

The core never reads files: the shell turns the YAML file into these
dataclasses (see ``extproc.config``) and hands them over.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class HealthConfig:
    scrape_interval_s: float = 3.0  # A1: every replica's /metrics (or /health) is read this often for health
    good_scrapes_to_probe: int = 2  # A2: good scrapes in a row (after any cooldown) that take EJECTED to PROBING
    probing_clean_window_s: float = 15.0  # A2: seconds of clean scrapes that take PROBING to LIVE
    cooldown_base_s: float = 30.0  # A2: the n-th ejection in a row keeps a replica out for base x 2^(n-1) s
    cooldown_max_s: float = 300.0  # A2: the ceiling of that cooldown (a replica at it flaps: an alert fires)
    streak_reset_live_s: float = 600.0  # A2: streak resets after 600 s of continuous LIVE
    # B: a scrape older than 3 intervals counts as failed; a LIVE replica's health scrape waits for its answer until
    # then (a busy engine's late /metrics is not a failure)
    stale_scrape_intervals: float = 3.0
    upstream_failures_to_eject: int = 3  # B: N consecutive upstream failures eject a LIVE replica
    # At most this % of the fleet (and at least one replica) may be EJECTED by users' requests' outcomes at once,
    # as Envoy's outlier detection bounds it (max_ejection_percent); scrapes eject whatever they find dead
    max_passive_ejection_percent: float = 25.0
    # A replica's /metrics larger than this is a failed scrape, read no further (vLLM's is tens to hundreds of KiB)
    max_metrics_bytes: int = 4 * 1024 * 1024
    # What a /metrics may cost past its bytes: series (sample lines) and data-parallel engines (values of the engine
    # label). One replica exporting 90,000 engines in 3.9 MB stalled the event loop 4.2 s and ejected the healthy
    # fleet. vLLM 0.32 exports ~500 lines with two engines; a front end with 128 engines ~30,000. Past either the
    # scrape fails and says which, and that replica alone is ejected
    max_metrics_series: int = 100_000  # sample lines (comments aside) a /metrics may have
    max_engines: int = 128  # data-parallel engines (engine / dp_rank label values) one replica may name

    def cooldown_s(self, streak: int) -> float:
        """Cooldown for the ``streak``-th ejection in a row (A2): 30, 60, 120, 240, 300, 300..."""
        if streak <= 0:
            return 0.0
        # min() before the power keeps a long streak from building a huge float
        return min(self.cooldown_max_s, self.cooldown_base_s * 2 ** min(streak - 1, 62))


@dataclass(frozen=True, slots=True)
class PinConfig:
    session_ttl_s: float = 3600.0  # A3: session pins live 60 min idle
    prefix_ttl_s: float = 300.0  # A3: prefix pins live 5 min idle
    # A3: a session pin is used while its replica is within this many requests of the least loaded
    session_slack: int = 1
    prefix_slack: int = 0  # A3: the same slack for prefix (system prompt) pins
    session_spills_to_rebind: int = 3  # A3: 3 spills in a row -> the session pin moves
    prefix_spills_to_delete: int = 2  # B: the second consecutive prefix spill deletes it
    force_rebind_gap: float = 3.0  # A3: effective_running(pin) - min_r >= 3 -> move at once
    # At most this many pins of each kind (~250 bytes each): past it the least recently used one goes, counted in
    # warmroute_pin_evictions_total. A client inventing a session per request cannot grow the brain within the TTL
    max_pins: int = 500_000


TENANT_SOURCES = ("header", "credential", "none")
CREDENTIAL_HEADER = "authorization"  # tenant_source "credential": the API key (a hash of it) is the tenant


@dataclass(frozen=True, slots=True)
class ProfileConfig:
    # A3: request headers that name the session, first present wins
    session_headers: tuple[str, ...] = ("x-session-id", "x-kilo-session", "x-conversation-id")
    # A3: body fields that name the session when no header does (top level, then under "metadata"); in a body too big
    # for the brain (envoy.brain_body_max_bytes) Envoy reads them
    session_body_fields: tuple[str, ...] = ("conversation_id", "thread_id")
    # A3: the seed's project_id: a header only a trusted filter or proxy sets
    tenant_header: str | None = "x-warmroute-tenant"
    # Where the tenant comes from (docs/guide.md "Tenants"): "header" = tenant_header, which Envoy strips from what
    # clients send (only the operator's own auth filter, or a trusted proxy, sets it); "credential" = a hash of
    # the Authorization header (an API key is a tenant); "none" = one tenant.
    tenant_source: str = "header"
    # a request header that names the model (e.g. x-gateway-model-name, which a gateway's body-based router sets): in
    # a fleet of several models, a turn of a session under way that names its model so is decided at its headers (the
    # header path); null: only a fleet of one model decides turns at their headers
    model_header: str | None = None
    prefix_chars: int = 4096  # A3: MD5 of the first 4096 characters of the system prompt
    chars_per_token: float = 4.0  # B: prompt tokens are estimated as characters / this
    max_body_bytes: int = 64 * 1024 * 1024  # B: larger bodies are not read at all: routed by headers only
    # A request's prompt is estimated at no more than this many tokens, whatever its body or Content-Length says:
    # no model takes more (the brain lowers it to the largest max_model_len the replicas list), and an estimate
    # from a declared size alone must never price a replica as busy for hours
    max_prompt_tokens: int = 1_048_576
    # Bodies up to this size are parsed as JSON for body keys; larger ones are read as bytes only (session
    # from headers, tokens from the size, block chain from the raw text), so no request holds the event
    # loop for a long parse (a 32 MiB parse takes over 100 ms). None: the policy's own (seed: every body up
    # to max_body_bytes, as B says; warm: 256 KiB, since it needs no key that only a parse gives). Bodies above
    # envoy.brain_body_max_bytes (2 MiB) never reach the brain whole: headers and size only, for either policy.
    parse_max_bytes: int | None = None
    block_chars: int = 64  # C2: ~16 tokens at 4 characters a token, vLLM's block size
    # C2: the chain covers at most this much of the conversation: ~262K tokens, more than a long-context model
    # holds, and what one request can hash in about a millisecond
    chain_max_bytes: int = 1024 * 1024
    # ...of which one request hashes and indexes at most this much that is new (~0.5 ms): a longer conversation seen
    # for the first time is indexed over its next turns, and no single request holds the event loop for long
    chain_step_bytes: int = 256 * 1024

    def tenant_reads(self) -> str | None:
        """The request header the tenant is read from, if any."""
        if self.tenant_source == "credential":
            return CREDENTIAL_HEADER
        return self.tenant_header if self.tenant_source == "header" else None


@dataclass(frozen=True, slots=True)
class WarmConfig:
    """The cost-based policy (SPEC C). Rates are learned from each replica's metrics; these are used until then."""

    cache_tokens: int = 300_000  # C2: a replica's prefix cache until it exports vllm:cache_config_info
    prefill_tokens_per_s: float = 5_000.0  # C3: a replica's prefill rate until learned from its counters
    decode_s_per_token: float = 0.03  # C3: a replica's decode time per token until learned from its counters
    output_tokens: float = 256.0  # C3: mean generated tokens per request, until learned
    rate_fresh_s: float = 60.0  # C3: a replica's learned rate counts this long after its last sample
    balance_factor: float = 1.5  # C5: in-flight work above c x the mean is priced as waiting (c 1.25-1.5)
    hard_bound_factor: float = 2.0  # C5: a replica with more than this x the bound takes no request at all
    load_refresh_s: float = 0.5  # C6: load signals refreshed this often (health keeps its 3 s)
    decode_weight: float = 1.0  # C3: weight of the decode slow-down against time to first token
    kv_pressure: float = 0.95  # C3: past this KV usage a request risks preemption
    evict_start: float = 0.6  # C3: above this share of the cache, active sessions start evicting each other
    # a session that sent a turn this recently will be back: its context stays (sooner gone once quiet for twice the
    # p99 of the gaps between turns the fleet's sessions showed)
    active_session_s: float = 60.0
    arrival_window_s: float = 60.0  # C3: a replica's arrival rate (what queues behind a prefill) is counted over this
    busy_wait_s: float = 1.0  # C3: when the candidates wait this long on average, the fleet has no idle capacity
    # A replica that exports several data-parallel engines (vLLM --data-parallel-size, SGLang --dp) is priced
    # engine by engine, each its own cache and queue. true: the chosen engine is named in the request's
    # X-data-parallel-rank header, which vLLM (0.10+) and SGLang honour. false: the engine is the front end's
    # choice (vLLM: the least waiting x 4 + running), which the brain predicts from the last scrape
    steer_data_parallel: bool = True
    # C3: seconds a replica takes to bring a LoRA adapter into a GPU slot (vLLM: from its CPU cache or disk). A
    # request for an adapter prices it where the adapter is not in a slot, and more where every slot is in use;
    # the load stalls the replica's batch, so it is priced again for each request in flight there
    lora_load_s: float = 0.5
    # C2: the media besides the GPU whose blocks a hit may be restored from (an offloading connector's KV events name
    # each block's medium: vLLM's OffloadingConnector CPU, LMCache CPU or STORAGE). A prefix past the GPU's hit that a
    # listed tier holds on the same instance is priced as its restore, never above computing it; another medium, or a
    # tier on another instance, counts as nothing. []: tier-blind (what is offloaded is priced as computed)
    offload_tiers: tuple[str, ...] = ("CPU",)
    # C3: a restored token's time as a share of computing it there, until the replica's own counters time its
    # restores (vllm:kv_offload_load_time over the tokens it loaded). More cautious than the peers' weights (llm-d
    # counts a CPU block 0.8 of a GPU one, Dynamo 0.75: a restore at 20-25% of a recompute), at the low end of what
    # restores save when measured (45-88% of the prefill they replace, more for long prefixes)
    restore_cost_prior: float = 0.5


ROLES = ("both", "prefill", "decode")  # what a replica serves in a disaggregated fleet (llm-d.ai/role's values)


@dataclass(frozen=True, slots=True)
class DisaggregationConfig:
    """Prefill/decode disaggregation (docs/routing.md "Prefill/decode disaggregation"): with replicas of
    role prefill in a model's pool, a request's prefill goes to one of them when the cost model says it pays."""

    enabled: bool = True  # false: never disaggregate (replicas of role prefill then take no traffic)
    # KV moved between replicas, prompt tokens a second, until learned from the decode legs' first tokens. Low on
    # purpose: a slow transfer priced as fast sends prefills away that should have stayed
    transfer_tokens_per_s: float = 20_000.0
    # the prefill leg's time box: past it the decode replica computes the prompt itself (vLLM's decode side gives a
    # KV load 30 s, VLLM_NIXL_ABORT_REQUEST_TIMEOUT's role)
    prefill_timeout_s: float = 30.0
    # the longest prompt one transfer may carry (null: any). vLLM 0.32's ExampleConnector kills the decode engine
    # on a prompt longer than its --max-num-batched-tokens: set it to that there
    max_transfer_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class RouterConfig:
    health: HealthConfig = field(default_factory=HealthConfig)
    pins: PinConfig = field(default_factory=PinConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    warm: WarmConfig = field(default_factory=WarmConfig)
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)
    policy: str = "warm"  # C8: which policy chooses: warm, seed, or an ablation (docs/routing.md)
    token_weight_unit: int = 1000  # B: weight = max(1, prompt_tokens_estimate / 1000)
    probing_max_in_flight: int = 1  # B: a PROBING replica holds at most 1 request while a LIVE one exists
    reservation_timeout_s: float = 3600.0  # B: safety release of reservations whose end was never seen
    seed: int = 0  # the fallback's random choice is seeded so runs replay exactly
