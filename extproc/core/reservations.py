"""The reservations a router holds open, oldest first: each request's weight on its replica from selection until
Envoy ends the request (``Router.release``), or a timeout says nobody will."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from .decision import Reservation
from .replica import Replica


class OpenReservations:
    def __init__(self) -> None:
        self._open: OrderedDict[int, Reservation] = OrderedDict()
        self._next_id = 1

    def open(self, r: Replica, weight_milli: int, now: float, provisional: bool) -> Reservation:
        """This brain's request on ``r``: its weight counted there until it is closed."""
        res = Reservation(self._next_id, r, weight_milli, now, seen_at=now, provisional=provisional)
        self._next_id += 1
        self._open[res.id] = res
        r.wlc_milli += weight_milli
        r.in_flight_requests += 1
        return res

    @staticmethod
    def remote(r: Replica, weight_milli: int, started_at: float, provisional: bool) -> Reservation:
        """Another brain's request on ``r`` (shared state): counted like ours, ended by that brain, never listed."""
        res = Reservation(0, r, weight_milli, started_at, seen_at=started_at, provisional=provisional, remote=True)
        r.wlc_milli += weight_milli
        r.in_flight_requests += 1
        return res

    def newest(self) -> Reservation | None:
        return self._open[next(reversed(self._open))] if self._open else None

    def close(self, res: Reservation) -> None:
        self._open.pop(res.id, None)

    def get(self, rid: int) -> Reservation | None:
        return self._open.get(rid)

    def __len__(self) -> int:
        return len(self._open)

    def __iter__(self) -> Iterator[Reservation]:
        return iter(self._open.values())

    def started_before(self, t: float) -> list[Reservation]:
        return [r for r in self._open.values() if r.started_at <= t]

    def timed_out(self, now: float, timeout_s: float) -> list[Reservation]:
        """Those older than ``timeout_s`` that Envoy has not said are alive since (a request Envoy still logs as in
        flight is alive, however long it runs)."""
        limit = now - timeout_s
        old = []
        for r in self._open.values():  # oldest first
            if r.started_at > limit:
                break
            if r.seen_at <= limit:
                old.append(r)
        return old

    def unseen(self, now: float, liveness_s: float) -> list[Reservation]:
        """Those Envoy has not said are alive for ``liveness_s``: a lost or rogue call."""
        unseen = now - liveness_s
        return [r for r in self._open.values() if r.seen_at < unseen]

    def oldest(self, now: float, k: int = 5) -> list[dict]:
        """The ``k`` oldest, for an operator asking what holds load (O(k))."""
        out: list[dict] = []
        for res in self._open.values():
            if len(out) >= k:
                break
            out.append({"replica": res.replica.name, "age_s": round(now - res.started_at, 1),
                        "seen_s_ago": round(now - res.seen_at, 1), "weight": res.weight_milli / 1000,
                        "provisional": res.provisional, "named_to_envoy": bool(res.token)})
        return out
