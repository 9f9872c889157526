"""The config file's shape as JSON Schema, derived from the same dataclasses ``load`` checks against: the Helm chart's
``values.schema.json`` embeds it under ``config`` (``make docs`` writes it), so a misspelt key or a wrong type fails
at ``helm install`` with the field named rather than when the brain starts. It states types, enums and unknown
keys; the rules that relate fields (a TLS file without https, bounds beyond >= 0) stay ``parse_config``'s, which
the chart's tests run on every rendered config."""

from __future__ import annotations

import dataclasses
import types
import typing

from ..core.config import ROLES, DisaggregationConfig, HealthConfig, PinConfig, ProfileConfig, RouterConfig, WarmConfig
from ..core.policy import POLICIES
from .load import ROUTING_FIELDS, VLLM_HASH_ALGOS
from .schema import (DISCOVERY_SOURCES, ENGINES, PROTOCOLS, BrainConfig, DiscoveryConfig, EnvoyConfig,
                     ExactCacheConfig, FlowControlConfig, ReplicaSpec, SharedStateConfig)

# fields whose values are one of a few words (load.py checks the same lists)
ENUMS = {
    ("routing", "policy"): sorted(POLICIES),
    ("brain", "protocol"): list(PROTOCOLS),
    ("discovery", "source"): list(DISCOVERY_SOURCES),
    ("discovery", "engine"): list(ENGINES),
    ("discovery", "scheme"): ["http", "https"],
    ("replicas[]", "engine"): list(ENGINES),
    ("replicas[]", "role"): list(ROLES),
    ("envoy", "picker_body_mode"): ["buffered", "full-duplex"],
    ("exact_cache", "hash_algo"): list(VLLM_HASH_ALGOS),
}


def _type(tp) -> dict:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        t = _type(inner)
        return {"anyOf": [t, {"type": "null"}]}
    if origin is tuple:
        return {"type": "array", "items": {"type": "string", "minLength": 1}}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer", "minimum": 0}
    if tp is float:
        return {"type": "number", "minimum": 0}
    if tp is str:
        return {"type": "string", "minLength": 1}
    raise TypeError(f"no JSON Schema for {tp}")  # pragma: no cover - a new field type: add it here and in load


def _section(name: str, cls: type, only: set[str] | None = None, skip: set[str] = frozenset()) -> dict:
    hints = typing.get_type_hints(cls)
    props = {}
    for f in dataclasses.fields(cls):
        if (only is not None and f.name not in only) or f.name in skip:
            continue
        t = _type(hints[f.name])
        if (name, f.name) in ENUMS:
            t = {"enum": ENUMS[(name, f.name)]}
        props[f.name] = t
    return {"type": "object", "additionalProperties": False, "properties": props}


def _model_paths() -> dict:
    return {"type": "object", "additionalProperties": {"type": "string", "minLength": 1}}


def config_schema() -> dict:
    """The config file as JSON Schema (draft 2020-12)."""
    flow = _section("flow_control", FlowControlConfig, skip={"tenant_caps"})
    flow["properties"]["tenant_caps"] = {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}}
    replica = _section("replicas[]", ReplicaSpec, skip={"kv_events"})
    replica["required"] = ["name", "url"]
    endpoint = {"type": "string", "pattern": "^(tcp|ipc)://"}
    replica["properties"]["kv_events"] = {
        "type": "object", "additionalProperties": False, "required": ["endpoint"],
        "properties": {"endpoint": endpoint, "replay_endpoint": endpoint,
                       "data_parallel_size": {"type": "integer", "minimum": 1}}}
    exact = _section("exact_cache", ExactCacheConfig, skip={"tokenizers", "chat_templates"})
    exact["properties"] |= {"tokenizers": _model_paths(), "chat_templates": _model_paths()}
    target = {"type": "object", "additionalProperties": False, "required": ["model"],
              "properties": {"model": {"type": "string", "minLength": 1}, "weight": {"type": "number",
                                                                                     "exclusiveMinimum": 0}}}
    alias = {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "items": target}]}
    props = {
        "replicas": {"type": "array", "items": replica},
        "routing": _section("routing", RouterConfig, only=ROUTING_FIELDS),
        "health": _section("health", HealthConfig),
        "warm": _section("warm", WarmConfig),
        "pins": _section("pins", PinConfig),
        "profile": _section("profile", ProfileConfig),
        "brain": _section("brain", BrainConfig),
        "envoy": _section("envoy", EnvoyConfig),
        "discovery": _section("discovery", DiscoveryConfig),
        "shared_state": _section("shared_state", SharedStateConfig),
        "flow_control": flow,
        "disaggregation": _section("disaggregation", DisaggregationConfig),
        "exact_cache": exact,
        "models": {"type": "object", "additionalProperties": False,
                   "properties": {"aliases": {"type": "object", "additionalProperties": alias}}},
        "allow_no_replicas": {"type": "boolean"},
    }
    return {"type": "object", "additionalProperties": False, "properties": props,
            "description": "the brain's config file (docs/configuration.md)"}
