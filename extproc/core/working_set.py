"""The working set of active sessions (C3): where each session's context lives, and how much of each replica's
cache the sessions under way hold. A cache thrashes when the working set of its active sessions outgrows it; the
fit rule and flow control read ``WarmReplica.active_tokens``, which this keeps."""

from __future__ import annotations

from collections import deque

from .warm_replica import WarmReplica

RETURN_PRIOR = 20.0  # new sessions assumed to come back before any is seen not to


class WorkingSet:
    def __init__(self) -> None:
        # (time, session key, replica state, tokens) per session turn, oldest first: sessions idle for longer
        # than warm.active_session_s leave their replica's working set
        self._turns: deque[tuple[float, bytes, WarmReplica, int]] = deque()
        # session -> (when it was last used, where, the tokens its context counts, whether it ever came back)
        self._of: dict[bytes, tuple[float, WarmReplica, int, bool]] = {}
        # first turns whose session came back within warm.active_session_s, and those that went quiet first (decayed)
        self._returns, self._no_returns = 0.0, 0.0

    def of(self, key: bytes) -> tuple[float, WarmReplica, int, bool] | None:
        return self._of.get(key)

    def expire(self, now: float, active_session_s: float) -> None:
        limit = now - active_session_s
        a = self._turns
        while a and a[0][0] < limit:
            t, key, st, tokens = a.popleft()
            cur = self._of.get(key)
            if cur is not None and cur[0] == t:
                del self._of[key]
                st.active_tokens -= tokens
                if not cur[3]:
                    self._came_back(False)

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

    def place(self, key: bytes, st: WarmReplica, tokens: int, now: float) -> None:
        """The session's context now lives on ``st``. A first turn counts at the share of new sessions that come
        back: traffic of sessions that never return (a session id per call) does not fill the working set that
        flow control protects (a soak of one-turn sessions held ~1,100 requests until their clients gave up)."""
        old = self._of.get(key)
        back = old is not None
        if back:
            old[1].active_tokens -= old[2]
            if not old[3]:
                self._came_back(True)
        counted = tokens if back else int(tokens * self.return_share)
        self._of[key] = (now, st, counted, back)
        st.active_tokens += counted
        self._turns.append((now, key, st, counted))
