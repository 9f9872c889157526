"""Reading the config: YAML bounded in size and aliases, every field checked, one line naming the field when it
is wrong."""

from __future__ import annotations

import dataclasses
import re
import reprlib
import types
import typing
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from ..contract import RESERVED_NAME_PREFIX
from ..core.config import (ROLES, DisaggregationConfig, HealthConfig, PinConfig, ProfileConfig, RouterConfig,
                           TENANT_SOURCES, WarmConfig)
from ..core.models import MAX_PATH_CHARS, Target
from ..core.policy import POLICIES, PRODUCTION
from .schema import (
    AppConfig,
    BrainConfig,
    ConfigError,
    DISCOVERY_SOURCES,
    DiscoveryConfig,
    ENGINES,
    EnvoyConfig,
    ExactCacheConfig,
    FlowControlConfig,
    PROTOCOLS,
    ReplicaSpec,
    SharedStateConfig,
)


_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


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


_SECTIONS = {"health": HealthConfig, "pins": PinConfig, "profile": ProfileConfig, "warm": WarmConfig,
             "disaggregation": DisaggregationConfig}


# RouterConfig's own scalar fields live under "routing:".
ROUTING_FIELDS = {f.name for f in dataclasses.fields(RouterConfig)} - set(_SECTIONS)


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
        known = {"name", "url", "engine", "tls_ca_file", "tls_sni", "tls_cert_file", "tls_key_file", "models", "paths",
                 "role", "kv_events"}
        extra = set(item) - known
        if extra:
            raise ConfigError(f"{where}.{sorted(extra)[0]}: unknown field (known: {', '.join(sorted(known))})")
        tls = {k: item[k] for k in known - {"name", "url", "engine", "models", "paths", "role", "kv_events"}
               if item.get(k) is not None}
        role = item.get("role", "both")
        if role not in ROLES:
            raise ConfigError(f"{where}.role: expected one of {', '.join(ROLES)}, got {_short(role)}")
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
            _ = parts.port  # urllib checks the port only when asked
        except ValueError:
            raise ConfigError(f"{where}.url: bad port in {_short(url)}") from None
        kv_events = _kv_events(f"{where}.kv_events", item.get("kv_events"), parts.hostname)
        out.append(ReplicaSpec(name, url.rstrip("/"), engine, **tls, models=tuple(models), paths=tuple(paths),
                               role=role, kv_events=kv_events))
    return tuple(out)


MAX_DATA_PARALLEL = 128  # as the brain's event readers bound a replica's ranks (brain/kv_events.py MAX_RANKS)


def _kv_endpoint(where: str, value: Any, host: str, rank: int) -> str:
    """A ZeroMQ endpoint as vLLM's --kv-events-config names it, for data-parallel rank ``rank``: its port offset by the
    rank as vLLM offsets it; a wildcard host (vLLM's bind address, pasted) is the replica's own."""
    text = value if isinstance(value, str) else ""
    scheme, _, rest = text.partition("://")
    if scheme == "ipc" and rest.startswith("/") and 1 < len(rest) < 108:
        if rank:
            raise ConfigError(f"{where}: vLLM offsets only tcp:// endpoints by data-parallel rank; use tcp:// with "
                              "data_parallel_size > 1")
        return text
    addr, _, port = rest.rpartition(":")
    if scheme != "tcp" or not addr or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536 - rank:
        raise ConfigError(f"{where}: expected tcp://host:port or ipc:///path as vLLM's --kv-events-config names it, "
                          f"got {_short(value)}")
    if addr.strip("[]") in ("*", "0.0.0.0", "::"):
        addr = f"[{host}]" if ":" in host else host
    return f"tcp://{addr}:{int(port) + rank}"


def _kv_events(where: str, raw: Any, host: str) -> tuple[tuple[str, str | None], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, dict) or "endpoint" not in raw:
        raise ConfigError(f"{where}: expected a mapping with endpoint (and replay_endpoint, data_parallel_size), "
                          f"got {_short(raw)}")
    extra = set(raw) - {"endpoint", "replay_endpoint", "data_parallel_size"}
    if extra:
        raise ConfigError(f"{where}.{sorted(extra)[0]}: unknown field (known: data_parallel_size, endpoint, "
                          "replay_endpoint)")
    ranks = raw.get("data_parallel_size", 1)
    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= MAX_DATA_PARALLEL:
        raise ConfigError(f"{where}.data_parallel_size: expected a whole number from 1 to {MAX_DATA_PARALLEL}, "
                          f"got {_short(ranks)}")
    replay = raw.get("replay_endpoint")
    return tuple((_kv_endpoint(f"{where}.endpoint", raw["endpoint"], host, k),
                  None if replay is None else _kv_endpoint(f"{where}.replay_endpoint", replay, host, k))
                 for k in range(ranks))


_LOOPBACK = ("127.", "localhost", "::1")


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
        raise ConfigError("envoy.brain_tls_cert_file: the brain asks for a client certificate "
                          "(brain.tls_client_ca_file)"
                          "; give Envoy one")


def parse_config(doc: Any, source: str = "<dict>") -> AppConfig:
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    known = {"replicas", "routing", "brain", "envoy", "discovery", "models", "allow_no_replicas", "shared_state",
             "flow_control", "exact_cache", *_SECTIONS}
    for key in doc:
        if key not in known:
            raise ConfigError(f"{key}: unknown section (known: {', '.join(sorted(known))})")
    kwargs: dict[str, Any] = {}
    for section, cls in _SECTIONS.items():
        kwargs[section] = cls(**_fill(section, cls, doc.get(section)))
    kwargs.update(_fill("routing", RouterConfig, doc.get("routing"), ROUTING_FIELDS))
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
    if not router.warm.balance_factor >= 1.0:
        raise ConfigError("warm.balance_factor: expected a number >= 1 (1.25-1.5 is typical)")
    if not 0.0 < router.warm.kv_pressure <= 1.0:
        raise ConfigError("warm.kv_pressure: expected a number in (0, 1]")
    if not 0.0 < router.warm.restore_cost_prior <= 1.0:
        raise ConfigError("warm.restore_cost_prior: expected a number in (0, 1] (a restore's share of a recompute)")
    for tier in router.warm.offload_tiers:
        if tier.upper() == "GPU" or len(tier) > 32:
            raise ConfigError(f"warm.offload_tiers: expected media besides the GPU (CPU, STORAGE), got {_short(tier)}")
    if any(t != t.upper() for t in router.warm.offload_tiers):
        router = dataclasses.replace(router, warm=dataclasses.replace(
            router.warm, offload_tiers=tuple(t.upper() for t in router.warm.offload_tiers)))
    for f in ("prefill_tokens_per_s", "decode_s_per_token", "load_refresh_s", "cache_tokens", "arrival_window_s",
              "busy_wait_s"):
        if getattr(router.warm, f) <= 0:
            raise ConfigError(f"warm.{f}: expected a number > 0")
    pd = router.disaggregation
    for f in ("transfer_tokens_per_s", "prefill_timeout_s"):
        if getattr(pd, f) <= 0:
            raise ConfigError(f"disaggregation.{f}: expected a number > 0")
    if pd.max_transfer_tokens is not None and pd.max_transfer_tokens < 1:
        raise ConfigError("disaggregation.max_transfer_tokens: expected a whole number >= 1, or null")
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
    mh = router.profile.model_header
    if mh is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9-]*", mh):
        raise ConfigError(f"profile.model_header: expected a header name, got {_short(mh)}")
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
        raise ConfigError(f"envoy.picker_body_mode: expected buffered or full-duplex, got "
                          f"{_short(envoy.picker_body_mode)}")
    for field_ in ("brain_endpoints", "brain_failover"):
        for i, ep in enumerate(getattr(envoy, field_)):
            host, _, port = ep.rpartition(":")
            if not (ep.startswith("unix:/") or (is_ip(host.strip("[]")) and port.isdigit() and 0 < int(port) < 65536)):
                raise ConfigError(f"envoy.{field_}[{i}]: expected unix:/path.sock or ip:port, got {_short(ep)}")
    if brain.protocol not in PROTOCOLS:
        raise ConfigError(f"brain.protocol: expected one of {', '.join(PROTOCOLS)}, got {_short(brain.protocol)}")
    discovery = _discovery(doc.get("discovery"))
    replicas = _replicas(doc.get("replicas"))
    if brain.protocol == "endpoint-picker" and discovery.source == "static":
        for i, r in enumerate(replicas):
            if not is_ip(r.host):
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
                     allow, exact_cache=_exact_cache(doc.get("exact_cache")))


VLLM_HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


def _exact_cache(raw: Any) -> ExactCacheConfig:
    raw = dict(raw) if isinstance(raw, dict) else raw
    tokenizers = raw.pop("tokenizers", None) if isinstance(raw, dict) else None
    templates = raw.pop("chat_templates", None) if isinstance(raw, dict) else None
    c = ExactCacheConfig(**_fill("exact_cache", ExactCacheConfig, raw, {"enabled", "hash_seed", "hash_algo",
                                                                           "max_body_bytes", "tokenizers",
                                                                           "chat_templates", "inline_chars"}))
    if c.hash_algo not in VLLM_HASH_ALGOS:
        raise ConfigError(f"exact_cache.hash_algo: expected one of vLLM's {', '.join(VLLM_HASH_ALGOS)}, got "
                          f"{_short(c.hash_algo)}")
    if c.max_body_bytes < 1:
        raise ConfigError("exact_cache.max_body_bytes: expected a whole number >= 1")
    if c.inline_chars < 0:
        raise ConfigError("exact_cache.inline_chars: expected a whole number >= 0")
    pairs = _model_paths("tokenizers", tokenizers, "the model's directory", lambda p: (p / "tokenizer.json").is_file(),
                         "no tokenizer.json in")
    files = _model_paths("chat_templates", templates, "the template file", Path.is_file, "no such file:")
    return dataclasses.replace(c, tokenizers=pairs, chat_templates=files)


def _model_paths(field: str, raw: Any, what: str, ok, missing: str) -> tuple[tuple[str, str], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise ConfigError(f"exact_cache.{field}: expected a mapping of served model name to {what}")
    pairs = []
    for model, path in raw.items():
        if not isinstance(model, str) or not isinstance(path, str) or not path:
            raise ConfigError(f"exact_cache.{field}.{_short(str(model))}: expected {what} as a string")
        if not ok(Path(path)):
            raise ConfigError(f"exact_cache.{field}.{model}: {missing} {_short(path)}")
        pairs.append((model, path))
    return tuple(pairs)


def _flow_control(raw: Any) -> FlowControlConfig:
    raw = dict(raw) if isinstance(raw, dict) else raw
    caps = raw.pop("tenant_caps", None) if isinstance(raw, dict) else None
    c = FlowControlConfig(**_fill("flow_control", FlowControlConfig, raw))
    if caps is not None:
        if not isinstance(caps, dict):
            raise ConfigError(f"flow_control.tenant_caps: expected a mapping of tenant name to tokens a minute, got "
                              f"{_short(caps)}")
        pairs = []
        for name, rate in caps.items():
            if not isinstance(name, str) or not name or isinstance(rate, bool) or not isinstance(rate, int) or rate < 0:
                raise ConfigError(f"flow_control.tenant_caps.{_short(str(name))}: expected a whole number of tokens a "
                                  f"minute >= 0, got {_short(rate)}")
            pairs.append((name, rate))
        c = dataclasses.replace(c, tenant_caps=tuple(pairs))
    if c.tenant_tokens_per_minute < 0:
        raise ConfigError("flow_control.tenant_tokens_per_minute: expected a whole number >= 0 (0: no cap)")
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
            raise ConfigError(f"{where}: expected a served model name or a list of {{model, weight}}, got "
                              f"{_short(value)}")
        targets = []
        for i, t in enumerate(value):
            if not isinstance(t, dict) or set(t) - {"model", "weight"} or not isinstance(t.get("model"), str) \
                    or not t["model"]:
                raise ConfigError(f"{where}[{i}]: expected {{model: <served name>, weight: <number > 0>}}, got "
                                  f"{_short(t)}")
            w = t.get("weight", 1)
            if isinstance(w, bool) or not isinstance(w, (int, float)) or w <= 0:
                raise ConfigError(f"{where}[{i}].weight: expected a number > 0, got {_short(w)}")
            targets.append(Target(t["model"], float(w)))
        out.append((alias, tuple(targets)))
    return tuple(out)


def is_ip(host: str) -> bool:
    """A literal IPv4 or IPv6 address (not a name to resolve)."""
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
        if not is_ip(host or s) or (port and not (port.isdigit() and 0 < int(port) <= 65535)):
            raise ConfigError(f"discovery.dns_servers[{i}]: expected an IP address or ip:port, got {_short(s)}")
    for f in ("kv_events_port", "kv_events_replay_port"):
        v = getattr(d, f)
        if v is not None and not 0 < v < 65536 - d.kv_events_data_parallel_size:
            raise ConfigError(f"discovery.{f}: expected a port number 1..65535 (and room for every data-parallel "
                              f"rank's), got {v}")
    if not 1 <= d.kv_events_data_parallel_size <= MAX_DATA_PARALLEL:
        raise ConfigError(f"discovery.kv_events_data_parallel_size: expected a whole number from 1 to "
                          f"{MAX_DATA_PARALLEL}, got {d.kv_events_data_parallel_size}")
    if d.kv_events_replay_port is not None and d.kv_events_port is None:
        raise ConfigError("discovery.kv_events_replay_port: a replay socket goes with a publisher: set "
                          "kv_events_port too")
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
