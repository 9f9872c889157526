"""Load signals scraped from a replica, and the rates the warm policy learns from them (C3, C6).

Rates come from the replica's own counters, never from a model of the engine: prefill speed is
the uncached prompt tokens it computed per second of prefill, decode speed the seconds of decode
per generated token. Config gives the values used until two scrapes with traffic between them exist.

vLLM observes ``request_prefill_time_seconds`` and ``request_decode_time_seconds`` when a request
*finishes*, but counts ``prompt_tokens`` at its first token and ``generation_tokens`` every step
(``vllm/v1/metrics/loggers.py``). Dividing one window's tokens by the same window's seconds pairs
requests that started now with requests that started a request's lifetime ago: while load ramps up
the rates read too fast, while it falls too slow. So each rate pairs quantities of the same requests:
- prefill: ``request_prefill_kv_computed_tokens`` (newer vLLM: computed tokens, observed at finish) over
  prefill seconds; else computed tokens per first token (``time_to_first_token_seconds_count``) over
  prefill seconds per finished request (``request_prefill_time_seconds_count``): the mean request of
  each side, which a ramp does not skew while the mix of requests holds. SGLang the other way round:
  prompt and cached tokens per finished request over ``per_stage_req_latency_seconds{stage="prefill_forward"}``
  per request whose prefill ended;
- decode: ``request_generation_tokens`` (observed at finish) less the first token of each, over decode
  seconds; SGLang: its inter-token latency histogram (sum of intervals over tokens, observed as they stream).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

_ALPHA = 0.3  # EWMA weight of a new sample: a rate follows a changed replica within a few samples
_MIN_PREFILL_S = 5.0  # seconds of prefill behind one sample of the prefill rate
_MIN_DECODE_TOKENS = 500  # generated tokens behind one sample of the decode rate
# the first sample of a replica's prefill rate replaces the configured prior after this many finished requests' prefill,
# if a fifth of _MIN_PREFILL_S has not come sooner: on a fast engine that is 50-100 requests (a mock at 10x held
# its prior, 11x off, for a whole 45 s phase), and a prior off by any factor prices worse than ten requests' mean
_FIRST_PREFILL_REQUESTS = 10
# how far one request's prefill rate strays from its replica's (relative): a sample of n requests is known to within
# about _REQUEST_CV / sqrt(n). Like replicas measured on ten requests each differ by ~5% (two real vLLMs: 9,979 and
# 10,501 tok/s), which the cost model must not take for a difference of hardware
_REQUEST_CV = 0.5
_CLIP = 64.0  # a sample this far from the config's value either way is an artefact (a small model on a GPU decodes
# 15x faster than the default prior; 8x, the bound before, held a 2 ms/token engine at 3.75)
_MIN_RESTORE_TOKENS = 2048  # restored tokens behind one sample of the restore time
_RIDGE = 0.25  # how firmly a rate's slope in the batch holds to none while the samples' batches barely differ


@dataclass(frozen=True, slots=True)
class LoadSample:
    """One scrape of a replica's /metrics. Counters are totals since the replica started (None: not exported)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prompt_tokens: float | None = None
    cached_tokens: float | None = None  # vllm:prefix_cache_hits (tokens)
    prefill_seconds: float | None = None  # sum of vllm:request_prefill_time_seconds
    generation_tokens: float | None = None
    decode_seconds: float | None = None  # sum of vllm:request_decode_time_seconds
    requests_done: float | None = None  # count of vllm:e2e_request_latency_seconds
    cache_tokens: int | None = None  # vllm:cache_config_info: num_gpu_blocks x block_size
    prefix_caching: bool | None = None  # vllm:cache_config_info's enable_prefix_caching (None: not exported)
    # vllm:prompt_tokens_by_source{source="local_compute"} (newer vLLM): the prompt tokens this replica computed.
    # Better than prompt_tokens - prefix_cache_hits, which counts tokens a KV connector loaded as computed
    computed_tokens: float | None = None
    # counts and sums observed with the same requests (see the module's doc): None where not exported
    first_tokens: float | None = None  # time_to_first_token_seconds_count: requests whose prefill ended
    # the requests whose prompt tokens prompt_tokens counts (Dialect.prompt_counted)
    prompt_requests: float | None = None
    prefill_done: float | None = None  # request_prefill_time_seconds_count: requests that finished
    computed_at_finish: float | None = None  # request_prefill_kv_computed_tokens_sum (newer vLLM)
    generated_at_finish: float | None = None  # request_generation_tokens_sum
    decode_done: float | None = None  # request_decode_time_seconds_count
    itl_seconds: float | None = None  # SGLang inter_token_latency_seconds_sum
    itl_tokens: float | None = None  # SGLang inter_token_latency_seconds_count
    # per data-parallel engine (vLLM's engine label, SGLang's dp_rank): running, waiting, KV usage and cache
    # size of each, in rank order; None: one engine
    engines: "tuple[LoadSample, ...] | None" = None
    # vllm:lora_requests_info's newest label set: the adapters in the batch and queued, and the GPU's adapter slots
    lora_running: frozenset[str] | None = None
    lora_waiting: frozenset[str] | None = None
    max_lora: int | None = None
    # vllm:cache_config_info's block_size: the engine caches whole blocks of this many tokens (None: any count)
    engine_block: int | None = None
    # what a KV connector loaded instead of computing: prompt tokens (prompt_tokens_by_source{external_kv_transfer})
    # and the seconds its loads took (vllm:kv_offload_load_time, an offloading connector's restores)
    restored_tokens: float | None = None
    restore_seconds: float | None = None


class BatchFit:
    """Seconds per token as a line in the engine's batch, ``a + c x batch``, by least squares over a rate's samples
    weighted down by ``1 - _ALPHA`` a sample (an EWMA when every sample saw the same batch), each sample weighing the
    tokens it covers: a sample is ~5 s of prefill (or 500 generated tokens) however many tokens those seconds
    computed, and a plain mean of seconds per token over windows of equal seconds is pulled to the windows of few
    tokens (on real vLLM 0.41-0.89x the engines' own prefill rate, decode up to 2.19x). Weighed, the fit reads as the
    engine's tokens over its seconds.

    Why a line: a vLLM engine step schedules the running requests first (a decode token each, a chunk of a running
    prefill) and fills the rest of its token budget with waiting requests' prefill chunks
    (``vllm/v1/core/sched/scheduler.py``), so a step's time grows with how many requests run in it, and a request
    advances one token (decode) or one chunk (prefill) a step: its time per token grows with the batch it ran
    beside. ``batch`` is the mean of the engine's ``num_requests_running`` over the scrapes a sample accumulated
    over (the request itself included). The slope is pulled towards none (``_RIDGE``) so that samples that all saw
    the same batch give the plain mean, never a slope the data cannot tell; it is never negative (more requests in
    a step never make each faster) and never steeper than the samples bear (``a`` stays positive)."""

    __slots__ = ("_s", "a", "c", "top", "sloped")

    def __init__(self, y: float, sloped: bool = True):
        self._s = [0.0] * 5  # weight, batch, batch^2, y, batch x y
        self.a, self.c = y, 0.0
        self.sloped = sloped  # False: one rate whatever the batch (the model before; benchmarks compare the two)
        self.top = 0.0  # the largest batch a sample saw: the line is not extrapolated past it (``at``)

    def at(self, batch: float) -> float:
        return self.a + self.c * min(batch, self.top)

    def add(self, batch: float, y: float, first: bool, weight: float = 1.0) -> None:
        self.top = max(self.top, batch)
        s, keep = self._s, 0.0 if first else 1.0 - _ALPHA
        for i, v in enumerate((1.0, batch, batch * batch, y, batch * y)):
            s[i] = keep * s[i] + weight * v
        w, sb, sbb, sy, sby = s
        ridge = _RIDGE * w
        c = max(0.0, (w * sby - sb * sy) / (w * (sbb + ridge) - sb * sb)) if self.sloped else 0.0
        if c * sb <= 1e-9 * sy:  # samples of one batch: rounding's slope, not the data's
            c = 0.0
        a = (sy - c * sb) / w
        if a <= 0.0:
            a, c = sy / w, 0.0
        self.a, self.c = a, c

    @property
    def slope(self) -> float:
        """The fractional growth of seconds per token per request in the batch."""
        return self.c / self.a


class Rates:
    """Per-replica learned speeds from deltas of its counters, accumulated until they mean something.

    Deltas are summed until ``_MIN_PREFILL_S`` seconds of prefill (or ``_MIN_DECODE_TOKENS`` generated
    tokens) are behind them, and only then fitted (``BatchFit``: against the
    batch they ran in); a sample outside [1/64, 64] x the config's value is taken as an artefact and clipped.
    ``prefill_tokens_per_s`` and ``decode_s_per_token`` are the speeds of an empty engine (batch 0), which is
    what a replica's hardware is; ``prefill_slope`` and ``decode_slope`` what each request running beside
    slows it by (``at_batch``). Which counters pair with which: the module's doc.
    """

    __slots__ = ("prefill_tokens_per_s", "decode_s_per_token", "output_tokens", "_prev", "prefill_at", "decode_at",
                 "_acc", "_ref", "paired", "min_prefill_s", "prefill_rel", "decode_rel", "prefill_rel_at",
                 "decode_rel_at", "_prefill_fit", "_decode_fit", "prefill_slope", "decode_slope",
                 "restore_s_per_token", "_restore_acc", "_finished", "prefill_noise")

    def __init__(self, prefill_tokens_per_s: float, decode_s_per_token: float, output_tokens: float,
                 paired: bool = True, min_prefill_s: float = _MIN_PREFILL_S, batch: bool = True):
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.decode_s_per_token = decode_s_per_token
        self.prefill_slope = self.decode_slope = 0.0
        self.output_tokens = output_tokens  # mean generated tokens per request on this replica
        self.paired = paired  # False: the window's tokens over the window's seconds (the lagging way; benchmarks)
        self.min_prefill_s = min_prefill_s  # a time-compressed mock reports its seconds compressed too
        self._ref = (prefill_tokens_per_s, decode_s_per_token)
        self._prefill_fit = BatchFit(1.0 / prefill_tokens_per_s, batch)
        self._decode_fit = BatchFit(decode_s_per_token, batch)
        self._prev: LoadSample | None = None
        # prefill tokens, prefill s, generated tokens, decode s, requests, first tokens, finished requests,
        # then per rate (prefill, decode): the running requests summed over its scrapes, and how many scrapes
        self._acc = [0.0] * 11
        self._finished = 0.0  # requests whose prefill the accumulated seconds cover
        # the relative uncertainty of the prefill rate: >0 while it stands on a first sample of a few requests (the
        # next sample, of a fifth of _MIN_PREFILL_S, replaces it), 0 once it stands on seconds of prefill
        self.prefill_noise = 0.0
        self.prefill_at = float("-inf")  # when the last sample of each rate was taken
        self.decode_at = float("-inf")
        # each rate against the fleet's when it was measured: how this replica's hardware compares with the others'
        # (effective_rates), which a stale rate keeps while the fleet's absolute rates move with the load; and the
        # sample it was taken from
        self.prefill_rel = self.decode_rel = 1.0
        self.prefill_rel_at = self.decode_rel_at = float("-inf")
        # seconds an offloading connector takes to restore a token (None: not measured; the policy's prior holds)
        self.restore_s_per_token: float | None = None
        self._restore_acc = [0.0, 0.0]  # restored tokens, their load seconds, since the last sample

    def at_batch(self, batch: float) -> tuple[float, float]:
        """(prefill tokens/s, decode s/token) beside ``batch`` requests running (the request itself included)."""
        return 1.0 / self._prefill_fit.at(batch), self._decode_fit.at(batch)

    def update(self, s: LoadSample, now: float) -> None:
        p = self._prev
        self._prev = s
        if p is None:
            return
        if any(a is not None and b is not None and a < b for a, b in
               ((s.prompt_tokens, p.prompt_tokens), (s.requests_done, p.requests_done))):
            self._acc = [0.0] * 11  # the replica restarted: its counters began again
            self._finished = 0.0
            return
        acc = self._acc
        acc[7] += s.running
        acc[8] += 1
        acc[9] += s.running
        acc[10] += 1
        self._prefill(s, p, now)
        self._decode(s, p, now)
        self._restore(s, p)

    def _restore(self, s: LoadSample, p: LoadSample) -> None:
        """Seconds per restored token: the connector's load seconds over the tokens it loaded, summed over scrapes
        until enough tokens are behind them (vLLM counts the seconds as a load ends and the tokens at the request's
        first token, which may fall in the next scrape). Only a replica with an offloading connector exports the
        seconds; one that also takes P/D transfers (a MultiConnector) counts those tokens too and reads fast."""
        d = _deltas(s, p, "restored_tokens", "restore_seconds")
        if d is None:
            return
        acc = self._restore_acc
        dt, ds = d
        if dt < 0 or ds < 0:  # the engine restarted: its counters began again
            self._restore_acc = [0.0, 0.0]
            return
        acc[0] += dt
        acc[1] += ds
        if acc[0] >= _MIN_RESTORE_TOKENS and acc[1] > 0:
            sample = acc[1] / acc[0]
            old = self.restore_s_per_token
            self.restore_s_per_token = sample if old is None else old + _ALPHA * (sample - old)
            acc[0] = acc[1] = 0.0

    def _prefill(self, s: LoadSample, p: LoadSample, now: float) -> None:
        acc = self._acc
        if s.prefill_done is not None and p.prefill_done is not None:
            self._finished += s.prefill_done - p.prefill_done
        paired = _deltas(s, p, "computed_at_finish", "prefill_seconds") if self.paired else None
        if paired is not None:
            acc[0] += paired[0]
            acc[1] += paired[1]
            tokens, seconds = acc[0], acc[1]
        elif s.prompt_tokens is not None and s.prefill_seconds is not None and p.prompt_tokens is not None \
                and p.prefill_seconds is not None:
            if s.computed_tokens is not None and p.computed_tokens is not None:
                acc[0] += s.computed_tokens - p.computed_tokens
            else:
                # no prefix-cache counter (prefix caching off): every prompt token was computed
                acc[0] += (s.prompt_tokens - (s.cached_tokens or 0)) - (p.prompt_tokens - (p.cached_tokens or 0))
            acc[1] += s.prefill_seconds - p.prefill_seconds
            tokens, seconds = acc[0], acc[1]
            counted = _deltas(s, p, "prompt_requests", "prefill_done") if self.paired else None
            if counted is not None:
                # tokens and seconds counted at different moments of a request (vLLM: tokens at its first token,
                # seconds at finish; SGLang the other way round): compare the mean request of each
                acc[5] += counted[0]
                acc[6] += counted[1]
                if acc[5] <= 0 or acc[6] <= 0:
                    return
                tokens, seconds = acc[0] / acc[5], acc[1] / acc[6]
        else:
            return
        # the first sample replaces a guess (the configured prior), so a fifth of the evidence will do: a replica
        # that gets little traffic (a slow one) would otherwise be priced at the guess for many minutes; and before
        # that, ten finished requests, a provisional sample (with its noise) that the next one replaces
        first = self.prefill_at == float("-inf")
        provisional = self.prefill_noise > 0
        need = self.min_prefill_s if not (first or provisional) else self.min_prefill_s / 5
        thin = first and self._finished >= _FIRST_PREFILL_REQUESTS
        if (acc[1] >= need or thin) and tokens > 0 and seconds > 0:
            ref = 1.0 / self._ref[0]
            sample = min(_CLIP * ref, max(ref / _CLIP, seconds / tokens))
            fit = self._prefill_fit
            # the first measurement replaces the configured prior (a guess for any hardware), the second a first
            # of a few requests
            fit.add(acc[7] / max(1.0, acc[8]), sample, first or provisional, max(1.0, acc[0]))
            self.prefill_tokens_per_s, self.prefill_slope = 1.0 / fit.a, fit.slope
            self.prefill_noise = _REQUEST_CV / max(1.0, self._finished) ** 0.5 if acc[1] < need else 0.0
            self.prefill_at = now
            acc[0] = acc[1] = acc[5] = acc[6] = acc[7] = acc[8] = 0.0
            self._finished = 0.0

    def _decode(self, s: LoadSample, p: LoadSample, now: float) -> None:
        acc = self._acc
        at_finish = _deltas(s, p, "generated_at_finish", "decode_seconds", "decode_done") if self.paired else None
        itl = _deltas(s, p, "itl_seconds", "itl_tokens") if self.paired and at_finish is None else None
        if at_finish is not None:
            generated_d, seconds_d, done = at_finish
            acc[2] += generated_d - done  # decode time starts after the first token
            acc[3] += seconds_d
            acc[4] += done
            generated = acc[2] + acc[4]
        elif itl is not None:
            acc[2] += itl[1]
            acc[3] += itl[0]
            if s.requests_done is not None and p.requests_done is not None:
                acc[4] += s.requests_done - p.requests_done
            generated = acc[2] + acc[4]
        elif (plain := _deltas(s, p, "generation_tokens", "decode_seconds")) is not None:
            acc[2] += plain[0]
            acc[3] += plain[1]
            if s.requests_done is not None and p.requests_done is not None:
                acc[4] += s.requests_done - p.requests_done
            generated = acc[2]
        else:
            return
        first = self.decode_at == float("-inf")
        need = _MIN_DECODE_TOKENS if not first else _MIN_DECODE_TOKENS / 5
        if acc[2] >= need and acc[3] > 0:
            ref = self._ref[1]
            sample = min(_CLIP * ref, max(ref / _CLIP, acc[3] / acc[2]))
            fit = self._decode_fit
            fit.add(acc[9] / max(1.0, acc[10]), sample, first, max(1.0, acc[2]))
            self.decode_s_per_token, self.decode_slope = fit.a, fit.slope
            self.decode_at = now
            if acc[4] > 0:
                a = 1.0 if first else _ALPHA
                self.output_tokens += a * (generated / acc[4] - self.output_tokens)
            acc[2] = acc[3] = acc[4] = acc[9] = acc[10] = 0.0


_SCALE_REQUESTS = 64  # the token scale is the ratio over at least this many of the last requests, each side


class TokenScale:
    """The engine's prompt tokens per token the profile estimated (characters / ``profile.chars_per_token``).

    A real tokenizer does not make 4 characters a token: the tiny model's byte-level BPE makes 1.7 to 6 of them
    depending on the text, a code model's some other number, and the chat template adds its own tokens. Cached
    tokens, prefill seconds and KV all follow the engine's count, so the estimate is scaled by what the engine
    reported for the requests sent to it: its prompt tokens per request (``prompt_tokens`` over the requests they
    count) over the estimate per request this router sent. The engine counts a request at its first token, the
    router at its send, so the mean request of each side is compared, over the last scrapes' deltas until
    ``_SCALE_REQUESTS`` requests are behind each side (from the first request on: a scale from one request beats
    none). Clipped to [1/8, 8]; 1 until learned."""

    __slots__ = ("value", "sent_tokens", "sent_requests", "_prev", "_windows", "_sums", "learned")

    def __init__(self) -> None:
        self.value = 1.0
        self.learned = False
        self.sent_tokens = 0.0  # estimated prompt tokens of the requests this router sent (not provisional ones)
        self.sent_requests = 0
        self._prev: tuple[float, float, float, int] | None = None
        self._windows: deque[tuple[float, ...]] = deque()  # per scrape: the four deltas
        self._sums = [0.0] * 4  # engine tokens, engine requests, sent tokens, sent requests over _windows

    def sent(self, estimated_tokens: int) -> None:
        self.sent_tokens += estimated_tokens
        self.sent_requests += 1

    def update(self, s: LoadSample) -> None:
        if s.prompt_tokens is None or s.prompt_requests is None:
            return
        cur = (s.prompt_tokens, s.prompt_requests, self.sent_tokens, self.sent_requests)
        p, self._prev = self._prev, cur
        if p is None:
            return
        if cur[0] < p[0] or cur[1] < p[1]:  # the replica restarted: its counters began again
            return
        delta = tuple(c - q for c, q in zip(cur, p))
        if not any(delta):
            return
        sums, w = self._sums, self._windows
        w.append(delta)
        for i in range(4):
            sums[i] += delta[i]
        while w and sums[1] - w[0][1] >= _SCALE_REQUESTS and sums[3] - w[0][3] >= _SCALE_REQUESTS:
            old = w.popleft()
            for i in range(4):
                sums[i] -= old[i]
        if len(w) > 10_000:  # traffic that one side never sees (another router's): bounded all the same
            old = w.popleft()
            for i in range(4):
                sums[i] -= old[i]
        if min(sums) <= 0:
            return
        self.value = min(8.0, max(0.125, (sums[0] / sums[1]) / (sums[2] / sums[3])))
        self.learned = True


def _deltas(s: LoadSample, p: LoadSample, *names: str) -> tuple[float, ...] | None:
    """Each counter's change from scrape ``p`` to scrape ``s``; None when either lacks one of them."""
    now, before = [getattr(s, a) for a in names], [getattr(p, a) for a in names]
    if None in now or None in before:
        return None
    return tuple(a - b for a, b in zip(now, before))


def effective_rates(rates: list[Rates], now: float, fresh_s: float, batches: "list[float] | None" = None,
                    peers: "list[Rates] | None" = None) -> tuple[list[float], list[float]]:
    """(prefill tokens/s, decode s/token) to price each replica with, beside ``batches[i]`` requests running on
    each (its last scrape's ``num_requests_running``: the statistic ``BatchFit`` learned against; None: batch 0).
    The decode rate is read at the batch; the prefill rate at none: vLLM computes the prompts waiting at a replica
    first come first served within each step's token budget (chunked prefill), so a prompt decided beside others waits
    for theirs, which the queue ahead already holds, and is then computed at the engine's rate; read at the batch
    too, the prompts sharing its steps counted twice (docs/routing.md, "The queue counted once").

    A replica's own rate counts while it is fresh (sampled within ``fresh_s``). One never measured is
    priced as the slowest measured one: nothing says its hardware is theirs, and a long prompt sent
    to a replica 2.5x slower than predicted waits 2.5x as long (the error is only in one direction worth
    guarding). One without a fresh sample (idle since) is priced at the fleet's level now times how it
    compared with the others when it was last measured (``Rates.prefill_rel``): its absolute number was
    measured under its last load and would otherwise hold forever (a bad number never gets the traffic
    that would correct it), but its speed relative to the fleet is its hardware's, which idling does not
    change. Priced at the peers' mean alone, a replica 2.5x slower than the rest looked as fast as them
    whenever it had been idle a minute, and took the long first turns that made the fleet's tail
    (docs/routing.md "Mixed speeds"). ``peers``: replicas of the same model priced elsewhere (a prefill leg's
    decode replica), whose measured rates count for one never measured here.
    """
    since = now - fresh_s
    prefill = _priced(rates, since, "prefill_tokens_per_s", "prefill_at", "prefill_rel", min, peers)
    decode = _priced(rates, since, "decode_s_per_token", "decode_at", "decode_rel", max, peers)
    if batches is None:
        return prefill, decode
    # each replica's decode at its batch, no further than the batches its samples saw (a line fitted over 1-4
    # requests says nothing of 40); one never measured slows as the measured ones do (the same engine, most likely)
    never = float("-inf")
    measured = [r for r in [*rates, *(peers or ())] if r.prefill_at != never and r.decode_at != never]
    # once per decision, not per replica never measured (300 of them at start); counted among ``rates`` alone: the
    # peers may outnumber them (one prefill replica never measured beside two measured decode ones)
    if any(r.prefill_at == never or r.decode_at == never for r in rates):
        kd = sum(m.decode_slope for m in measured) / len(measured) if measured else 0.0
        top = min((m._prefill_fit.top for m in measured), default=0.0)
    out_d = []
    for y, r, b in zip(decode, rates, batches):
        if r.prefill_at == never or r.decode_at == never:
            out_d.append(y * (1.0 + kd * min(b, top)))
        else:
            out_d.append(y * (1.0 + r.decode_slope * min(b, r._decode_fit.top)))
    return prefill, out_d


def _priced(rates: list[Rates], since: float, value: str, at: str, rel: str, slowest,
            peers: "list[Rates] | None" = None) -> list[float]:
    """One rate of each replica as effective_rates prices it (``slowest``: min for a speed, max for a time).

    A rate is its replica's hardware factor (``rel``) times a level all replicas share (the load they run at):
    the level now is the fresh replicas' mean of rate / factor, and a replica's factor is set when it takes a new
    sample, against the level then (a mean of raw rates would shift with which replicas happen to be fresh: the
    slow ones alone made every factor 1)."""
    rel_at = rel + "_at"
    never = float("-inf")
    fresh = [r for r in rates if getattr(r, at) >= since]
    if not fresh:
        # none sampled lately: each its last rate, and one never measured still as the slowest measured one (at its
        # prior it was 19x slower than its peers on a time-compressed fleet: a turn moved off its home to a measured
        # one; prefill replicas, which see few and short requests, stayed at it and no prompt went to them)
        known = [getattr(r, value) for r in [*rates, *(peers or ())] if getattr(r, at) != never]
        if not known:
            return [getattr(r, value) for r in rates]
        k = slowest(known)
        return [k if getattr(r, at) == never else getattr(r, value) for r in rates]
    level = sum(getattr(r, value) / getattr(r, rel) for r in fresh) / len(fresh)
    for r in fresh:  # new samples, each against the level before any of them moved it (order-free)
        if getattr(r, rel_at) != getattr(r, at):
            setattr(r, rel, getattr(r, value) / level)
            setattr(r, rel_at, getattr(r, at))
    level = sum(getattr(r, value) / getattr(r, rel) for r in fresh) / len(fresh)
    out = [getattr(r, value) if getattr(r, at) >= since else None if getattr(r, at) == never
           else level * getattr(r, rel) for r in rates]
    known = slowest(x for x in out if x is not None)
    return [known if x is None else x for x in out]
