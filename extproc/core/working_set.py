"""The working set of active sessions (C3): where each session's context lives, and how much of each replica's
cache the sessions under way hold. A cache thrashes when the working set of its active sessions outgrows it; the
fit rule and flow control read ``WarmReplica.active_tokens``, which this keeps."""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from .warm_replica import WarmReplica

RETURN_PRIOR = 20.0  # new sessions assumed to come back before any is seen not to
# the gaps between a session's turns that the return horizon is learned from: the last GAPS of them, once GAPS_MIN
# are seen, read again every GAPS_EVERY new ones
GAPS, GAPS_MIN, GAPS_EVERY = 512, 64, 32
HORIZON_MIN_S = 5.0  # however quick the fleet's sessions are, one quiet for less than this is still under way


class Active(NamedTuple):
    """A session under way: where its context lives and what it counts there."""
    at: float  # when it was last used
    st: WarmReplica
    own: int  # the tokens its own context counts (a shared prefix apart)
    back: bool  # whether it ever came back
    shared: tuple | None  # the prefix it shares with other sessions there: a key of WorkingSet._shared, or None
    whole: int  # its whole context's tokens, a shared prefix included (the routing terms' count)


class WorkingSet:
    def __init__(self) -> None:
        # (time, session key, replica state, tokens) per session turn, oldest first: sessions idle for longer
        # than warm.active_session_s leave their replica's working set
        self._turns: deque[tuple[float, bytes, WarmReplica, int]] = deque()
        self._of: dict[bytes, Active] = {}
        # (replica state, the shared prefix's last block hash) -> [its tokens, how many active sessions use it]:
        # a system prompt that 40 chats share takes its room in the engine's cache once, not 40 times
        self._shared: dict[tuple, list[int]] = {}
        # first turns whose session came back within warm.active_session_s, and those that went quiet first (decayed)
        self._returns, self._no_returns = 0.0, 0.0
        self._gaps: deque[float] = deque(maxlen=GAPS)  # seconds between a session's turns, the last GAPS
        self._new_gaps = 0
        self._p99_gap: float | None = None  # None: too few gaps seen to say
        # turns placed and not yet ended, per session: a session whose turn waits in a replica's queue is under way
        # however long it waits, and quiet only from that turn's end
        self._busy: dict[bytes, int] = {}

    def horizon(self, active_session_s: float) -> float:
        """How long a quiet session still counts as under way: ``warm.active_session_s``, or twice the longest gap
        between turns that the fleet's sessions showed (their p99; from a turn's end to the next), whichever is
        shorter. Chat sessions that end
        after a few turns 2 s apart would otherwise hold their replicas' working set for a minute after their last
        turn, and flow control hold new sessions for room that is not in use (on three real vLLMs a new session
        waited up to 37 s where ring hash served it in 0.2 s: docs/routing.md). Sessions with long pauses
        (a person thinking for minutes) keep the configured horizon."""
        if self._p99_gap is None:
            return active_session_s
        return min(active_session_s, max(HORIZON_MIN_S, 2.0 * self._p99_gap))

    def _gap(self, seconds: float) -> None:
        self._gaps.append(seconds)
        self._new_gaps += 1
        if len(self._gaps) >= GAPS_MIN and (self._p99_gap is None or self._new_gaps >= GAPS_EVERY):
            g = sorted(self._gaps)
            self._p99_gap = g[int(0.99 * (len(g) - 1))]
            self._new_gaps = 0

    def forget_gaps(self) -> None:
        self._gaps.clear()
        self._new_gaps, self._p99_gap = 0, None

    def of(self, key: bytes) -> Active | None:
        return self._of.get(key)

    def shares(self, st: WarmReplica, prefix: int | None) -> int:
        """The tokens of a prefix that active sessions on ``st`` already share, counted once (0: none do)."""
        e = self._shared.get((st, prefix)) if prefix is not None else None
        return e[0] if e is not None else 0

    def _release(self, st: WarmReplica, shared: tuple | None) -> None:
        if shared is not None and (e := self._shared.get(shared)) is not None:
            e[1] -= 1
            if e[1] <= 0:
                del self._shared[shared]
                st.active_tokens -= e[0]

    def expire(self, now: float, active_session_s: float) -> None:
        limit = now - self.horizon(active_session_s)
        a = self._turns
        while a and a[0][0] < limit:
            t, key, st, tokens = a.popleft()
            cur = self._of.get(key)
            if cur is not None and cur.at == t and not self._busy.get(key):
                del self._of[key]
                st.active_tokens -= tokens
                st.active_whole -= cur.whole
                st.returning -= cur.back
                self._release(st, cur.shared)
                if not cur.back:
                    self._came_back(False)

    def ended(self, key: bytes | None, now: float) -> None:
        """A turn of the session ended: it is quiet from now (its horizon counts from here). In a lasting overload a
        turn waited minutes in a slow replica's queue, past the horizon counted from its placement: its session left
        that replica's working set while its context was on its way in, the replica looked roomy, and the fit rule
        sent it more long contexts (a 0.5x replica's queue 1,000 s deep, docs/routing.md)."""
        if key is None or (n := self._busy.get(key, 0) - 1) < 0:
            return
        if n:
            self._busy[key] = n
        else:
            del self._busy[key]
        cur = self._of.get(key)
        if cur is not None:
            self._of[key] = Active(now, cur.st, cur.own, cur.back, cur.shared, cur.whole)
            self._turns.append((now, key, cur.st, cur.own))

    def _came_back(self, yes: bool) -> None:
        if yes:
            self._returns += 1.0
        else:
            self._no_returns += 1.0
        if self._returns + self._no_returns > 2000:  # the recent traffic's share, not all time's
            self._returns, self._no_returns = self._returns / 2, self._no_returns / 2

    @property
    def return_share(self) -> float:
        """The share of new sessions whose next turn comes within warm.active_session_s, learned (a prior of 20
        that do: until traffic says otherwise, a new session is expected back, as before)."""
        return (self._returns + RETURN_PRIOR) / (self._returns + self._no_returns + RETURN_PRIOR)

    def place(self, key: bytes, st: WarmReplica, tokens: int, now: float, prefix: int | None = None,
              cached: int = 0, under_way: bool = False) -> bytes | None:
        """The session's context now lives on ``st``. A first turn counts at the share of new sessions that come
        back: traffic of sessions that never return (a session id per call) does not fill the working set that
        flow control protects (a soak of one-turn sessions held ~1,100 requests until their clients gave up).
        What a session found cached on arriving at a replica (``cached`` tokens, the prefix ending in block
        ``prefix``) is what it shares with the sessions there before it: counted once for all that share it, and
        kept as its shared part while it stays. Counted per session, a 1.5K system prompt made each 4K chat
        count 35% more than the engine held, and flow control held new sessions on three real vLLMs with room
        to spare (p99 10x ring hash's: docs/routing.md). The first session to bring a prefix still counts it in
        its own context: at most one copy more than the engine holds, and never less when it leaves first.
        A turn ``under_way`` (a request whose end will be told) keeps its session under way until ``ended`` is given
        the key this returns."""
        old = self._of.get(key)
        back = old is not None
        shared = None
        if old is not None:
            self._gap(now - old.at)
            old.st.active_tokens -= old.own
            old.st.active_whole -= old.whole
            old.st.returning -= old.back
            if old.st is st and old.shared is not None:
                shared = old.shared  # stays: its shared part is what it shared when it arrived (its own ref holds it)
            else:
                self._release(old.st, old.shared)
            if not old.back:
                self._came_back(True)
        if shared is None and prefix is not None and cached > 0:
            shared = (st, prefix)
            e = self._shared.get(shared)
            if e is None:
                self._shared[shared] = [cached, 1]
                st.active_tokens += cached
            else:
                e[1] += 1
        own = max(0, tokens - (self._shared[shared][0] if shared is not None else 0))
        counted = own if back else int(own * self.return_share)
        whole = tokens if back else int(tokens * self.return_share)
        self._of[key] = Active(now, st, counted, back, shared, whole)
        st.active_tokens += counted
        st.active_whole += whole
        st.returning += back
        self._turns.append((now, key, st, counted))
        if not under_way:
            return None
        self._busy[key] = self._busy.get(key, 0) + 1
        return key
