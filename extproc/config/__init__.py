"""The one YAML config file: replicas, key sources, TTLs and thresholds.

Every default is SPEC.md's number (they live in ``extproc.core.config``). ``schema``: the sections as dataclasses,
whose comments are the reference (``make docs`` writes docs/configuration.md from them); ``load``: reading a
file, where a bad one raises ``ConfigError`` whose message is one line naming the field, e.g.
``pins.session_ttl_s: expected a number >= 0, got 'soon'``.
"""

from __future__ import annotations

from ..core.config import HealthConfig, PinConfig, ProfileConfig, RouterConfig, WarmConfig
from .load import (MAX_ALIASES, MAX_CONFIG_BYTES, check_brain_access, is_ip, is_loopback, load_config,
                   parse_config)
from .schema import (
    DISCOVERY_SOURCES,
    ENGINES,
    FLOW_FIRST_ANSWER_S,
    PROTOCOLS,
    AppConfig,
    BrainConfig,
    ConfigError,
    DiscoveryConfig,
    EnvoyConfig,
    ExactCacheConfig,
    FlowControlConfig,
    ReplicaSpec,
    SharedStateConfig,
    brain_calls_max,
    first_answer_s,
    held_s,
    legs_s,
    max_message_s,
)

__all__ = [
    "DISCOVERY_SOURCES", "ENGINES", "FLOW_FIRST_ANSWER_S", "MAX_ALIASES", "MAX_CONFIG_BYTES", "PROTOCOLS", "AppConfig",
    "BrainConfig", "ConfigError", "DiscoveryConfig", "EnvoyConfig", "ExactCacheConfig", "FlowControlConfig",
    "HealthConfig", "PinConfig",
    "ProfileConfig", "ReplicaSpec", "RouterConfig", "SharedStateConfig", "WarmConfig", "brain_calls_max",
    "check_brain_access", "first_answer_s", "held_s", "legs_s", "max_message_s", "is_ip", "is_loopback", "load_config",
    "parse_config",
]
