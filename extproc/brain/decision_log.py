"""GET /decisions: what the brain decided for each recent request, by Envoy's request id (bounded), joined with what
Envoy observed of its first token once the request ended."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from ..core.decision import Decision

RECENT_DECISIONS = 2000  # GET /decisions keeps this many (a few hundred bytes each)
MAX_REQUEST_ID_CHARS = 64  # Envoy's are UUIDs (36); a client's own may be anything


class DecisionLog:
    def __init__(self) -> None:
        self.recent: deque[tuple] = deque(maxlen=RECENT_DECISIONS)

    def remember(self, request_id: str | None, d: Decision, now: float) -> None:
        # on every request's path: a tuple here, the document only when GET /decisions asks
        self.recent.append(((request_id or "")[:MAX_REQUEST_ID_CHARS], now, d.replica_name, d.engine,
                            d.reason, d.model, d.predicted_ttft_s, d.cached_tokens, d.prompt_tokens,
                            d.prefill.replica.name if d.prefill is not None else None,
                            "headers" if d.header_path else "body",
                            d.reservation.prefill_s if d.reservation is not None else None,
                            d.reservation.overhead_s if d.reservation is not None else None))

    def rows(self, request_id: str | None, last: int | None,
             seen: "Callable[[str], tuple[float, float | None] | None]") -> list[dict]:
        """The remembered decisions (of one request id, or the last ``last``), newest last."""
        rows = [r for r in self.recent if r[0] == request_id] if request_id is not None else \
            list(self.recent)[max(0, len(self.recent) - (last or 0)):]
        return [{"request_id": rid, "at": round(at, 3), "replica": replica, "engine": engine, "reason": str(reason),
                 "model": model, "predicted_ttft_s": _r4(ttft), "predicted_prefill_s": _r4(prefill_s),
                 "predicted_overhead_s": _r4(overhead_s),
                 "predicted_cached_tokens": cached, "predicted_prompt_tokens": prompt, "prefill_replica": prefill,
                 "path": path, **_observed(seen(rid) if rid else None)}
                for rid, at, replica, engine, reason, model, ttft, cached, prompt, prefill, path, prefill_s, overhead_s
                in rows]


def _r4(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _observed(seen: "tuple[float, float | None] | None") -> dict:
    """What Envoy saw of a decision's request: the engine's first token, and the client's (None: not yet ended, not
    a streamed response, or no longer remembered)."""
    engine_s, client_s = seen if seen is not None else (None, None)
    return {"observed_ttft_s": _r4(engine_s), "observed_client_ttft_s": _r4(client_s)}
