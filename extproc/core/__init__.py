"""The routing core: SPEC.md as a pure, deterministic library.

No I/O, no asyncio, no wall clock: every time-dependent call takes ``now``.
Nothing in this package imports from the rest of ``extproc``.
"""

from .blocks import BLOCK_CHARS, ChainCache, block_hashes, chain_seed
from .config import HealthConfig, PinConfig, ProfileConfig, RouterConfig, WarmConfig
from .decision import Decision, PinEvent, Reservation
from .load import LoadSample, Rates
from .policy import POLICIES, PRODUCTION, make_policy
from .prefix_index import PrefixIndex
from .names import BodyStatus, Cause, PinAction, PinKind, Reason
from .outcome import UpstreamOutcome, upstream_failed, upstream_verdicts
from .pins import PREFIX, SESSION, Pin, PinTable
from .profile import RequestProfile, build_profile, hash_key, system_prompt
from .replica import EJECTED, LIVE, PROBING, HealthMachine, Replica, State, Transition
from .stats import imbalance_index
from .router import AFFINITY, FALLBACK, LOAD, NO_HEALTHY, Router

__all__ = [
    "AFFINITY", "FALLBACK", "LOAD", "NO_HEALTHY", "PREFIX", "SESSION",
    "LIVE", "PROBING", "EJECTED", "State", "Transition",
    "BodyStatus", "Cause", "PinAction", "PinKind", "Reason",
    "UpstreamOutcome", "upstream_failed", "upstream_verdicts",
    "HealthConfig", "PinConfig", "ProfileConfig", "RouterConfig", "WarmConfig",
    "BLOCK_CHARS", "ChainCache", "block_hashes", "chain_seed", "PrefixIndex", "LoadSample", "Rates",
    "POLICIES", "PRODUCTION", "make_policy",
    "HealthMachine", "Replica", "Pin", "PinTable",
    "RequestProfile", "build_profile", "hash_key", "system_prompt",
    "Decision", "PinEvent", "Reservation", "Router", "imbalance_index",
]
