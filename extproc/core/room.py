"""Room in a replica's KV cache (C3): what a request risks where it does not fit, what an offloaded tier gives back,
and flow control's saturation (a request that fits nowhere waits in the router)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .cost import Estimate, evict_risk
from .names import Hold

if TYPE_CHECKING:
    from .config import WarmConfig
    from .engine_cache import EngineCache
    from .pins import Pin
    from .profile import RequestProfile
    from .working_set import Active, WorkingSet

TIE_S = 0.01  # cost differences below a decode step are ties; what flow control counts as no wait at all


def restore_share(e: Estimate, w: "WarmConfig", use_index: bool) -> float:
    """What restoring a token costs on ``e``'s engine against computing it there: 1 where nothing is restored
    (no offloaded tier in warm.offload_tiers by its events, or the policy does not read events)."""
    ex = e.st.exact
    if ex is None or not ex.exact or not ex.tiers or not use_index or not any(m in ex.tiers for m in w.offload_tiers):
        return 1.0
    s_per = e.st.rates.restore_s_per_token
    return min(1.0, s_per * e.rate if s_per is not None else w.restore_cost_prior)


def tier_tokens(ex: "EngineCache", w: "WarmConfig") -> int:
    """Tokens the engine's offloaded tiers in warm.offload_tiers hold by its events: at least what they can hold."""
    return sum(len(ex.tiers.get(m, ())) for m in w.offload_tiers) * (ex.block_size or 0)


def restorable(ex: "EngineCache", hashes, cached: int, prompt: int, w: "WarmConfig") -> tuple[int, str | None]:
    """The prompt's tokens past the GPU's hit that one of ``offload_tiers`` holds in a run on this engine (vLLM's
    connector loads the run that follows the hit), and which tier: the longest."""
    bs = ex.block_size
    assert bs is not None  # an engine that stored blocks said their size
    best, medium = 0, None
    for m in w.offload_tiers:
        n = ex.restorable(hashes, cached // bs, m)
        if n > best:
            best, medium = n, m
    return min(best * bs, max(0, prompt - 1 - cached)), medium


def price_kv(e: Estimate, out_tokens: float, mine: "Active | None", session: bool, now: float, w: "WarmConfig",
             sessions: "WorkingSet", use_index: bool) -> None:
    """KV pressure now (C3) and the eviction risk of a session's context before its next turn."""
    st, cap, prompt = e.st, e.st.cache_tokens, e.prompt
    home = mine if mine is not None and mine.st is st else None  # the session's context is here already
    # what the others count already of this context: the prefix it shares with them, counted once
    shared = sessions.shares(st, home.shared[1]) if home is not None and home.shared is not None else \
        0 if home is not None else sessions.shares(st, e.prefix)
    used = st.kv_ahead(now, st.kv_usage(e.replica))
    over = used + prompt + out_tokens - w.kv_pressure * cap
    # an engine with an offloaded tier keeps what its GPU evicts: a context lost there is restored, not computed,
    # while the tier already holds as much as the contexts under way (a small one would lose them too)
    share = restore_share(e, w, use_index)
    if share < 1.0 and e.st.exact is not None and tier_tokens(e.st.exact, w) < st.active_tokens:
        share = 1.0
    e.room = st.active_tokens - (home.own if home is not None else 0) + prompt - min(shared, e.cached) + out_tokens \
        <= w.kv_pressure * cap
    if share < 1.0 and not e.room:
        # flow control holds a turn that would evict the active sessions' contexts, lest their next turns compute
        # them again; an offloaded tier gives them back at a restore's price: held only while it does not fit
        # beside what runs (placement still prefers where the contexts fit)
        e.room = over - e.cached <= 0
    others = st.active_whole - (home.whole if home is not None else 0)
    pressure = (others + prompt + out_tokens) / cap
    if home is not None:
        # at its home the session's context, and the prefix it shares with the others there, is resident once:
        # staying adds its new tokens, as flow control's room counts them. Counted whole, shared system prompts
        # once per session, homes that held the turn's context "did not fit" and sessions moved to re-prefill it
        # elsewhere (three real vLLMs: 4-19 moves a run, the turns that made warmroute's p99, docs/benchmarks.md)
        pressure = min(pressure, (st.active_tokens - home.own + prompt - min(shared, e.cached) + out_tokens) / cap)
    e.fits = pressure <= w.kv_pressure
    if session:
        risk = evict_risk(pressure, w)
        if risk:
            e.cost += risk * share * prompt / e.rate
    # The risks below are costs of the choice; this turn's time to first token carries only what this turn waits
    # (docs/routing.md, "Predictions": counted in the prediction, a turn found cached was predicted its whole
    # context's prefill)
    if e.cached and pressure > w.kv_pressure:
        # the active sessions here and this one do not fit together: LRU evicts each before its next turn. What
        # the index holds here now is here for this turn
        e.risk = share * e.cached / e.rate
        e.cost += e.risk
    elif over > 0:
        # it does not fit beside what runs and what is queued: it waits for KV to free, and loses its cache
        lost = share * e.cached / e.rate + min(1.0, over / cap) * out_tokens * e.dec
        # vLLM admits a prefill whose new blocks are free now (its output's come step by step), and its cached
        # blocks may be the very ones the scrape counts as used (taken while its last turn ran): within that it
        # runs at once, and the margin is a risk, not a wait
        if used + prompt - e.cached > cap:
            e.ttft += lost
        else:
            e.risk = lost
            e.cost += lost


def fit_rule(candidates: list[Estimate], pin: "Pin | None") -> list[Estimate]:
    """C3's fit rule: a replica where the request does not fit beside the active sessions' contexts is left out,
    unless it fits on none. The interference term draws big prefills to the replicas with few arrivals, which are
    where long sessions live: without the rule it sends a long context where it and theirs thrash (one shared system
    prompt, docs/routing.md). The session's home stays in while it holds at least half the turn's context: there
    the cost model weighs the eviction risk (``price_kv``) against a re-prefill elsewhere. Left out too, it moved
    contexts found cached at home to a slow replica's queue (four replicas 1,1,0.5,0.5 at load 1.5: 114K tokens,
    1.2 s predicted at home, 109 s where they fit); a home that lost the context has nothing to keep there."""
    return [e for e in candidates if e.fits or (pin is not None and e.replica is pin.replica
                                                and e.engine == pin.engine and 2 * e.cached >= e.prompt)] or candidates


def away_from_returning(best: Estimate, pin: "Pin | None", kept: list[Estimate], hold: Hold) -> Estimate:
    """In a flood (Hold.FLOODED), a request with no home goes to the cheapest replica that no session under way
    comes back to, where one has room for it; where none has room yet, it waits for one (``saturated``). An engine
    runs its queue in order, and a 25K prefill ahead of a cached turn is 17 such turns: placed by cost, 10-24 of the
    33-115 new sessions let in during a flood went to the two replicas four sessions under way turned on (`python -m
    bench flood`, issue 59); so placed, none in five runs. A fleet whose every replica has sessions under way keeps
    the cost model's choice (and ``saturated``'s flood rule): holding there would refuse every new session.
    ``kept``: the replicas C5's guard lets in (one more than twice over its bounded share takes nothing)."""
    if hold is not Hold.FLOODED or pin is not None or best.st.returning == 0:
        return best
    free = [e for e in kept if e.st.returning == 0 and e.fits]
    return min(free, key=lambda e: e.cost) if free else best


def saturated(best: Estimate, profile: "RequestProfile", pin: "Pin | None", ests: list[Estimate],
              w: "WarmConfig", hold: Hold) -> bool:
    """Flow control's saturation, with nothing to tune. A turn that needs new room in a cache (a new session, or
    one that must prefill most of its context again: no home yet, or less than half of it cached on the best
    candidate) and fits on no candidate beside the active sessions' contexts (C3's fit rule, the best not
    fitting: none does) waits in the router for a replica where it fits: placed now, the engine's LRU would
    evict active sessions' contexts while they think, and their next turns would prefill them again (the tail
    of every router in lasting overload, docs/routing.md). A context too big for an empty replica is placed as
    today: waiting would not make it fit. Turns that keep their cache are never held, nor one-shots.
    With Hold.WAITING (flow_control.hold_on_wait), also: even the best candidate makes the request wait longer
    than its own prefill there (half of it, sheddable), so holding it loses no engine time while it keeps the
    choice of replica open."""
    if hold is Hold.FLOODED and pin is None and best.st.returning > 0 and \
            any(e.st.returning == 0 and e.prompt <= w.kv_pressure * e.st.cache_tokens for e in ests):
        return True  # a replica free of sessions under way has no room for it yet: it waits for that (see above)
    fresh = pin is None or best.cached < best.prompt / 2
    if fresh and profile.session_key is not None:
        if not any(e.room for e in ests) and best.prompt <= w.kv_pressure * best.st.cache_tokens:
            return True
        # Sessions under way on it (active contexts) come back for their next turns, and an engine runs its
        # queue in order: each new session placed behind a queue longer than its own prefill only lengthens
        # what their cached turns wait (a flood of new sessions, docs/routing.md). A new session (no home yet)
        # waits here instead while every candidate with sessions under way has more than its prefill queued: no
        # engine time lost. A session under way is never held for this. Only while the fleet is busy (every such
        # queue at least warm.busy_wait_s, the cost model's mark of no idle capacity): a queue of a tenth of a
        # second comes and goes on any busy fleet (three real vLLMs, docs/routing.md). In a flood (Hold.FLOODED: the
        # brain refusing new sessions at the look) the replica it would go to decides alone: one slower replica with
        # a short queue kept the rule off while the flood's admitted sessions piled up 1-3 s deep on the faster ones,
        # ahead of their sessions' turns (issue 59; 140 of 172 admitted so in `python -m bench flood`)
        floor = max(TIE_S, w.busy_wait_s)
        if pin is None and all(e.st.active_tokens > 0 and e.wait + e.lora_wait > max(e.prefill, floor)
                               for e in ((best,) if hold is Hold.FLOODED else ests)):
            return True
    if hold is not Hold.WAITING:
        return False
    afford = max(best.prefill, TIE_S) * (0.5 if profile.priority >= 2 else 1.0)
    return best.wait + best.lora_wait > afford  # an adapter's load is paid whenever it goes: no reason to wait
