"""One rule for the numbers, whichever instrument produced the requests (the simulator, or a live replay).

The simulator's own summary and both benchmarks read TTFT, hits and tokens
per second through here, so a difference between them is a difference in
what happened, not in how it was counted.
"""

from __future__ import annotations

from extproc.tools.workload.generate import Request

# what a class's request must meet to count in goodput: its time to first token, per class (critical, standard,
# sheddable). Standard's is the 2 s TTFT the capacity target buys hardware by; an interactive critical turn's half
# that; a sheddable one-shot's what a batch caller still waits for
GOODPUT_TTFT_S = (1.0, 2.0, 10.0)
CLASS_NAMES = ("critical", "standard", "sheddable")


def pct(xs: list[float], p: float) -> float:
    """The p-quantile of ``xs`` by rank (nan for none), the same rule everywhere."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def window_numbers(requests: list[Request], minutes: float, warmup_min: float, scale: float = 1.0) -> dict:
    """TTFT percentiles and prefix hits (cached over prompt tokens) of the requests that arrived after the warm-up
    and were answered; tokens per second of the requests that finished inside [warm-up, end]. ``scale`` turns a live
    request's wall seconds into workload seconds (its arrival is already in workload seconds); the simulator's are
    workload seconds already (scale 1)."""
    lo, hi = warmup_min * 60, minutes * 60
    window = [r for r in requests if r.arrival >= lo]
    ok = [r for r in window if r.error is None and r.ttft is not None and r.e2e is not None]
    finished = [r for r in requests if r.error is None and r.e2e is not None and lo <= r.arrival + r.e2e * scale <= hi]
    ttft = [r.ttft * scale for r in ok]
    prompt = sum(r.prompt_tokens for r in ok)
    out = {"requests": len(window), "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99),
           "hits": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
           "tok_s": sum(r.max_tokens for r in finished) / (hi - lo) if hi > lo else 0.0}
    engine = [(r.ttft * scale, r.extra["engine"]["ttft_s"]) for r in ok if r.extra.get("engine")]
    if engine:  # a live run on mocks: the part of each TTFT that was not the engine's own
        out["engine_ttft_p50"] = pct([e for _, e in engine], 0.5)
        out["overhead_p50"] = pct([c - e for c, e in engine], 0.5)
        out["overhead_p99"] = pct([c - e for c, e in engine], 0.99)
    return out


def per_class(requests: list[Request], lo: float, hi: float, scale: float = 1.0) -> dict:
    """Per class, of the requests that arrived in [lo, hi): TTFT p50/p99 of those answered (from their first
    attempt; absent when none was), and goodput: those whose TTFT met their class's deadline, per minute. A request
    refused and never answered, or failed, is counted in the class but not in goodput. ``scale``: as
    ``window_numbers``'s."""
    out: dict = {}
    minutes = (hi - lo) / 60 if hi > lo else float("nan")
    good_all = 0
    for k, name in enumerate(CLASS_NAMES):
        rs = [r for r in requests if r.klass == k and lo <= r.arrival < hi]
        ttft = [r.ttft * scale for r in rs if r.error is None and r.ttft is not None]
        good = sum(1 for t in ttft if t <= GOODPUT_TTFT_S[k])
        good_all += good
        out[f"{name}_requests"] = len(rs)
        out[f"{name}_goodput"] = good / minutes
        if ttft:  # a class with nothing answered has no percentiles (not nan: a summary equals itself)
            out[f"{name}_ttft_p50"] = pct(ttft, 0.5)
            out[f"{name}_ttft_p99"] = pct(ttft, 0.99)
            out[f"{name}_met"] = good / len(rs)
    out["goodput"] = good_all / minutes
    return out
