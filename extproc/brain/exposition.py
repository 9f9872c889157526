"""What a replica answers, read: its /metrics in an engine's dialect (vLLM's, SGLang's), its /v1/models and its
/openapi.json, each bounded in what it may cost and keep, whatever the replica (or whoever answers in its place)
sends. Pure text in, values out: the scrape loop (``scraper``) and the tools that read engines share it.

The parser reads only the series the router uses, line by line (the text of a vLLM with histograms runs to tens
of KiB; a full Prometheus parse of it at 2 Hz per replica would cost more than the routing). A value that is not a
finite number in its sane range makes the scrape fail with the reason: a replica that reports nonsense is not
believed, and is not routed to either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import orjson

from ..core import LoadSample
from ..core.models import MAX_PATH_CHARS, MAX_PATHS


@dataclass(frozen=True, eq=False)  # hashed by identity: one wanted-name set per dialect
class Dialect:
    """The metric names of one engine's /metrics: the same load signals under each engine's names."""

    running: str
    waiting: str
    kv: tuple[str, ...]  # KV-cache usage, 0..1 (several: the highest of those present)
    counters: dict[str, str]  # counter -> LoadSample field, summed over every label set
    cache_info: str | None = None  # an info metric whose labels give the cache size (vLLM)
    cache_tokens: str | None = None  # a gauge whose value is the cache size in tokens (SGLang)
    # (metric, label, value) of a counter read from one label set only -> the LoadSample field it feeds
    by_label: dict[tuple[str, str, str], str] = field(default_factory=dict)
    # a label whose values other than "0" mark copies of the same numbers (SGLang's tp_rank: with
    # --enable-metrics-for-all-schedulers every tensor-parallel rank exports its scheduler's gauges and counters)
    copy_label: str | None = None
    # the label that tells data-parallel engines apart (each has its own scheduler and KV cache)
    engine_label: str | None = None
    # older names of a counter, read only when the current name is absent (vLLM 0.9 exported both)
    fallback: dict[str, str] = field(default_factory=dict)
    lora_info: str | None = None  # an info gauge of the adapters in use, its newest label set the present one
    # counters that move whenever the engine works (first tokens, streamed tokens, finished requests); a dialect
    # that names them has gauges that move only at some scheduler steps (SGLang): see Scraper.unstale
    activity: tuple[str, ...] = ()
    # the LoadSample count of the requests whose tokens prompt_tokens holds (vLLM counts them at the first token,
    # SGLang when the request finishes): the prefill rate pairs the mean request of each side
    prompt_counted: str = "first_tokens"
    name: str = ""
    # what a /metrics without this engine's metrics most likely means, said in the scrape reason
    missing_hint: str = ""
    # families read when there, which only an optional part of the engine exports (an offloading connector)
    optional: frozenset[str] = frozenset()

    def wanted(self) -> frozenset[str]:
        return frozenset((self.running, self.waiting, *self.kv, *self.counters, *(k[0] for k in self.by_label),
                          *self.fallback, *self.activity,
                          *(n for n in (self.cache_info, self.cache_tokens, self.lora_info) if n)))


VLLM = Dialect(
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    kv=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),  # renamed in vLLM 0.10; accept both
    counters={
        "vllm:prompt_tokens_total": "prompt_tokens",
        "vllm:prefix_cache_hits_total": "cached_tokens",
        "vllm:request_prefill_time_seconds_sum": "prefill_seconds",
        "vllm:generation_tokens_total": "generation_tokens",
        "vllm:request_decode_time_seconds_sum": "decode_seconds",
        "vllm:e2e_request_latency_seconds_count": "requests_done",
        "vllm:time_to_first_token_seconds_count": "first_tokens",
        "vllm:request_prefill_time_seconds_count": "prefill_done",
        "vllm:request_prefill_kv_computed_tokens_sum": "computed_at_finish",
        "vllm:request_generation_tokens_sum": "generated_at_finish",
        "vllm:request_decode_time_seconds_count": "decode_done",
        # an offloading connector's seconds loading KV into the GPU (vLLM's OffloadingConnector; none without one)
        "vllm:kv_offload_load_time_total": "restore_seconds",
    },
    fallback={"vllm:gpu_prefix_cache_hits_total": "cached_tokens"},
    cache_info="vllm:cache_config_info",
    lora_info="vllm:lora_requests_info",
    by_label={("vllm:prompt_tokens_by_source_total", "source", "local_compute"): "computed_tokens",
              ("vllm:prompt_tokens_by_source_total", "source", "external_kv_transfer"): "restored_tokens"},
    engine_label="engine",
    name="vllm",
    optional=frozenset({"vllm:kv_offload_load_time_total"}),
    # vLLM's async_llm.py builds its stat loggers only when log_stats is on: --disable-log-stats leaves /metrics
    # with the process and HTTP metrics and no vllm:* engine metrics
    missing_hint="a vLLM started with --disable-log-stats exports no engine metrics: drop the flag, or set the "
                 "replica's engine: none (or auto)",
)
# sgl-project/sglang python/sglang/srt/metrics/collector.py (docs/references/production_metrics.md)
SGLANG = Dialect(
    running="sglang:num_running_reqs",
    waiting="sglang:num_queue_reqs",
    kv=("sglang:token_usage",),
    counters={
        "sglang:prompt_tokens_total": "prompt_tokens",
        "sglang:cached_tokens_total": "cached_tokens",
        "sglang:generation_tokens_total": "generation_tokens",
        "sglang:e2e_request_latency_seconds_count": "requests_done",
        "sglang:time_to_first_token_seconds_count": "first_tokens",
        "sglang:inter_token_latency_seconds_sum": "itl_seconds",
        "sglang:inter_token_latency_seconds_count": "itl_tokens",
    },
    cache_tokens="sglang:max_total_num_tokens",
    # newer SGLang: each request's prefill, from its entry into the running batch (req_time_stats.py)
    by_label={("sglang:per_stage_req_latency_seconds_sum", "stage", "prefill_forward"): "prefill_seconds",
              ("sglang:per_stage_req_latency_seconds_count", "stage", "prefill_forward"): "prefill_done"},
    prompt_counted="requests_done",  # TokenizerMetricsCollector.observe_one_finished_request
    copy_label="tp_rank",  # dp_rank ranks are different schedulers: those are separate engines
    engine_label="dp_rank",
    activity=("sglang:time_to_first_token_seconds_count", "sglang:inter_token_latency_seconds_count",
              "sglang:e2e_request_latency_seconds_count"),
    name="sglang",
    missing_hint="SGLang exports engine metrics only when started with --enable-metrics: add it, or set the "
                 "replica's engine: none (or auto)",
)
DIALECTS = {"vllm": VLLM, "sglang": SGLANG}
# engine "none": no load metrics; health from GET /health, load from the brain's own reservations
HEALTH_PATH = "/health"

RUNNING, WAITING, KV_NAMES, CACHE_CONFIG, COUNTERS = VLLM.running, VLLM.waiting, VLLM.kv, VLLM.cache_info, VLLM.counters
MAX_REQUESTS = 100_000  # running or waiting beyond this on one replica is a broken exporter, not load
MAX_BLOCK_TOKENS = 1 << 16  # a block_size label beyond this is not one a cache uses
MODELS_PATH = "/v1/models"
OPENAPI_PATH = "/openapi.json"  # FastAPI's (vLLM, SGLang): the routes this process registered
MAX_MODELS = 1000  # a /v1/models longer than this is not believed (a replica serves a model and its adapters)
# what of a replica's model object is kept and shown in the union (the rest is the replica's business)
MODEL_FIELDS = ("id", "object", "created", "owned_by", "root", "parent", "max_model_len")
MAX_MODEL_FIELD_CHARS = 256  # a longer id or field is not a model name: the entry (or field) is dropped
# SGLang's gauges move at prefill batches and every decode_log_interval (40) decode steps, about once a second
# under load; activity counters that stood still this long while the gauges did too mean an idle engine
IDLE_AFTER_S = 5.0


_WANTED: dict[Dialect, frozenset[str]] = {}


@dataclass
class ScrapeResult:
    ok: bool
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    error: str = ""
    sample: LoadSample | None = field(default=None, repr=False)
    missing: bool = False  # /metrics answered without this engine's metrics (another engine, or none exported)
    engine: str = ""  # engine "auto": the dialect that answered ("none": only /health did)
    activity: float | None = None  # the dialect's activity counters, summed (lazy gauges: see Scraper.unstale)


def _labels(text: str) -> dict[str, str]:
    out = {}
    for part in text.split('",'):
        k, _, v = part.partition('="')
        out[k.strip()] = v.rstrip('"')
    return out


class _Engine:
    """One data-parallel engine's gauges while a text is parsed."""

    __slots__ = ("running", "waiting", "kv", "cache_tokens", "cache_blocks", "block")

    def __init__(self) -> None:
        self.running = self.waiting = 0.0
        self.kv: list[float] = []
        self.cache_tokens: int | None = None  # its own capacity (kv_cache_size_tokens, SGLang's max_total_num_tokens)
        self.cache_blocks: int | None = None  # vLLM's num_gpu_blocks x block_size: the front end's sum over engines
        self.block: int | None = None  # vLLM's block_size: what its prefix cache holds a whole number of


def parse_vllm_metrics(text: str) -> ScrapeResult:
    return parse_metrics(text, VLLM)


MAX_SERIES = 100_000  # health.max_metrics_series
MAX_ENGINES = 128  # health.max_engines
# a page this small parses in well under a millisecond: on the event loop; a larger one in the parse thread
INLINE_PARSE_BYTES = 256 * 1024


def _is_uint(s: str) -> bool:
    """ASCII digits only: ``str.isdigit`` is also true of "²" and "٣", which ``int`` refuses."""
    return bool(s) and len(s) <= 18 and s.isascii() and s.isdigit()


def parse_metrics(text: str, d: Dialect, max_series: int = MAX_SERIES, max_engines: int = MAX_ENGINES) -> ScrapeResult:
    """The load signals of one replica, or a failed result saying what was wrong with the text.

    Bounded in what it costs, not only in bytes: more than ``max_series`` sample lines, or more than
    ``max_engines`` data-parallel engines, fail the scrape at once with the cap named (90,000 engines took the
    brain to 937 MB and each decision to 80 ms)."""
    wanted = _WANTED.get(d) or _WANTED.setdefault(d, d.wanted())
    lines = text.count("\n")
    if lines > max_series:  # counted in C before any line is split: an upper bound on the series
        comments = text.count("\n#") + text.startswith("#")
        if lines - comments > max_series:
            return ScrapeResult(False, error=f"/metrics has {lines - comments:,} series: more than {max_series:,} "
                                             f"(health.max_metrics_series)")
    engines: dict[str, _Engine] = {}
    counters: dict[str, Any] = {}
    fallback: dict[str, float] = {}
    activity = 0.0
    lora: tuple[float, dict[str, str]] | None = None
    prefix_caching = None
    seen = False
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if space < 0:
            return ScrapeResult(False, error=f"unparsable metrics line: {line[:80]!r}")
        end = brace if 0 <= brace < space else space
        name = line[:end]
        if name not in wanted:
            continue
        lab = _labels(line[brace + 1:line.rfind("}")]) if brace == end else {}
        if d.copy_label is not None and lab.get(d.copy_label, "0") != "0":
            continue  # the same scheduler's numbers once more, from another tensor-parallel rank
        rest = line[line.rfind("}") + 1:] if brace == end else line[end:]
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            return ScrapeResult(False, error=f"unparsable value of {name}")
        if not math.isfinite(value) or value < 0:
            return ScrapeResult(False, error=f"{name} is {value}: not a finite number >= 0")
        if name in d.activity:
            activity += value
        if name == d.lora_info:
            if lora is None or value >= lora[0]:
                lora = (value, lab)
            continue
        if name == d.running or name == d.waiting or name in d.kv or name == d.cache_info or name == d.cache_tokens:
            key = lab.get(d.engine_label, "0") if d.engine_label else "0"
            e = engines.get(key)
            if e is None:
                if len(engines) >= max_engines:
                    return ScrapeResult(False, error=f"/metrics names more than {max_engines} engines "
                                                     f"({d.engine_label} label; health.max_engines)")
                e = engines[key] = _Engine()
            if name == d.running:
                e.running += value
                seen = True
            elif name == d.waiting:
                e.waiting += value
            elif name in d.kv:
                e.kv.append(value)
            elif name == d.cache_tokens:
                e.cache_tokens = int(value) or None
            else:
                # newer vLLM says each engine's capacity itself; blocks x block size is the front end's sum over
                # its data-parallel engines, and on a hybrid model (sliding window, Mamba) not the capacity at all
                try:
                    if _is_uint(lab.get("kv_cache_size_tokens", "")):
                        e.cache_tokens = int(lab["kv_cache_size_tokens"])
                    else:
                        e.cache_blocks = int(lab["num_gpu_blocks"]) * int(lab.get("block_size", "16"))
                except (KeyError, ValueError):
                    pass
                bs = lab.get("block_size", "")
                if _is_uint(bs) and 0 < int(bs) <= MAX_BLOCK_TOKENS:
                    e.block = int(bs)
                if lab.get("enable_prefix_caching") in ("True", "False"):  # CacheConfig's fields as str()
                    prefix_caching = lab["enable_prefix_caching"] == "True"
        elif name in d.counters:
            field_name = d.counters[name]
            counters[field_name] = counters.get(field_name, 0.0) + value
        elif name in d.fallback:
            field_name = d.fallback[name]
            fallback[field_name] = fallback.get(field_name, 0.0) + value
        elif name not in d.activity:  # a counter of by_label: only the label set it names
            for (metric, key, want), field_name in d.by_label.items():
                if metric == name and lab.get(key) == want:
                    counters[field_name] = counters.get(field_name, 0.0) + value
    if not seen:
        return ScrapeResult(False, error=f"no {d.running} in /metrics ({d.missing_hint})", missing=True)
    for k, v in fallback.items():
        counters.setdefault(k, v)
    running = sum(e.running for e in engines.values())
    waiting = sum(e.waiting for e in engines.values())
    if running > MAX_REQUESTS or waiting > MAX_REQUESTS:
        return ScrapeResult(False, error=f"{d.running}/{d.waiting} {running:g}/{waiting:g}: beyond {MAX_REQUESTS:,}")
    kv_usage = max((max(e.kv) for e in engines.values() if e.kv), default=0.0)
    if kv_usage > 1.0 + 1e-9:
        return ScrapeResult(False, error=f"KV cache usage {kv_usage:g}: beyond 1 (100%)")
    ranked = [engines[k] for k in sorted(engines, key=lambda k: (len(k), k))]
    n = len(ranked)
    caps = [e.cache_tokens or (e.cache_blocks // n if e.cache_blocks else None) for e in ranked]
    cache_tokens = sum(c for c in caps if c) or None
    per_engine = None
    if n > 1:
        per_engine = tuple(LoadSample(int(round(e.running)), int(round(e.waiting)), max(e.kv) if e.kv else 0.0,
                                      cache_tokens=c) for e, c in zip(ranked, caps))
    r, w = int(round(running)), int(round(waiting))
    if lora is not None:
        lab = lora[1]
        counters["lora_running"] = frozenset(a for a in lab.get("running_lora_adapters", "").split(",") if a)
        counters["lora_waiting"] = frozenset(a for a in lab.get("waiting_lora_adapters", "").split(",") if a)
        counters["max_lora"] = int(lab["max_lora"]) if _is_uint(lab.get("max_lora", "")) else None
    if d.prompt_counted in counters:
        counters["prompt_requests"] = counters[d.prompt_counted]
    engine_block = next((e.block for e in ranked if e.block), None)
    sample = LoadSample(r, w, kv_usage, cache_tokens=cache_tokens, prefix_caching=prefix_caching, engines=per_engine,
                        engine_block=engine_block, **counters)
    return ScrapeResult(True, r, w, kv_usage, sample=sample, engine=d.name, activity=activity if d.activity else None)


def _document(text: str):
    """A replica's JSON answer, nested at most 1,024 deep (orjson's limit): ``json`` would raise RecursionError on
    a document 100,000 deep, and kill the replica's scrape task at every scrape. ValueError when it is not JSON."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as e:
        raise ValueError(str(e)) from None


def _shown(v) -> bool:
    """A value the brain may keep and show (in /state, logs, GET /v1/models): printable, no escape codes or newlines."""
    return isinstance(v, int) or v.isprintable()


def parse_models(text: str) -> list[dict] | None:
    """The model objects of a /v1/models answer, each cut to MODEL_FIELDS of bounded size; None when the text is
    not such an answer or lists more than MAX_MODELS (what the brain keeps per replica stays small whatever a
    replica, or whoever answers in its place, sends)."""
    try:
        data = _document(text)["data"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(data, list) or len(data) > MAX_MODELS:
        return None
    out = []
    for m in data:
        mid = m.get("id") if isinstance(m, dict) else None
        if isinstance(mid, str) and 0 < len(mid) <= MAX_MODEL_FIELD_CHARS and mid.isprintable():
            out.append({k: m[k] for k in MODEL_FIELDS if isinstance(m.get(k), (str, int))
                        and not isinstance(m[k], bool) and len(str(m[k])) <= MAX_MODEL_FIELD_CHARS and _shown(m[k])})
    return out


def parse_openapi_paths(text: str) -> list[str] | None:
    """The paths an /openapi.json lists (bounded like /v1/models); None when it is not such a document."""
    try:
        paths = _document(text)["paths"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(paths, dict) or not paths or len(paths) > MAX_PATHS:
        return None
    return [p for p in paths if isinstance(p, str) and p.startswith("/") and len(p) <= MAX_PATH_CHARS
            and p.isprintable() and " " not in p]
