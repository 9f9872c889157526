"""The peers the simulator compares warmroute with, modelled from their own source with their shipped defaults (file
named in each class), and the oracle (``policies``' docstring says how they see the fleet)."""

from __future__ import annotations

import bisect
import hashlib
import math
import random

from extproc.core import LoadSample
from extproc.core.blocks import BLOCK_TOKENS as BLOCK
from extproc.tools.workload.generate import Request

from extproc.tools.sim.policy_base import HOLD, REFUSED, Policy


class RoundRobin(Policy):
    name = "envoy_round_robin"

    def __init__(self, n: int, seed: int):
        super().__init__(n, seed)
        self.next = 0

    def choose(self, req, now, exclude=frozenset()):
        for _ in range(self.n):
            i = self.next
            self.next = (self.next + 1) % self.n
            if i not in exclude:
                return i
        return None


class LeastRequest(Policy):
    """Envoy's LEAST_REQUEST: two random choices, the one with fewer active requests wins."""

    name = "envoy_least_request"

    def choose(self, req, now, exclude=frozenset()):
        return self.two_choices(exclude)


def _session_hash(req: Request) -> int:
    return int.from_bytes(hashlib.md5(f"s{req.sid}".encode()).digest()[:8], "big")


class RingHash(Policy):
    """Envoy's RING_HASH on the session header (a one-shot has its own key), 100 virtual nodes a host.

    With ``hash_balance_factor`` it is Envoy's bounded-load variant (envoyproxy/envoy,
    ``source/extensions/load_balancing_policies/common/thread_aware_lb_impl.cc``,
    ``BoundedLoadHashingLoadBalancer``): a host may hold ``slots = max(1, ceil(ceil((active + 1) x
    factor / 100) / n))`` active requests; a full host passes the request on by a random jump seeded
    by the hash, else the least overloaded host takes it.
    """

    name = "envoy_ring_hash"

    def __init__(self, n: int, seed: int, vnodes: int = 100, hash_balance_factor: int | None = None):
        super().__init__(n, seed)
        ring = []
        for i in range(n):
            for v in range(vnodes):
                ring.append((int.from_bytes(hashlib.md5(f"r{i}-{v}".encode()).digest()[:8], "big"), i))
        ring.sort()
        self.keys = [k for k, _ in ring]
        self.owners = [o for _, o in ring]
        self.factor = hash_balance_factor
        if hash_balance_factor:
            self.name = f"envoy_ring_hash_bounded_{hash_balance_factor}"

    def _ring_host(self, h: int, exclude) -> int | None:
        j = bisect.bisect(self.keys, h)
        for k in range(len(self.keys)):
            o = self.owners[(j + k) % len(self.keys)]
            if o not in exclude:
                return o
        return None

    def _overload(self, i: int, hosts: int, active: int) -> float:
        total_slots = -(-((active + 1) * self.factor) // 100)
        slots = max(1, math.ceil(total_slots / hosts))
        return self.in_flight[i] / slots

    def choose(self, req, now, exclude=frozenset()):
        h = _session_hash(req)
        host = self._ring_host(h, exclude)
        if host is None or not self.factor:
            return host
        hosts = self.pool(exclude)
        # a model's own cluster counts its own requests; otherwise (a retry) the one cluster's
        active = sum(self.in_flight[h] for h in hosts) if req.pool is not None else sum(self.in_flight)
        f = self._overload(host, len(hosts), active)
        if f <= 1.0:
            return host
        rng = random.Random(h)
        order = hosts[:]
        rng.shuffle(order)
        best, best_f = host, f
        for alt in order:
            if alt == host:
                continue
            fa = self._overload(alt, len(hosts), active)
            if fa <= 1.0:
                return alt
            if fa < best_f:
                best, best_f = alt, fa
        return best


class _BlockTrees:
    """Per worker, the blocks routed there (an approximate prefix tree at 16-token granularity)."""

    def __init__(self, n: int):
        self.sets: list[dict[int, float]] = [dict() for _ in range(n)]

    def match(self, i: int, blocks: list[int]) -> int:
        s = self.sets[i]
        k = 0
        for b in blocks:
            if b not in s:
                break
            k += 1
        return k

    def insert(self, i: int, blocks: list[int], now: float) -> None:
        self.sets[i].update(dict.fromkeys(blocks, now))


class SGLangCacheAware(Policy):
    """SGLang router ``cache_aware`` (sgl-project/sglang, ``sgl-router/src/policies/cache_aware.rs``),
    CLI defaults: cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5; eviction of
    trees down to max_tree_size 2^26 characters (never reached here).

    Imbalanced (max - min load > 64 and max > 1.5 x min, load = the router's own in-flight requests):
    the shortest queue. Otherwise the worker whose tree matches most of the text if the match rate is
    above 0.3, else the worker with the smallest tree. The text goes into the chosen worker's tree.
    The tree is of characters; here of 16-token blocks, the workload's unit of text.
    """

    name = "sglang_cache_aware"

    def __init__(self, n: int, seed: int, cache_threshold: float = 0.3, abs_threshold: int = 64,
                 rel_threshold: float = 1.5):
        super().__init__(n, seed)
        self.trees = _BlockTrees(n)
        self.cache_threshold = cache_threshold
        self.abs_threshold = abs_threshold
        self.rel_threshold = rel_threshold

    def choose(self, req, now, exclude=frozenset()):
        pool = self.pool(exclude)
        if not pool:
            return None
        blocks = req.blocks()
        loads = [self.in_flight[i] for i in pool]
        if max(loads) - min(loads) > self.abs_threshold and max(loads) > min(loads) * self.rel_threshold:
            i = min(pool, key=lambda k: self.in_flight[k])
        else:
            matches = {i: self.trees.match(i, blocks) for i in pool}
            best = max(pool, key=lambda k: matches[k])
            if blocks and matches[best] / len(blocks) > self.cache_threshold:
                i = best
            else:
                i = min(pool, key=lambda k: len(self.trees.sets[k]))
        self.trees.insert(i, blocks, now)
        return i


class LlmdEndpointPicker(Policy):
    """llm-d's default endpoint-picker scoring from 2025 until mid-2026
    (kubernetes-sigs/gateway-api-inference-extension,
    ``pkg/epp/config/loader/defaults.go``; scorers under ``pkg/epp/scheduling/framework/plugins/``):
    prefix-cache 3, queue 2, kv-cache-utilization 2, max-score picker (ties random); metrics every 50 ms.

    prefix = matched blocks / total blocks of an approximate per-pod LRU index (updated for the chosen
    pod after scheduling, capacity from ``vllm:cache_config_info``); queue = (maxQ - q) / (maxQ - minQ),
    1 when all are equal; kv = 1 - usage.
    """

    name = "llmd_epp_2025"
    load_refresh_s = 0.05

    def __init__(self, n: int, seed: int, cache_tokens: int = 300_000, lora_weight: float = 0.0):
        super().__init__(n, seed)
        from extproc.core import PrefixIndex

        self.index = [PrefixIndex(cache_tokens // BLOCK) for _ in range(n)]
        self.waiting = [0] * n
        self.kv = [0.0] * n
        # lora-affinity-scorer (GIE pkg/epp/scheduling/framework/plugins/scorer/lora_affinity.go): 1.0 where the
        # adapter is active, 0.8 where active + waiting adapters < max, 0.6 where it waits, else 0. KServe's
        # LLMInferenceService adds it at weight 4 when the service declares adapters (0: not configured)
        self.lora_weight = lora_weight
        if lora_weight:
            self.name = "llmd_epp_lora"
        self.lora: list[LoadSample | None] = [None] * n

    def _lora_score(self, i: int, adapter: str | None) -> float:
        s = self.lora[i]
        if adapter is None or s is None:
            return 0.0
        active, waiting = s.lora_running or frozenset(), s.lora_waiting or frozenset()
        if adapter in active:
            return 1.0
        if len(active) + len(waiting) < (s.max_lora or 0):
            return 0.8
        return 0.6 if adapter in waiting else 0.0

    def on_load(self, i, sample, now):
        self.waiting[i] = sample.waiting
        self.kv[i] = sample.kv_usage
        if sample.max_lora is not None:
            self.lora[i] = sample
        if sample.cache_tokens and self.index[i].capacity != sample.cache_tokens // BLOCK:
            self.index[i].resize(sample.cache_tokens // BLOCK)

    def choose(self, req, now, exclude=frozenset()):
        pool = self.pool(exclude)
        if not pool:
            return None
        blocks = req.blocks()
        qs = [self.waiting[i] for i in pool]
        qmax, qmin = max(qs), min(qs)
        best, best_score = [], -1.0
        for i in pool:
            prefix = self.index[i].match(blocks) / len(blocks) if blocks else 0.0
            queue = 1.0 if qmax == qmin else (qmax - self.waiting[i]) / (qmax - qmin)
            score = 3 * prefix + 2 * queue + 2 * (1 - self.kv[i])
            if self.lora_weight:
                score += self.lora_weight * self._lora_score(i, req.adapter)
            if score > best_score + 1e-12:
                best, best_score = [i], score
            elif abs(score - best_score) <= 1e-12:
                best.append(i)
        i = self.rng.choice(best)
        self.index[i].insert(blocks)
        return i


class LlmdTokenAware(LlmdEndpointPicker):
    """llm-d's default since mid-2026, "sticky until saturated" (llm-d ``guides/optimized-baseline``; llm-d-router
    ``pkg/epp/framework/plugins/scheduling/filter/prefixcacheaffinity/plugin.go``, ``scorer/tokenload/token_load.go``,
    ``requestcontrol/dataproducer/inflightload/``; Dynamo's port ``llm-d-optimized-baseline``). The approximate prefix
    index is ``llmd_epp_2025``'s. An endpoint is sticky when the share of the prompt's blocks it holds is at least 0.8
    (``affinityThreshold``); only the sticky ones stay, unless the best sticky one's estimated TTFT (its in-flight
    tokens / ``peakPrefillThroughput``) passes the best other's by more than ``maxTTFTPenaltyMs`` (18,000 ms). Then
    ``token-load-scorer``: 1 - min(1, (in-flight tokens + this request's uncached tokens there) / 4,194,304), the
    highest wins, ties random. In-flight tokens: the uncached prompt tokens of the requests sent to an endpoint, from
    dispatch to their first streamed token (``addEstimatedOutputTokens`` off, its default).
    ``peakPrefillThroughput`` is calibrated on the simulated engine as llm-d's recipe does (B over the time to first
    token of a cold B-token prompt alone, B = 8,192): its default, 15,928 tok/s, is Qwen3-32B's on two H100s, and the
    guide says to measure it for other hardware."""

    name = "llmd_token_aware"
    AFFINITY, PENALTY_S, QUEUE_TOKENS, CALIBRATION_TOKENS = 0.8, 18.0, 4_194_304, 8192

    def __init__(self, n: int, seed: int, cache_tokens: int = 300_000):
        super().__init__(n, seed, cache_tokens)
        from extproc.tools.engine.model import EngineConfig

        e = EngineConfig()
        b = self.CALIBRATION_TOKENS
        steps = -(-b // e.max_num_batched_tokens)
        self.peak_tps = b / (steps * (e.step_base_s + e.step_per_seq_s) + b * e.prefill_s_per_token)
        self.tokens = [0] * n  # in-flight uncached prompt tokens per endpoint
        self.charged: dict[int, tuple[int, int]] = {}  # request id -> (endpoint, tokens) until its first token

    def choose(self, req, now, exclude=frozenset()):
        self._release(req)  # a retry's earlier pick carries nothing any more
        pool = self.pool(exclude)
        if not pool:
            return None
        blocks = req.blocks()
        full = req.prompt_tokens // BLOCK  # llm-d measures the share against complete blocks only
        matched = {i: self.index[i].match(blocks) for i in pool}
        sticky = [i for i in pool if full and matched[i] / full >= self.AFFINITY]
        others = [i for i in pool if i not in sticky]
        keep = pool
        if sticky:
            keep = sticky
            if others:
                ttft = lambda i: self.tokens[i] / self.peak_tps  # noqa: E731
                if min(map(ttft, sticky)) - min(map(ttft, others)) > self.PENALTY_S:
                    keep = pool
        uncached = {i: max(0, req.prompt_tokens - matched[i] * BLOCK) for i in keep}
        score = {i: 1.0 - min(1.0, (self.tokens[i] + uncached[i]) / self.QUEUE_TOKENS) for i in keep}
        top = max(score.values())
        i = self.rng.choice([k for k in keep if score[k] >= top - 1e-12])
        self.index[i].insert(blocks)
        self.tokens[i] += uncached[i]
        self.charged[req.rid] = (i, uncached[i])
        return i

    def first_token(self, req, now):
        self._release(req)

    def done(self, req, now):
        super().done(req, now)
        self._release(req)  # one that failed before its first token

    def _release(self, req) -> None:
        got = self.charged.pop(req.rid, None)
        if got is not None:
            self.tokens[got[0]] -= got[1]


class LlmdPrecise(LlmdEndpointPicker):
    """llm-d's precise prefix-cache scorer as its guide configures it (llm-d ``guides/precise-prefix-cache-aware``:
    precise-prefix-cache-scorer 3, kv-cache-utilization-scorer 2, queue-scorer 2, max-score picker;
    ``speculativeIndexing: true``). The prompt's blocks in the engine's own tokens (its tokenizer sidecar); each
    pod's score is the longest run of them its engine holds by its KV events, or that a speculative entry (a
    request sent there in the last 2 s, ``speculativeTTL``) says it will; scores are min-max normalized over the
    pods that hold any (``indexedScoresToNormalizedScoredPods``: 1 when they are equal, 0 for a pod that holds
    none)."""

    name = "llmd_precise"

    def __init__(self, n: int, seed: int):
        super().__init__(n, seed)
        from extproc.tools.sim.truth import Speculative

        self.speculative = [Speculative() for _ in range(n)]

    def attach(self, sim):
        self.sim = sim

    def choose(self, req, now, exclude=frozenset()):
        pool = self.pool(exclude)
        if not pool:
            return None
        blocks = req.blocks()[: req.prompt_tokens // BLOCK]
        held = {i: self.speculative[i].run(self.sim.engines[i], blocks, now) for i in pool}
        hits = [v for v in held.values() if v > 0]
        lo, hi = (min(hits), max(hits)) if hits else (0, 0)
        qs = [self.waiting[i] for i in pool]
        qmax, qmin = max(qs), min(qs)
        best, best_score = [], -1.0
        for i in pool:
            prefix = 0.0 if not held[i] else 1.0 if hi == lo else (held[i] - lo) / (hi - lo)
            queue = 1.0 if qmax == qmin else (qmax - self.waiting[i]) / (qmax - qmin)
            score = 3 * prefix + 2 * queue + 2 * (1 - self.kv[i])
            if score > best_score + 1e-12:
                best, best_score = [i], score
            elif abs(score - best_score) <= 1e-12:
                best.append(i)
        i = self.rng.choice(best)
        self.speculative[i].add(blocks, now)
        return i


class LlmdFlowControl(LlmdEndpointPicker):
    """llm-d's flow control in front of its default picker, with its shipped defaults (GIE
    ``pkg/epp/flowcontrol/``: ``controller/internal/processor.go``, ``filter.go``; ``saturationdetector``; PEERS.md
    "Flow control as the peers ship it"). Every request enters the queue; a dispatch loop takes the head of the
    highest non-empty priority band (global-strict fairness: one FCFS queue per band) whenever the pool is not
    saturated, and the picker then scores the endpoints as ``llmd_epp_2025`` does. Saturation: per endpoint
    max(waiting / 5, KV usage / 0.8), 1 for an endpoint whose metrics are older than 200 ms; the pool's is the mean,
    saturated at >= 1. Dispatches between two 50 ms metric refreshes are not counted (the detector reads scraped
    queues only). Queued past the 60 s TTL: 429 ``rejected-ttl-expired`` (the client retries after Retry-After
    like every client here); band capacity (5,000 requests, 1 GB) is never reached by these workloads. Bands:
    critical above standard above sheddable (priority < 0)."""

    name = "llmd_epp_flowcontrol"
    QUEUE_DEPTH, KV_UTIL, STALE_S, TTL_S = 5, 0.8, 0.2, 60.0

    def __init__(self, n: int, seed: int):
        super().__init__(n, seed)
        self.seen = [float("-inf")] * n  # when each endpoint's metrics were last refreshed
        self.bands: list[list[tuple[float, Request, frozenset[int]]]] = [[], [], []]  # per class, FCFS
        self._out: list[tuple[Request, int | None]] = []

    def on_load(self, i, sample, now):
        super().on_load(i, sample, now)
        self.seen[i] = now

    def saturated(self, now: float, exclude: frozenset[int] = frozenset()) -> bool:
        pool = self.pool(exclude)
        if not pool:
            return True
        score = sum(1.0 if now - self.seen[i] > self.STALE_S
                    else max(self.waiting[i] / self.QUEUE_DEPTH, self.kv[i] / self.KV_UTIL) for i in pool)
        return score / len(pool) >= 1.0

    def choose(self, req, now, exclude=frozenset()):
        if not any(self.bands) and not self.saturated(now, exclude):
            return super().choose(req, now, exclude)
        self.bands[req.klass].append((now, req, exclude))
        self._dispatch(now)
        for k, (r, i) in enumerate(self._out):
            if r is req:  # dispatched at once after all: answered here, not from take_ready
                del self._out[k]
                return i
        return HOLD

    def _dispatch(self, now: float) -> None:
        for band in self.bands:
            while band and now - band[0][0] > self.TTL_S:
                self._out.append((band.pop(0)[1], REFUSED))
        while any(self.bands):
            band = next(b for b in self.bands if b)
            _, req, exclude = band[0]
            if self.saturated(now, exclude):
                return
            band.pop(0)
            self._out.append((req, super().choose(req, now, exclude)))

    def holds(self) -> bool:
        return any(self.bands) or bool(self._out)

    def take_ready(self, now):
        self._dispatch(now)
        out, self._out = self._out, []
        return out


class DynamoKvRouter(Policy):
    """NVIDIA Dynamo's KV router (ai-dynamo/dynamo, ``lib/llm/src/kv_router/``,
    ``docs/architecture/kv_cache_routing.md``): ``logit = overlap_score_weight x prefill_blocks +
    decode_blocks``, weight 1.0, temperature 0 (argmin; ties: smallest tree, then random).
    prefill_blocks = uncached prompt blocks; decode_blocks = blocks of the requests active on the
    worker (tracked by the router from its own routing, released when a request ends). Without KV
    events its cache view is approximate: blocks routed to a worker, kept 120 s.
    """

    name = "dynamo_kv"

    def __init__(self, n: int, seed: int, overlap_weight: float = 1.0, ttl_s: float = 120.0):
        super().__init__(n, seed)
        self.trees = _BlockTrees(n)
        self.overlap_weight = overlap_weight
        self.ttl_s = ttl_s
        self.active_blocks = [0] * n
        self._next_expiry = 0.0

    def tick(self, now):
        if now >= self._next_expiry:
            self._next_expiry = now + 10.0
            limit = now - self.ttl_s
            for s in self.trees.sets:
                for k in [k for k, t in s.items() if t < limit]:
                    del s[k]

    def choose(self, req, now, exclude=frozenset()):
        pool = self.pool(exclude)
        if not pool:
            return None
        blocks = req.blocks()
        limit = now - self.ttl_s
        best, best_key = [], None
        for i in pool:
            s = self.trees.sets[i]
            k = 0
            for b in blocks:
                t = s.get(b)
                if t is None or t < limit:
                    break
                k += 1
            logit = self.overlap_weight * (len(blocks) - k) + self.active_blocks[i]
            key = (logit, len(s))
            if best_key is None or key < best_key:
                best, best_key = [i], key
            elif key == best_key:
                best.append(i)
        i = self.rng.choice(best)
        self.trees.insert(i, blocks, now)
        return i

    def start(self, req, i, now):
        super().start(req, i, now)
        req.extra["dynamo_blocks"] = -(-req.prompt_tokens // BLOCK)
        self.active_blocks[i] += req.extra["dynamo_blocks"]

    def done(self, req, now):
        if req.replica is not None:
            self.active_blocks[req.replica] -= req.extra.pop("dynamo_blocks", 0)
        super().done(req, now)


class _DecodeHit:
    """A P/D peer's decider reads the decode replica's prefix match as its scorer saw it: before this request's own
    blocks were recorded there."""

    def _match_before(self, k: int, blocks: list[int], now: float) -> int:
        raise NotImplementedError

    def choose(self, req, now, exclude=frozenset()):
        blocks = req.blocks()
        before = {k: self._match_before(k, blocks, now) for k in self.pool(exclude)}
        i = super().choose(req, now, exclude)
        if i is not None:
            self.hit[req.rid] = before.get(i, 0)
        return i


class LlmdDisaggregated(_DecodeHit, LlmdEndpointPicker):
    """llm-d's prefill/decode disaggregation (llm-d-inference-scheduler ``pkg/plugins/profile``: the decode profile
    first, then ``prefix-based-pd-decider``, then the prefill profile; its guide's config ships ``nonCachedTokens:
    16``): the decode pod by the default scorers among role decode; a prefill leg whenever the decode pod's
    uncached prompt (the prompt's bytes / 4 less its approximate prefix index's match) is 16 tokens or more, to the
    prefill pod the same scorers pick among role prefill (its own index: what its prefills computed)."""

    name = "llmd_pd"
    NON_CACHED_TOKENS = 16

    def __init__(self, n: int, seed: int):
        super().__init__(n, seed)
        self.hit: dict[int, int] = {}

    def _match_before(self, k, blocks, now):
        return self.index[k].match(blocks)

    def prefill_for(self, req, i, now, prefills):
        hit = self.hit.pop(req.rid, 0) * BLOCK
        if not prefills or req.estimated()[0] - hit < self.NON_CACHED_TOKENS:
            return None
        saved, self.pool = self.pool, lambda exclude: list(prefills)  # the prefill profile: its filter, same scorers
        try:
            return super().choose(req, now)
        finally:
            self.pool = saved


class DynamoDisaggregated(_DecodeHit, DynamoKvRouter):
    """NVIDIA Dynamo's conditional disaggregation with vLLM workers (``DisaggregatedRouter.prefill_remote``: the
    prompt less the decode worker's prefix hit above ``max_local_prefill_length``, 1000 by default; and the prefill
    queue shorter than ``max_prefill_queue_size``, 2 in its configs): the decode worker by the KV router, the prefill
    leg to the prefill worker that pulls it first from the shared queue (the least busy)."""

    name = "dynamo_pd"
    MAX_LOCAL_PREFILL = 1000
    MAX_QUEUE = 2

    def __init__(self, n: int, seed: int):
        super().__init__(n, seed)
        self.hit: dict[int, int] = {}

    def attach(self, sim):
        self.sim = sim

    def _match_before(self, k, blocks, now):
        s, limit, m = self.trees.sets[k], now - self.ttl_s, 0
        for b in blocks:
            t = s.get(b)
            if t is None or t < limit:
                break
            m += 1
        return m

    def prefill_for(self, req, i, now, prefills):
        hit = self.hit.pop(req.rid, 0) * BLOCK
        if not prefills or req.prompt_tokens - hit <= self.MAX_LOCAL_PREFILL:
            return None
        engines = self.sim.engines
        if sum(engines[p].num_waiting for p in prefills) >= self.MAX_QUEUE:
            return None
        return min(prefills, key=lambda p: (engines[p].num_waiting, engines[p].num_running, p))


class Oracle(Policy):
    """Not a peer: reads each engine's true cache and queue, sends each request where its true time to
    first token is least (greedy). Marks how close a router that only sees metrics can get."""

    name = "oracle"

    def attach(self, sim):
        self.sim = sim

    def choose(self, req, now, exclude=frozenset()):
        blocks = req.blocks()
        best, best_t = None, float("inf")
        for i, eng in enumerate(self.sim.engines):
            if i in exclude or not self.sim.alive[i]:
                continue
            hit = 0
            full = req.prompt_tokens // BLOCK
            for b in blocks[:full]:
                if b in eng.refs or b in eng.cached:
                    hit += 1
                else:
                    break
            ahead = sum(r.prompt_tokens - r.computed for r in eng.running if r.computed < r.prompt_tokens)
            ahead += sum(r.prompt_tokens for r in eng.waiting)
            per_tok = eng.cfg.prefill_s_per_token
            t = (ahead + req.prompt_tokens - min(hit * BLOCK, req.prompt_tokens - 1)) * per_tok
            t += eng.cfg.step_per_seq_s * len(eng.running)
            if t < best_t:
                best, best_t = i, t
        if best is None:
            pool = self.pool(exclude)
            return self.rng.choice(pool) if pool else None
        return best
