"""What a policy is, and the registry that builds one by name (config, simulator and tests alike).

A policy chooses among the fleet's pool and keeps its own state (pins, prefix index, rates). The
fleet (``Router``) owns replicas, health, drain, reservations and the atomicity of select + reserve;
it calls the policy inside that one synchronous call and never asks which concrete class it holds, nor
whether it has a capability: ``policy_base.Policy`` says what a policy must implement and gives every
optional one a default.
"""

from __future__ import annotations

from .config import RouterConfig
from .policy_base import Policy
from .seed import SEED_VARIANTS, SeedPolicy
from .warm import WARM_VARIANTS, WarmPolicy


PRODUCTION = ("warm", "seed")  # what a config names; the other entries are ablations for experiments
POLICIES: dict[str, tuple[type, dict]] = {
    **{name: (SeedPolicy, kw) for name, kw in SEED_VARIANTS.items()},
    **{name: (WarmPolicy, kw) for name, kw in WARM_VARIANTS.items()},
}


def make_policy(name: str, cfg: RouterConfig) -> Policy:
    try:
        cls, kw = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r} (known: {', '.join(POLICIES)})") from None
    return cls(cfg, name, **kw)
