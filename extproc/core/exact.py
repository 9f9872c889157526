"""The engines' own word applied to the policy's view of each engine: their KV events become each
engine's ``EngineCache`` (``WarmReplica.exact``), which the warm policy prices a request against once it is exact.
A policy without per-engine state (the seed's) takes no events."""

from __future__ import annotations

from typing import Callable

from .engine_cache import EngineCache


def _state(policy, name: str, rank: int):
    return policy.engine_state(name, rank)


def apply_events(policy, name: str, rank: int, events: list, now: float, make: Callable[[], EngineCache]) -> bool:
    """One batch of engine ``rank``'s events on replica ``name``; False when the policy keeps no such engine."""
    st = _state(policy, name, rank)
    if st is None:
        return False
    if st.exact is None:
        st.exact = make()
    st.exact.apply(events, now)
    return True


def events_lost(policy, name: str, rank: int, why: str) -> None:
    st = _state(policy, name, rank)
    if st is not None and st.exact is not None:
        st.exact.lost(why)


def view(policy, name: str, ranks: int) -> list[dict] | None:
    """Each engine's cache as its events say (/state), None when no engine of the replica sent any."""
    out = []
    for rank in range(max(1, ranks)):
        st = _state(policy, name, rank)
        if st is not None and st.exact is not None:
            out.append({"rank": rank, **st.exact.view()})
    return out or None


def mode_of(engines: list[dict] | None) -> tuple[str, str]:
    """(``exact`` or ``estimated``, why) for a replica whose engines' ``view`` is ``engines``: exact when every engine
    that sent events is."""
    if not engines:
        return "estimated", "no KV events (none configured, or the engine publishes none)"
    off = [e for e in engines if e["cache_mode"] != "exact"]
    return ("estimated", off[0]["reason"]) if off else ("exact", "every stored block verified")


def cached_on(policy, name: str, ranks: int, hashes: tuple[int, tuple[int, ...]] | None) -> int | None:
    """The most of a prompt (``(block_size, hashes)``) any exact engine of replica ``name`` holds, in tokens; None
    when none of its engines is exact for that block size."""
    if hashes is None:
        return None
    best = None
    for rank in range(max(1, ranks)):
        st = _state(policy, name, rank)
        ex = st.exact if st is not None else None
        if ex is not None and ex.exact and ex.block_size == hashes[0]:
            n = ex.cached_tokens(hashes[1])
            best = n if best is None else max(best, n)
    return best


def holds(policy, name: str, ranks: int, block_size: int, h: int) -> bool:
    """Whether any exact engine of replica ``name`` (of that block size) holds block ``h``."""
    for rank in range(max(1, ranks)):
        st = _state(policy, name, rank)
        ex = st.exact if st is not None else None
        if ex is not None and ex.exact and ex.block_size == block_size and ex.holds(h):
            return True
    return False
