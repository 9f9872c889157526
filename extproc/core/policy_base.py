"""What a policy must and may implement: the contract the fleet (``Router``) and the shell keep.

A policy chooses among the fleet's pool and keeps its own state (pins, prefix index, rates); the fleet calls it
inside one synchronous call and never asks which concrete class it holds. Every capability a policy may lack has a
default here that does nothing (or says "none"), so that no caller probes a policy for a name: a policy overrides
what it keeps. Required: ``select`` and the bookkeeping hooks below it; ``name``, ``needs_blocks``,
``parse_max_bytes`` and ``session_pins`` as attributes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .names import Hold
from .pins import PREFIX, PinTable

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from .config import RouterConfig
    from .decision import Decision, FleetView, Reservation
    from .disaggregation import PrefillPlan, TransferRate
    from .engine_cache import EngineCache
    from .load import LoadSample
    from .prefix_index import PrefixIndex
    from .profile import RequestProfile
    from .replica import Replica
    from .shared import Outbox

_NO_PINS = PinTable(PREFIX, 0.0)


class Policy:
    name: str
    needs_blocks: bool  # the profile computes the request's block chain only for policies that read it
    parse_max_bytes: int | None  # bodies above it are not parsed as JSON (None: up to profile.max_body_bytes)
    session_pins: PinTable
    # the router's Outbox while shared state is on: what the policy changes beyond pins and reservations (its
    # index) goes out through it
    outbox: "Outbox | None" = None
    # the learned KV transfer rate (prefill/decode disaggregation), if the policy learns one
    transfer: "TransferRate | None" = None
    prefix_pins: PinTable = _NO_PINS  # a policy without prefix pins: an empty table nobody writes
    # a turn of a session under way may be decided at its request headers (a profile with ``header_path``): the
    # policy keeps it on its home or answers Reason.READ_BODY; a policy that cannot is always asked with the body
    decides_at_headers: bool = False

    # ------------------------------------------------------------------ required

    def select(self, fleet: "FleetView", profile: "RequestProfile", now: float,
               hold: Hold = Hold.NEVER) -> "Decision | None":
        """A replica from ``fleet.pool()`` (None: the pool is empty, the fleet falls back). ``hold``: flow control's
        word; a policy that may hold answers Reason.HELD with what its wait is estimated from (``Decision.drain_tps``,
        ``free_at``), nothing booked; one that never holds ignores it. What the policy priced for the decision it may
        keep in ``Decision.booking``, which the fleet hands back in ``on_reserved`` and ``plan_prefill``."""
        raise NotImplementedError

    def on_reserved(self, d: "Decision", profile: "RequestProfile", now: float) -> None:
        """``d`` was reserved (``d.reservation``): the policy books it (its own books go in ``Reservation.booking``,
        handed back in ``on_release``)."""
        raise NotImplementedError

    def on_release(self, res: "Reservation", now: float) -> None:
        raise NotImplementedError

    def on_remote_reserved(self, res: "Reservation", prefill_s: float, prompt_tokens: int,
                           session_key: bytes | None, prompt: int, at: float, now: float,
                           estimated: int | None = None, shared: tuple[int, int] | None = None) -> None:
        """Another brain's reservation (shared state), booked like ``on_reserved``; ``shared``: the prefix it
        found cached there (its last block hash, its tokens), as the working set counts it."""
        raise NotImplementedError

    def on_load(self, r: "Replica", s: "LoadSample", now: float) -> None:
        raise NotImplementedError

    def on_health(self, r: "Replica", ejected: bool) -> None:
        raise NotImplementedError

    def configure(self, r: "Replica") -> None:
        raise NotImplementedError

    def forget(self, name: str) -> None:
        raise NotImplementedError

    def update_config(self, cfg: "RouterConfig") -> None:
        raise NotImplementedError

    def expire(self, now: float) -> None:
        raise NotImplementedError

    def pin_tables(self) -> "tuple[PinTable, ...]":
        raise NotImplementedError

    # ------------------------------------------------------------------ optional, with what lacking them means

    def on_arrived(self, res: "Reservation", now: float) -> None:
        """The body of a request decided while it was still arriving (``RequestProfile.deferred``) has arrived:
        its work is booked now (an upload held open never reaches an engine, and costs nothing until then)."""

    def index_of(self, r: "Replica", engine: int | None) -> "PrefixIndex | None":
        return None  # no prefix index: another brain's chains are not kept

    def kv_tokens(self, r: "Replica", engine: int | None) -> int | None:
        """The tokens of KV the replica (or engine) holds, as the policy sees it (None: it keeps no such view):
        no brain's requests can claim more pending there."""
        return None

    def engine_count(self, name: str) -> int:
        """The data-parallel engines the policy prices on replica ``name`` apart (0: it does not tell them apart)."""
        return 0

    def engine_state(self, name: str, engine: int | None):
        """The policy's state of one engine, which holds its ``EngineCache`` (None: it keeps none)."""
        return None

    def engines_view(self, name: str) -> list[dict] | None:
        return None

    def replica_view(self, r: "Replica", now: float) -> dict[str, float] | None:
        """What the policy believes of a replica, for metrics and /state (None: nothing of its own)."""
        return None

    def returning_share(self) -> float | None:
        """What a new session's first turn counts at in the working sets flow control protects (the learned share of
        new sessions that came back), for /state (None: the policy keeps no working set)."""
        return None

    def caches_reset(self, name: str, now: float) -> None:
        """Replica ``name``'s engines emptied their prefix caches (an operator's word)."""

    def plan_prefill(self, d: "Decision", prefills: "list[Replica]", profile: "RequestProfile",
                     now: float) -> "PrefillPlan | None":
        return None  # never sends a prefill elsewhere

    def on_prefill_reserved(self, d: "Decision", profile: "RequestProfile", now: float) -> None:
        """A prefill leg ``plan_prefill`` planned was reserved on its replica."""

    def on_transfer(self, tokens: int, seconds: float) -> None:
        """A decode leg loaded ``tokens`` of KV in ``seconds`` (what a transfer rate is learned from)."""

    def expected_output(self, r: "Replica") -> float:
        """The tokens a request's answer is expected to run to on ``r`` (a tenant's cap counts them when it is
        placed): 0 for a policy that learns none."""
        return 0.0

    def on_prefill_ended(self, res: "Reservation", now: float) -> None:
        """The request ``res`` booked has had its first token, and runs on: its prefill is over (what was booked for
        it may be given back before its end)."""

    def on_first_token(self, res: "Reservation", observed_s: float, now: float) -> None:
        """The request ``res`` booked had its first token ``observed_s`` after it was sent, as its front saw it (a
        streamed response's first body byte): what predictions are checked and corrected by."""

    # ------------------------------------------------------------------ the engines' own word (exact mode)

    def apply_events(self, name: str, rank: int, events: list, now: float,
                     make: "Callable[[], EngineCache]") -> bool:
        """One batch of engine ``rank``'s KV events on replica ``name``: they become that engine's ``EngineCache``
        (which the warm policy prices a request against once it is exact). False when the policy keeps no such
        engine (the seed's keeps none: it takes no events)."""
        st = self.engine_state(name, rank)
        if st is None:
            return False
        if st.exact is None:
            st.exact = make()
        st.exact.apply(events, now)
        return True

    def events_lost(self, name: str, rank: int, why: str) -> None:
        st = self.engine_state(name, rank)
        if st is not None and st.exact is not None:
            st.exact.lost(why)

    def _exact_caches(self, name: str) -> "Iterator[tuple[int, EngineCache]]":
        for rank in range(max(1, self.engine_count(name))):
            st = self.engine_state(name, rank)
            if st is not None and st.exact is not None:
                yield rank, st.exact

    def exact_view(self, name: str) -> list[dict] | None:
        """Each engine's cache of replica ``name`` as its events say (/state), None when none of them sent any."""
        return [{"rank": rank, **ex.view()} for rank, ex in self._exact_caches(name)] or None

    def cached_on(self, name: str, hashes: tuple[int, tuple[int, ...]] | None) -> int | None:
        """The most of a prompt (``(block_size, hashes)``) any exact engine of replica ``name`` holds, in tokens; None
        when none of its engines is exact for that block size."""
        if hashes is None:
            return None
        best = None
        for _, ex in self._exact_caches(name):
            if ex.exact and ex.block_size == hashes[0]:
                n = ex.cached_tokens(hashes[1])
                best = n if best is None else max(best, n)
        return best

    def holds_block(self, name: str, block_size: int, h: int) -> bool:
        """Whether any exact engine of replica ``name`` (of that block size) holds block ``h``."""
        return any(ex.exact and ex.block_size == block_size and ex.holds(h) for _, ex in self._exact_caches(name))


__all__ = ["Policy"]
