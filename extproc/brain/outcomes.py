"""Every decision's predicted time to first token joined with what Envoy saw of the same request.

Envoy's access-log entry carries, as custom tags, the time from the request's last byte sent upstream to the first
byte of the response body (``FIRST_TOKEN_TAG``): on a streamed completion, the engine's time to its first token (the
response headers come before it). The brain predicted that same interval when it chose the replica: its queue ahead
plus the prefill of what the replica does not hold. A response that is not an event stream has its first body byte at
the end of the whole completion, so it is no observation of the first token and is not joined.

Per replica, the last ``WINDOW`` joined requests say how wrong the predictions are there: the bias (summed predicted
over summed observed, minus one: +0.3 predicts 30% too slow), the mean absolute percentage error, and the 90th
percentile of the absolute error in seconds.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

WINDOW = 256  # joined requests per replica the error is computed over: a few minutes of a busy replica
MAX_REQUESTS = 4096  # request ids whose observed time /decisions can show, oldest out first
_FLOOR_S = 0.001  # an observed time below a millisecond is a millisecond: the relative error stays finite


@dataclass(frozen=True, slots=True)
class PredictionError:
    """How a replica's predictions of time to first token compared with what was observed (``WINDOW`` last)."""

    joined: int
    bias: float
    mape: float
    p90_abs_error_s: float

    def as_dict(self) -> dict:
        return {"joined": self.joined, "bias": round(self.bias, 4), "mape": round(self.mape, 4),
                "p90_abs_error_s": round(self.p90_abs_error_s, 4)}


def observed_us(tags, key: str) -> float | None:
    """A duration custom tag in seconds (Envoy writes ``-`` when one end of it never happened)."""
    v = tags.get(key)
    if not v or len(v) > 12 or not v.isdigit():  # a day is 11 digits of microseconds: anything longer is not Envoy's
        return None
    return int(v) / 1e6


class Outcomes:
    def __init__(self) -> None:
        self.by_replica: dict[str, deque[tuple[float, float]]] = {}
        self.joined_total: dict[str, int] = {}
        self.observed: OrderedDict[str, tuple[float, float | None]] = OrderedDict()

    def join(self, replica: str, request_id: str | None, predicted_s: float | None, observed_s: float,
             client_s: float | None = None) -> None:
        """One request's first token as observed (and as its client saw it, upload and decision included)."""
        if request_id:
            self.observed[request_id] = (observed_s, client_s)
            if len(self.observed) > MAX_REQUESTS:
                self.observed.popitem(last=False)
        if predicted_s is None:
            return
        pairs = self.by_replica.get(replica)
        if pairs is None:
            pairs = self.by_replica[replica] = deque(maxlen=WINDOW)
        pairs.append((predicted_s, max(observed_s, _FLOOR_S)))
        self.joined_total[replica] = self.joined_total.get(replica, 0) + 1

    def error(self, replica: str) -> PredictionError | None:
        pairs = self.by_replica.get(replica)
        if not pairs:
            return None
        predicted = sum(p for p, _ in pairs)
        observed = sum(o for _, o in pairs)
        mape = sum(abs(p - o) / o for p, o in pairs) / len(pairs)
        errors = sorted(abs(p - o) for p, o in pairs)
        return PredictionError(len(pairs), predicted / observed - 1.0, mape, errors[min(len(errors) - 1,
                                                                                      int(0.9 * len(errors)))])

    def observed_of(self, request_id: str) -> tuple[float, float | None] | None:
        return self.observed.get(request_id)

    def forget(self, replica: str) -> None:
        """A replica gone from the fleet (discovery): its errors go with it."""
        self.by_replica.pop(replica, None)
        self.joined_total.pop(replica, None)


__all__ = ["MAX_REQUESTS", "Outcomes", "PredictionError", "WINDOW", "observed_us"]
