"""What a policy is, and the registry that builds one by name (config, simulator and tests alike).

A policy chooses among the fleet's pool and keeps its own state (pins, prefix index, rates). The
fleet (``Router``) owns replicas, health, drain, reservations and the atomicity of select + reserve;
it calls the policy inside that one synchronous call and never asks which concrete class it holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from .config import RouterConfig
from .seed import SEED_VARIANTS, SeedPolicy
from .warm import WARM_VARIANTS, WarmPolicy

if TYPE_CHECKING:
    from .decision import Decision, Reservation
    from .load import LoadSample
    from .pins import PinTable
    from .prefix_index import PrefixIndex
    from .profile import RequestProfile
    from .replica import Replica


class Policy(Protocol):
    name: str
    needs_blocks: bool  # the profile computes the request's block chain only for policies that read it
    parse_max_bytes: int | None  # bodies above it are not parsed as JSON (None: up to profile.max_body_bytes)
    session_pins: "PinTable"

    def select(self, fleet, profile: "RequestProfile", now: float) -> "Decision | None":
        """A replica from ``fleet.pool()`` (None: the pool is empty, the fleet falls back)."""

    def on_reserved(self, d: "Decision", profile: "RequestProfile", now: float) -> None: ...
    def on_release(self, res: "Reservation", now: float) -> None: ...
    def on_arrived(self, res: "Reservation", now: float) -> None:
        """The body of a request decided while it was still arriving (``RequestProfile.deferred``) has arrived:
        its work is booked now (an upload held open never reaches an engine, and costs nothing until then)."""
    def on_remote_reserved(self, res: "Reservation", prefill_s: float, prompt_tokens: int,
                           session_key: bytes | None, prompt: int, at: float, now: float,
                           estimated: int | None = None, shared: tuple[int, int] | None = None) -> None:
        """Another brain's reservation (shared state), booked like ``on_reserved``; ``shared``: the prefix it
        found cached there (its last block hash, its tokens), as the working set counts it."""
    def index_of(self, r: "Replica", engine: int | None) -> "PrefixIndex | None": ...
    def kv_tokens(self, r: "Replica", engine: int | None) -> int | None:
        """The tokens of KV the replica (or engine) holds, as the policy sees it (None: it keeps no such view):
        no brain's requests can claim more pending there."""
    def on_load(self, r: "Replica", s: "LoadSample", now: float) -> None: ...
    def on_health(self, r: "Replica", ejected: bool) -> None: ...
    def configure(self, r: "Replica") -> None: ...
    def forget(self, name: str) -> None: ...
    def update_config(self, cfg: RouterConfig) -> None: ...
    def expire(self, now: float) -> None: ...
    def pin_tables(self) -> "tuple[PinTable, ...]": ...


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
