"""The /metrics of vLLM and SGLang as their own code defines and moves them: names, types, label sets,
bucket boundaries, and the moment each series moves. The mock exports them (``--metrics``), and the
parser tests read fixtures rendered from them (``python -m extproc.tools.engine.metrics --write``).

Facts restated from the engines' sources (their code is not copied):
- vLLM V1: ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger.__init__`` defines, ``record`` moves:
  scheduler gauges and prefix-cache counters every step, ``prompt_tokens`` when a request's prefill ends,
  ``generation_tokens`` every step, the per-request histograms from ``finished_requests`` only, i.e. when a
  request finishes), ``vllm/v1/metrics/stats.py`` (``IterationStats.update_from_output``: first token;
  ``update_from_finished_request``), ``vllm/config/cache.py`` (``CacheConfig.metrics_info``: every field as
  ``str()``; ``kv_cache_size_tokens`` is per data-parallel engine), ``vllm/v1/engine/core_client.py``
  (``DPLBAsyncMPClient.get_core_engine_for_request``: the data-parallel front end's choice).
- vLLM before 0.11 (``vllm-old``): ``gpu_cache_usage_perc`` and ``gpu_prefix_cache_*``, a prefix-cache
  look-up counted every time the scheduler tries to admit a waiting request, no ``prompt_tokens_by_source``,
  no ``request_prefill_kv_computed_tokens``, no ``kv_cache_size_tokens``.
- SGLang: ``python/sglang/srt/metrics/collector.py`` (``SchedulerMetricsCollector``: gauges labelled
  model_name, engine_type, tp_rank, pp_rank [, dp_rank]; ``TokenizerMetricsCollector``: token counters and
  request histograms labelled model_name, moved by ``observe_one_finished_request``, so at finish),
  ``python/sglang/srt/managers/scheduler_metrics_mixin.py`` (``log_prefill_stats`` on every prefill batch,
  ``log_decode_stats`` every ``decode_log_interval`` decode steps: the only moments the gauges move);
  ``python/sglang/srt/observability/req_time_stats.py`` (``SchedulerReqTimeStats.set_prefill_finished_time``:
  ``per_stage_req_latency_seconds{stage="prefill_forward"}``, from the request's entry into the running batch
  to the end of its prefill, observed by the scheduler's collector when the prefill ends).
"""

from __future__ import annotations

import argparse
import bisect
import time
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.utils import floatToGoString


def buckets_1_2_5(max_value: int) -> tuple[float, ...]:
    """vLLM's ``build_1_2_5_buckets``: 1, 2, 5, 10, 20, 50, ... up to max_value."""
    out, e = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10 ** e
            if v > max_value:
                return tuple(out)
            out.append(v)
        e += 1


VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)
VLLM_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)
SGLANG_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
SGLANG_E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800,
                      2400)
SGLANG_ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
                      0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000)
# SchedulerMetricsCollector.per_stage_req_latency_seconds: exponential_buckets(start=0.001, width=1.62, length=30)
SGLANG_STAGE_BUCKETS = tuple(0.001 * 1.62 ** i for i in range(30))
SGLANG_DECODE_LOG_INTERVAL = 40  # server_args.decode_log_interval's default

# vllm/config/cache.py CacheConfig fields, in declaration order (metrics_info exports each as str(value))
# vLLM 0.32's CacheConfig as cache_config_info labels it (tests/fixtures/vllm-0.32/metrics.txt, captured from the
# engine)
VLLM_CACHE_FIELDS = ("_block_size_resolved", "block_size", "cache_dtype", "cache_hit_alignment_tokens",
                     "effective_attention_block_size", "enable_mamba_shared_prefix_checkpoint", "enable_prefix_caching",
                     "gpu_memory_utilization", "hash_block_size", "is_attention_free", "kv_cache_dtype_skip_layers",
                     "kv_cache_layout", "kv_cache_max_concurrency", "kv_cache_memory_bytes", "kv_cache_size_tokens",
                     "kv_offloading_backend", "kv_offloading_size", "kv_sharing_fast_prefill", "mamba_block_size",
                     "mamba_cache_dtype", "mamba_cache_mode", "mamba_page_size_padded", "mamba_ssm_cache_dtype",
                     "num_cpu_blocks", "num_gpu_blocks", "num_gpu_blocks_override", "prefix_cache_retention_interval",
                     "prefix_caching_hash_algo", "prefix_match_unit", "replayssm_buffer_len", "skip_page_size_padded",
                     "sliding_window", "swa_bounded_replay", "use_kda_recoverssm", "use_replayssm",
                     "user_specified_block_size")
VLLM_OLD_CACHE_FIELDS = ("block_size", "gpu_memory_utilization", "swap_space", "cache_dtype", "is_attention_free",
                         "num_gpu_blocks_override", "sliding_window", "enable_prefix_caching",
                         "prefix_caching_hash_algo",
                         "cpu_offload_gb", "calculate_kv_scales", "num_gpu_blocks", "num_cpu_blocks")


def _escape(value: str) -> str:
    """A label value as the text format writes it."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


@dataclass(frozen=True)
class MetricDef:
    """One series family as the engine registers it (counters without the ``_total`` the client adds)."""

    name: str
    kind: str  # counter | gauge | histogram
    help: str
    labels: tuple[str, ...]
    when: str  # the moment the engine moves it: step, schedule, lookup, first_token, finish, chunk, log_stats, start
    buckets: tuple[float, ...] = ()


LORA_INFO = "vllm:lora_requests_info"


def _vllm_defs(old: bool, max_model_len: int, lora: bool = False, offload: bool = False) -> list[MetricDef]:
    L = ("model_name", "engine")
    tokens = buckets_1_2_5(max_model_len)
    kv = "vllm:gpu_cache_usage_perc" if old else "vllm:kv_cache_usage_perc"
    q, h = ("vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits") if old else \
        ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
    out = [
        MetricDef("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", L, "step"),
        MetricDef("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", L, "step"),
        MetricDef(kv, "gauge", "KV-cache usage. 1 means 100 percent usage.", L, "step"),
        MetricDef(q, "counter", "Prefix cache queries, in terms of number of queried tokens.", L,
                  "lookup" if old else "schedule"),
        MetricDef(h, "counter", "Prefix cache hits, in terms of number of cached tokens.", L,
                  "lookup" if old else "schedule"),
        MetricDef("vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine.", L, "step"),
        MetricDef("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.", L, "first_token"),
        MetricDef("vllm:generation_tokens", "counter", "Number of generation tokens processed.", L, "step"),
        MetricDef("vllm:request_success", "counter", "Count of successfully processed requests.",
                  (*L, "finished_reason"), "finish"),
        MetricDef("vllm:request_prompt_tokens", "histogram", "Number of prefill tokens processed.", L, "finish",
                  tokens),
        MetricDef("vllm:request_generation_tokens", "histogram", "Number of generation tokens processed.", L, "finish",
                  tokens),
        MetricDef("vllm:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.", L,
                  "first_token", VLLM_TTFT_BUCKETS),
        MetricDef("vllm:time_per_output_token_seconds" if old else "vllm:inter_token_latency_seconds", "histogram",
                  "Histogram of inter-token latency in seconds.", L, "chunk", VLLM_ITL_BUCKETS),
        MetricDef("vllm:e2e_request_latency_seconds", "histogram", "Histogram of e2e request latency in seconds.", L,
                  "finish", VLLM_LATENCY_BUCKETS),
        MetricDef("vllm:request_queue_time_seconds", "histogram",
                  "Histogram of time spent in WAITING phase for request.", L, "finish", VLLM_LATENCY_BUCKETS),
        MetricDef("vllm:request_inference_time_seconds", "histogram",
                  "Histogram of time spent in RUNNING phase for request.", L, "finish", VLLM_LATENCY_BUCKETS),
        MetricDef("vllm:request_prefill_time_seconds", "histogram",
                  "Histogram of time spent in PREFILL phase for request.", L, "finish", VLLM_LATENCY_BUCKETS),
        MetricDef("vllm:request_decode_time_seconds", "histogram",
                  "Histogram of time spent in DECODE phase for request.", L, "finish", VLLM_LATENCY_BUCKETS),
        MetricDef("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
                  (*(VLLM_OLD_CACHE_FIELDS if old else VLLM_CACHE_FIELDS), "engine"), "start"),
    ]
    if lora:
        # a gauge set to the current time under the label set of the step's adapters: every set ever seen stays,
        # the newest (largest value) is the present one
        out.append(MetricDef(LORA_INFO, "gauge", "Running stats on lora requests.",
                             ("max_lora", "waiting_lora_adapters", "running_lora_adapters"), "step"))
    if not old:
        out += [
            MetricDef("vllm:prompt_tokens_by_source", "counter", "Number of prompt tokens by source.",
                      (*L, "source"), "first_token"),
            MetricDef("vllm:request_prefill_kv_computed_tokens", "histogram",
                      "Histogram of new KV tokens computed during prefill (excluding cached tokens).", L, "finish",
                      tokens),
        ]
    if offload:  # vLLM's OffloadingConnector (kv_connector/v1/offloading/metrics.py), per engine
        out.append(MetricDef("vllm:kv_offload_load_time", "counter",
                             "Total load time from offload storage to GPU, in seconds.", L, "first_token"))
    return out


def _sglang_defs(dp: bool) -> list[MetricDef]:
    S = ("model_name", "engine_type", "tp_rank", "pp_rank", *(("dp_rank",) if dp else ()))
    T = ("model_name",)
    g = [("sglang:num_running_reqs", "The number of running requests."),
         ("sglang:num_used_tokens", "The number of used tokens."),
         ("sglang:token_usage", "The token usage."),
         ("sglang:gen_throughput", "The generation throughput (token/s)."),
         ("sglang:num_queue_reqs", "The number of requests in the waiting queue."),
         ("sglang:cache_hit_rate", "The prefix cache hit rate."),
         ("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.")]
    return [*(MetricDef(n, "gauge", h, S, "log_stats") for n, h in g),
            MetricDef("sglang:per_stage_req_latency_seconds", "histogram", "The latency of each stage of requests.",
                      (*S, "stage"), "first_token", SGLANG_STAGE_BUCKETS),
            MetricDef("sglang:prompt_tokens", "counter", "Number of prefill tokens processed.", T, "finish"),
            MetricDef("sglang:generation_tokens", "counter", "Number of generation tokens processed.", T, "finish"),
            MetricDef("sglang:cached_tokens", "counter", "Number of cached prompt tokens.", T, "finish"),
            MetricDef("sglang:num_requests", "counter", "Number of requests processed.", T, "finish"),
            MetricDef("sglang:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.",
                      T, "first_token", SGLANG_TTFT_BUCKETS),
            MetricDef("sglang:inter_token_latency_seconds", "histogram", "Histogram of inter-token latency in seconds.",
                      T, "chunk", SGLANG_ITL_BUCKETS),
            MetricDef("sglang:e2e_request_latency_seconds", "histogram",
                      "Histogram of End-to-end request latency in seconds", T, "finish", SGLANG_E2E_BUCKETS)]


DIALECTS = ("vllm", "vllm-old", "sglang")


def definitions(dialect: str, max_model_len: int = 32768, data_parallel: int = 1, max_loras: int = 0,
                offload: bool = False) -> list[MetricDef]:
    if dialect == "sglang":
        return _sglang_defs(data_parallel > 1)
    # vLLM: "LoRA in DP mode is not supported yet" (no lora_requests_info with several engines)
    return _vllm_defs(dialect == "vllm-old", max_model_len, lora=max_loras > 0 and data_parallel == 1,
                      offload=offload and dialect == "vllm")


@dataclass(frozen=True)
class CacheInfo:
    block_size: int
    blocks_per_engine: int
    prefix_caching: bool


class Exporter:
    """One replica's /metrics in one engine's dialect, moved when that engine's code moves it."""

    def __init__(self, dialect: str, model: str, engines: int = 1, cache: CacheInfo | None = None,
                 tp: int = 1, all_ranks: bool = False, max_model_len: int = 32768, max_loras: int = 0,
                 clock=time.time, offload: bool = False):
        self.dialect = dialect
        self.model = model
        self.engines = engines
        self.tp = tp if all_ranks else 1  # SGLang --enable-metrics-for-all-schedulers: a copy per TP rank
        self._cache, self._max_model_len, self.max_loras, self.clock = cache, max_model_len, max_loras, clock
        self.registry = CollectorRegistry(auto_describe=True)
        self.defs = {d.name: d for d in definitions(dialect, max_model_len, engines, max_loras, offload)}
        self.m = {}
        for d in self.defs.values():
            kw = {"buckets": d.buckets} if d.kind == "histogram" else {}
            cls = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}[d.kind]
            self.m[d.name] = cls(d.name, d.help, d.labels, registry=self.registry, **kw)
        self._exported: dict[tuple[int, str], float] = {}  # step-moment counters already pushed
        self._prefixes: dict[tuple, str] = {}  # (sample name, labels) -> its formatted "name{labels} "
        self._children: dict[tuple[str, int], object] = {}
        itl_def = self.defs.get("sglang:inter_token_latency_seconds" if dialect == "sglang" else
                                "vllm:time_per_output_token_seconds" if dialect == "vllm-old" else
                                "vllm:inter_token_latency_seconds")
        self._itl_bounds = [*itl_def.buckets, float("inf")] if itl_def else [float("inf")]
        # streamed tokens not yet added to their series: engine -> [generation tokens, ITL sum, {bucket: count}].
        # Nothing reads a series between two scrapes, so adding them when the text is rendered gives the same text
        # as adding each at its step, for a fraction of the mock's time
        self._streamed: dict[int, list] = {}
        if dialect == "sglang":
            self._init_sglang(cache)
        else:
            self._init_vllm(cache)

    # ---- label sets

    def _lv(self, k: int) -> dict[str, str]:
        return {"model_name": self.model, "engine": str(k)}

    def _child(self, name: str, k: int):
        """The series of one metric for engine k (the mock streams thousands of chunks a second: a labels() lookup
        per chunk would cost it more than its engine)."""
        key = (name, k)
        c = self._children.get(key)
        if c is None:
            labels = self._lv(k) if self.dialect != "sglang" else {"model_name": self.model}
            c = self._children[key] = self.m[name].labels(**labels)
        return c

    def _sched(self, k: int, tp_rank: int = 0) -> dict[str, str]:
        lab = {"model_name": self.model, "engine_type": "unified", "tp_rank": str(tp_rank), "pp_rank": "0"}
        if self.engines > 1:
            lab["dp_rank"] = str(k)
        return lab

    def _init_vllm(self, cache: CacheInfo | None) -> None:
        old = self.dialect == "vllm-old"
        for k in range(self.engines):
            for d in self.defs.values():
                if d.labels[:2] == ("model_name", "engine") and len(d.labels) == 2:
                    self.m[d.name].labels(**self._lv(k))  # every series exists from the start, at 0
            if not old:
                for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
                    self.m["vllm:prompt_tokens_by_source"].labels(**self._lv(k), source=source)
        if cache is None:
            return
        fields = VLLM_OLD_CACHE_FIELDS if old else VLLM_CACHE_FIELDS
        values = {f: "None" for f in fields}
        values.update(block_size=str(cache.block_size), gpu_memory_utilization="0.9", cache_dtype="auto",
                      is_attention_free="False", enable_prefix_caching=str(cache.prefix_caching),
                      prefix_caching_hash_algo="sha256" if old else "sha256",
                      # the front end's cache config holds the sum over its data-parallel engines
                      num_gpu_blocks=str(cache.blocks_per_engine * self.engines), num_cpu_blocks="0")
        if old:
            values.update(swap_space="4", cpu_offload_gb="0", calculate_kv_scales="False")
        else:
            values.update(mamba_cache_dtype="auto", mamba_ssm_cache_dtype="auto", kv_sharing_fast_prefill="False",
                          kv_offloading_backend="native", _block_size_resolved="True",
                          effective_attention_block_size=str(cache.block_size),
                          enable_mamba_shared_prefix_checkpoint="False", kv_cache_dtype_skip_layers="[]",
                          mamba_cache_mode="none", prefix_cache_retention_interval="0", replayssm_buffer_len="16",
                          swa_bounded_replay="True", use_kda_recoverssm="False", use_replayssm="False",
                          user_specified_block_size="False",
                          kv_cache_size_tokens=str(cache.blocks_per_engine * cache.block_size))
        for k in range(self.engines):
            self.m["vllm:cache_config_info"].labels(**values, engine=str(k)).set(1)

    def _init_sglang(self, cache: CacheInfo | None) -> None:
        for k in range(self.engines):
            for t in range(self.tp):
                for d in self.defs.values():
                    if d.when == "log_stats":
                        self.m[d.name].labels(**self._sched(k, t))
                if cache is not None:
                    self.m["sglang:max_total_num_tokens"].labels(**self._sched(k, t)).set(
                        cache.blocks_per_engine * cache.block_size)
        for d in self.defs.values():
            if d.labels == ("model_name",):
                self.m[d.name].labels(model_name=self.model)

    # ---- the moments (called by the mock's engine driver)

    def scheduled(self, k: int, engine) -> None:
        """Step-moment series, read off the engine's state (vLLM records them every step; between two steps
        nothing moves them, so reading them at scrape time gives the same text)."""
        if self.dialect == "sglang":
            return
        old = self.dialect == "vllm-old"
        lv = self._lv(k)
        self.m["vllm:num_requests_running"].labels(**lv).set(engine.num_running)
        self.m["vllm:num_requests_waiting"].labels(**lv).set(engine.num_waiting)
        self.m["vllm:gpu_cache_usage_perc" if old else "vllm:kv_cache_usage_perc"].labels(**lv).set(engine.kv_usage)
        q, h = ("vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits") if old else \
            ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
        totals = {q: engine.lookup_queries if old else engine.prefix_queries,
                  h: engine.lookup_hits if old else engine.prefix_hits,
                  "vllm:num_preemptions": engine.preemptions}
        for name, total in totals.items():
            delta = total - self._exported.get((k, name), 0)
            if delta > 0:
                self.m[name].labels(**lv).inc(delta)
            self._exported[(k, name)] = total
        self.lora_info(engine)

    def lora_info(self, engine) -> None:
        """vLLM sets the gauge to the current time at every engine step's stats, with a label set per combination it
        has seen (all kept). Its scheduler stats key both label lists by every adapter with a request, running or
        waiting (``LoRARequestStates.update_scheduler_stats``: the value is a count, the label only the keys), so an
        adapter is listed under both or neither."""
        if LORA_INFO in self.defs:
            names = ",".join(sorted(set(engine.lora_running) | set(engine.lora_waiting)))
            self.m[LORA_INFO].labels(max_lora=str(self.max_loras), waiting_lora_adapters=names,
                                     running_lora_adapters=names).set(self.clock())

    def restarted(self) -> None:
        """The process came back: a new process's counters start again from 0."""
        self.__init__(self.dialect, self.model, self.engines, self._cache, self.tp, self.tp > 1, self._max_model_len,
                      self.max_loras, self.clock)

    def log_stats(self, k: int, engine, gen_throughput: float) -> None:
        """SGLang: the scheduler's gauges, moved only here (a prefill batch, or every decode_log_interval
        decode steps): an engine that went idle keeps its last values until its next batch."""
        if self.dialect != "sglang":
            return
        hit = engine.prefix_hits / engine.prefix_queries if engine.prefix_queries else 0.0
        values = {"sglang:num_running_reqs": engine.num_running, "sglang:num_queue_reqs": engine.num_waiting,
                  "sglang:token_usage": engine.kv_usage, "sglang:num_used_tokens": engine.used_blocks * 16,
                  "sglang:gen_throughput": gen_throughput, "sglang:cache_hit_rate": hit}
        for t in range(self.tp):
            for name, v in values.items():
                self.m[name].labels(**self._sched(k, t)).set(v)

    def first_token(self, k: int, er, ttft_s: float, prefill_s: float, restore_s: float = 0.0) -> None:
        """A request's prefill ended (``prefill_s``: since it entered the running batch)."""
        if self.dialect == "sglang":
            self.m["sglang:time_to_first_token_seconds"].labels(model_name=self.model).observe(ttft_s)
            for t in range(self.tp):  # every rank's scheduler runs the request, and each has its collector
                self.m["sglang:per_stage_req_latency_seconds"].labels(**self._sched(k, t),
                                                                     stage="prefill_forward").observe(prefill_s)
            return
        lv = self._lv(k)
        self.m["vllm:prompt_tokens"].labels(**lv).inc(er.prompt_tokens)
        self.m["vllm:generation_tokens"].labels(**lv).inc()  # the step that ends a prefill samples a token
        self.m["vllm:time_to_first_token_seconds"].labels(**lv).observe(ttft_s)
        if self.dialect == "vllm":
            by = self.m["vllm:prompt_tokens_by_source"]
            by.labels(**lv, source="local_compute").inc(er.prompt_tokens - er.cached_tokens)
            by.labels(**lv, source="local_cache_hit").inc(er.cached_tokens - er.external_tokens)
            by.labels(**lv, source="external_kv_transfer").inc(er.external_tokens)
            if restore_s and "vllm:kv_offload_load_time" in self.m:
                self.m["vllm:kv_offload_load_time"].labels(**lv).inc(restore_s)

    def chunk(self, k: int, n: int, interval_s: float) -> None:
        """n tokens of one request streamed after interval_s: vLLM counts generation tokens every step; both
        engines observe inter-token latency per token."""
        if n <= 0:
            return
        acc = self._streamed.get(k)
        if acc is None:
            acc = self._streamed[k] = [0, 0.0, {}]
        acc[0] += n
        acc[1] += interval_s
        i = bisect.bisect_left(self._itl_bounds, interval_s / n)
        acc[2][i] = acc[2].get(i, 0) + n

    def _flush_streamed(self) -> None:
        if self.dialect == "sglang":
            itl, gen = "sglang:inter_token_latency_seconds", None
        else:
            itl = "vllm:time_per_output_token_seconds" if self.dialect == "vllm-old" else \
                "vllm:inter_token_latency_seconds"
            gen = "vllm:generation_tokens"
        for k, (n, total, buckets) in self._streamed.items():
            if gen is not None:
                self._child(gen, k).inc(n)
            h = self._child(itl, k)
            h._sum.inc(total)
            for i, count in buckets.items():
                h._buckets[i].inc(count)
        self._streamed.clear()

    def finished(self, k: int, er, *, queued_s: float, prefill_s: float, decode_s: float, e2e_s: float) -> None:
        if self.dialect == "sglang":
            lab = {"model_name": self.model}
            self.m["sglang:prompt_tokens"].labels(**lab).inc(er.prompt_tokens)
            self.m["sglang:generation_tokens"].labels(**lab).inc(er.generated)
            if er.cached_tokens > 0:
                self.m["sglang:cached_tokens"].labels(**lab).inc(er.cached_tokens)
            self.m["sglang:num_requests"].labels(**lab).inc()
            self.m["sglang:e2e_request_latency_seconds"].labels(**lab).observe(e2e_s)
            return
        lv = self._lv(k)
        self.m["vllm:request_success"].labels(**lv, finished_reason="length").inc()
        self.m["vllm:e2e_request_latency_seconds"].labels(**lv).observe(e2e_s)
        self.m["vllm:request_queue_time_seconds"].labels(**lv).observe(queued_s)
        self.m["vllm:request_prefill_time_seconds"].labels(**lv).observe(prefill_s)
        self.m["vllm:request_inference_time_seconds"].labels(**lv).observe(prefill_s + decode_s)
        self.m["vllm:request_decode_time_seconds"].labels(**lv).observe(decode_s)
        self.m["vllm:request_prompt_tokens"].labels(**lv).observe(er.prompt_tokens)
        self.m["vllm:request_generation_tokens"].labels(**lv).observe(er.generated)
        if self.dialect == "vllm":
            self.m["vllm:request_prefill_kv_computed_tokens"].labels(**lv).observe(er.prompt_tokens - er.cached_tokens)

    def text(self) -> bytes:
        self._flush_streamed()
        return self._render()

    def _render(self) -> bytes:
        """``generate_latest``'s text, byte for byte, with each series' name and labels formatted once: the
        brain reads every mock ten times a second at 5x, and on a 2-core bench box the label escaping of
        prometheus_client (the engines' own exporter, run on their own hosts) was CPU the peers never spend."""
        prefixes = self._prefixes
        out: list[str] = []
        for metric in self.registry.collect():
            mname = metric.name + "_total" if metric.type == "counter" else metric.name
            doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
            out.append(f"# HELP {mname} {doc}\n# TYPE {mname} {metric.type}\n")
            created: list[str] = []
            for s in metric.samples:
                key = (s.name, tuple(s.labels.items()))
                prefix = prefixes.get(key)
                if prefix is None:
                    labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(s.labels.items()))
                    prefix = prefixes[key] = f"{s.name}{{{labels}}} " if labels else f"{s.name} "
                line = prefix + floatToGoString(s.value) + "\n"
                (created if s.name == metric.name + "_created" else out).append(line)
            if created:
                out.append(f"# HELP {metric.name}_created {doc}\n# TYPE {metric.name}_created gauge\n")
                out.extend(created)
        return "".join(out).encode()


# ---------------------------------------------------------------- fixtures


def fixture(dialect: str, engines: int = 1, tp: int = 1, max_loras: int = 0, offload: bool = False) -> tuple[bytes,
                                                                                                             dict]:
    """A /metrics text in the dialect's exact shape, after a fixed history of requests, and the numbers a
    parser must read from it (what the history put there)."""
    import prometheus_client

    from extproc.tools.engine.model import EngineRequest

    cache = CacheInfo(16, 10_000, True)
    # the engines' text has *_created series too (prometheus_client's default); their times would make every
    # rendering differ, and no parser reads them
    prometheus_client.disable_created_metrics()
    try:
        return _fixture(dialect, engines, tp, cache, EngineRequest, max_loras, offload)
    finally:
        prometheus_client.enable_created_metrics()


def _fixture(dialect: str, engines: int, tp: int, cache: "CacheInfo", EngineRequest, max_loras: int,
             offload: bool = False) -> tuple[bytes, dict]:
    clock = iter(range(1_800_000_000, 1_800_001_000))
    ex = Exporter(dialect, "served-model", engines, cache, tp=tp, all_ranks=tp > 1, max_loras=max_loras,
                  clock=lambda: float(next(clock)), offload=offload)
    want = {"running": 0, "waiting": 0, "kv": [], "prompt": 0, "cached": 0, "computed": 0, "generated": 0,
            "prefill_s": 0.0, "decode_s": 0.0, "done": 0, "first": 0, "cache_tokens": 10_000 * 16,
            "itl_s": 0.0, "itl_n": 0, "restored": 0, "restore_s": 0.0}
    for k in range(engines):
        eng = _FixtureEngine(running=3 + k, waiting=k, kv=0.25 + 0.1 * k)
        want["running"] += eng.num_running
        want["waiting"] += eng.num_waiting
        want["kv"].append(eng.kv_usage)
        for i in range(4 + k):  # requests that finished on engine k
            er = EngineRequest(i, (), 1000 + 100 * i, 50 + i, 0.0)
            er.cached_tokens, er.generated = 400 + 10 * i, 50 + i
            restore_s = 0.0
            if offload:  # of the cached tokens, what the offloaded tier restored
                er.external_tokens, restore_s = 160 + 16 * i, 0.002 * (i + 1)
                want["restored"] += er.external_tokens
                want["restore_s"] += restore_s
            ex.first_token(k, er, 0.2 + 0.01 * i, 0.1 + 0.01 * i, restore_s)
            ex.chunk(k, er.generated - 1, 0.03 * (er.generated - 1))
            ex.finished(k, er, queued_s=0.05, prefill_s=0.1 + 0.01 * i, decode_s=0.03 * (er.generated - 1),
                        e2e_s=0.25 + 0.03 * er.generated)
            want["prompt"] += er.prompt_tokens
            want["cached"] += er.cached_tokens
            want["computed"] += er.prompt_tokens - er.cached_tokens
            want["generated"] += er.generated
            want["prefill_s"] += 0.1 + 0.01 * i
            want["decode_s"] += 0.03 * (er.generated - 1)
            want["itl_s"] += 0.03 * (er.generated - 1)
            want["itl_n"] += er.generated - 1
            want["done"] += 1
            want["first"] += 1
        eng.prefix_queries = eng.lookup_queries = sum(1000 + 100 * i for i in range(4 + k))
        eng.prefix_hits = eng.lookup_hits = sum(400 + 10 * i for i in range(4 + k))
        if max_loras:  # an earlier step's adapters, then the present ones (the newer time)
            before = _FixtureEngine(0, 0, 0.0)
            before.lora_running, before.lora_waiting = ["a9"], []
            ex.lora_info(before)
            active = frozenset(eng.lora_running) | frozenset(eng.lora_waiting)  # vLLM lists each under both
            want["lora"] = (active, active, max_loras)
        ex.scheduled(k, eng)
        ex.log_stats(k, eng, 100.0)
    return ex.text(), want


class _FixtureEngine:
    """The engine state a fixture's gauges are read from."""

    def __init__(self, running: int, waiting: int, kv: float):
        self.num_running, self.num_waiting, self.kv_usage = running, waiting, kv
        self.lora_running, self.lora_waiting = ["a1", "a2"], ["a3"]
        self.used_blocks = int(kv * 10_000)
        self.prefix_queries = self.prefix_hits = self.lookup_queries = self.lookup_hits = self.preemptions = 0


FIXTURES = {  # file name -> (dialect, data-parallel engines, tensor-parallel copies)
    "vllm-0.32.txt": ("vllm", 1, 1),
    "vllm-0.32-dp2.txt": ("vllm", 2, 1),
    "vllm-0.8.txt": ("vllm-old", 1, 1),
    "vllm-0.8-dp2.txt": ("vllm-old", 2, 1),
    "sglang-0.5.txt": ("sglang", 1, 1),
    "sglang-0.5-tp2-all-ranks.txt": ("sglang", 1, 2),
    "sglang-0.5-dp2.txt": ("sglang", 2, 1),
    "vllm-0.32-lora.txt": ("vllm", 1, 1, 2),
    "vllm-0.32-offload.txt": ("vllm", 1, 1, 0, True),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m extproc.tools.engine.metrics")
    ap.add_argument("--write", default="tests/fixtures/metrics", help="directory to write the fixtures to")
    args = ap.parse_args(argv)
    out = Path(args.write)
    out.mkdir(parents=True, exist_ok=True)
    for name, spec in FIXTURES.items():
        text, _ = fixture(*spec)
        (out / name).write_bytes(text)
        print(f"{out / name}: {len(text)} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
