"""What the live benchmarks share (``make bench``, ``bench-fleet``, ``bench-real``, ``bench-agree``).

- The peers as their users deploy them, started in front of replicas that already run (``start_peer``): Envoy's
  own load balancers with active health checks and retries (``envoy_builtin``), the SGLang and vLLM routers.
- Readiness: a contender is measured once it answers a one-token request (``wait_answering``).
- The engines' own counters (``engine_counters``): a mock speaks vLLM's metric names, so one reader serves mock
  and real replicas alike; what a bench reports as the engines' prefix hits comes from here, not from a router.
- The brain's mean decision time (``brain_decision_mean``).
- The pace (``pace_check``): whether a run measured the replicas or the machine it ran on. On two shared cores
  a time-compressed run can outpace the client, Envoy or the mocks themselves; its percentiles then measure
  their lag. A run says so, and the bench lowers the pace or refuses the row; every table states its pace.
"""

from __future__ import annotations

import json
import shutil
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench.contenders import ENVOY_POLICIES, PEERS, ROUTERS, WARMROUTE, overlaid
from extproc.core import Router, RouterConfig
from extproc.envoy_config import dump
from extproc.tools.stack.local import Stack, envoy_binary
from extproc.tools.stack.procs import Proc, free_port, http_get, wait_for
from extproc.tools.workload.generate import MOCK_MODEL, WorkloadConfig
from extproc.tools.workload.measure import CLASS_NAMES

# A run measured the machine rather than the replicas when the client's own scheduling lag (p99, in workload
# time) reached this share of the TTFT p50 it measured...
CLIENT_LAG_SHARE = 0.10
# ...or when the part of the median TTFT that was not the engine's (client, Envoy, router, the mocks' HTTP and
# their own scheduling) reached this share of it. At 5x on a quiet machine both are a few per cent.
NOT_ENGINE_SHARE = 0.25



def invocation(argv: list[str] | None = None) -> str:
    """The command that ran this measurement, as a reader types it again (a result file names it)."""
    if sys.argv and sys.argv[0].startswith("python -m bench "):  # run as a scenario: its name and the extra options
        return " ".join(sys.argv)
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return " ".join([f"python -m {spec.name if spec else 'bench'}", *(sys.argv[1:] if argv is None else argv)])


def reset_caches(urls: list[str]) -> None:
    """Every replica's prefix cache emptied (vLLM's ``/reset_prefix_cache``; the mock's too), between runs."""
    for u in urls:
        urllib.request.urlopen(urllib.request.Request(u + "/reset_prefix_cache", data=b"", method="POST"),
                               timeout=30).read()


def live_router(n: int, cfg: RouterConfig | None = None) -> tuple[Router, float]:
    """An in-process router over ``n`` replicas scraped until every one is LIVE, and the clock it stands at."""
    r = Router(cfg or RouterConfig(), [f"r{i}" for i in range(n)], 0.0)
    t = 0.0
    while not all(x.state.value == "LIVE" for x in r.replicas):
        for x in r.replicas:
            r.on_scrape(x.name, True, t)
        t += 3.0
    return r, t


def find_bin(name: str) -> str | None:
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


def envoy_builtin(policy: str, ports: list[int], listen: int, speedup: float,
                  hash_balance_factor: int | None = None) -> dict:
    """A plain Envoy a user would write: one cluster over the replicas, retries, health checks."""
    hc = max(0.1, 3.0 / speedup)
    cluster = {
        "name": "fleet", "type": "STATIC", "connect_timeout": "1s", "lb_policy": policy,
        "per_connection_buffer_limit_bytes": 64 * 2**20,
        "circuit_breakers": {"thresholds": [{"max_connections": 100000, "max_pending_requests": 100000,
                                             "max_requests": 100000, "max_retries": 100000}]},
        "health_checks": [{"timeout": f"{hc:.3f}s", "interval": f"{hc:.3f}s", "unhealthy_threshold": 1,
                           "healthy_threshold": 2,
                           "http_health_check": {"path": "/health"}}],
        "load_assignment": {"cluster_name": "fleet", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}} for p in ports]}]},
    }
    route: dict = {"cluster": "fleet", "timeout": "0s", "retry_policy": {
        "retry_on": "connect-failure,reset-before-request,refused-stream", "num_retries": 2,
        "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}]}}
    if policy == "RING_HASH":
        route["hash_policy"] = [{"header": {"header_name": "x-session-id"}}]
    if hash_balance_factor:
        cluster["common_lb_config"] = {"consistent_hashing_lb_config": {"hash_balance_factor": hash_balance_factor}}
    hcm = {"@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",  # noqa: E501
           "stat_prefix": "ingress", "stream_idle_timeout": "0s",
           "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [{"match": {"prefix": "/"},
                                                                                            "route": route}]}]},
           "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
               "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}
    return {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
            "static_resources": {
                "listeners": [{"name": "l", "address": {"socket_address": {"address": "127.0.0.1",
                                                                           "port_value": listen}},
                               "per_connection_buffer_limit_bytes": 64 * 2**20,
                               "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                               "typed_config": hcm}]}]}],
                "clusters": [cluster]}}


def envoy_proc(doc: dict, workdir: Path) -> Proc:
    path = workdir / "envoy.yaml"
    path.write_text(dump(doc))
    return Proc("envoy", [envoy_binary(), "-c", str(path), "--use-dynamic-base-id", "--concurrency", "1", "-l",
                          "error"],
                workdir)


def start_peer(contender: str, urls: list[str], workdir: Path, speedup: float = 1.0) -> tuple[str, Proc]:
    """A peer router in front of the replicas at ``urls``, configured as ``make bench`` documents: its URL and
    process (not yet known to answer: ``wait_answering``)."""
    port = free_port()
    if contender in ENVOY_POLICIES:
        ports = [int(u.rsplit(":", 1)[1]) for u in urls]
        policy, hbf = ENVOY_POLICIES[contender]
        proc = envoy_proc(envoy_builtin(policy, ports, port, speedup, hbf), workdir)
    elif contender in ROUTERS:
        binary, policy = ROUTERS[contender]
        exe = find_bin(binary)
        if exe is None:
            raise FileNotFoundError(f"{binary} is not installed (pip install '.[bench]')")
        # its metrics exporter defaults to port 29000: one left by an earlier run would stop this one from starting
        argv = [exe, *(["launch"] if binary == "sglang-router" else []), "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *urls, "--policy", policy,
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        proc = Proc(contender, argv, workdir)
    else:
        raise ValueError(f"unknown peer {contender!r}: one of {', '.join(PEERS)}")
    return f"http://127.0.0.1:{port}", proc


def wait_answering(url: str, model: str, what: str, proc: Proc | None = None, timeout: float = 90.0,
                   headers: dict | None = None) -> None:
    """Until ``url`` answers a one-token chat completion for ``model`` with 200."""
    body = json.dumps({"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "ready"}]}).encode()

    def ready() -> bool:
        req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json", **(headers or {})})
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status == 200

    wait_for(ready, timeout, f"{what} to answer", proc, every=0.2)


@dataclass
class EngineCounters:
    """Sums over replicas of the engines' own counters (vLLM's names; the mocks export them too)."""

    prompt: float = 0.0  # vllm:prompt_tokens_total
    cached: float = 0.0  # vllm:prompt_tokens_cached_total (vLLM 0.32; the mock too): prompt tokens served from cache
    queries: float = 0.0  # vllm:prefix_cache_queries_total
    hits: float = 0.0  # vllm:prefix_cache_hits_total
    generated: float = 0.0  # vllm:generation_tokens_total
    done: tuple[float, ...] = ()  # vllm:request_success_total, per replica in order
    has_cached: bool = False  # the engines export prompt_tokens_cached (vLLM 0.32; not the mock)

    def __sub__(self, before: "EngineCounters") -> "EngineCounters":
        return EngineCounters(self.prompt - before.prompt, self.cached - before.cached, self.queries - before.queries,
                              self.hits - before.hits, self.generated - before.generated,
                              tuple(a - b for a, b in zip(self.done, before.done)), self.has_cached)

    @property
    def hit_rate(self) -> float:
        """The engines' prefix-hit rate: cached prompt tokens over prompt tokens (else the prefix cache's own hits
        over its queries)."""
        if self.has_cached:  # a run with nothing cached is 0%, not the other counter's number
            return self.cached / self.prompt if self.prompt else 0.0
        return self.hits / self.queries if self.queries else 0.0

    @property
    def busiest_share(self) -> float:
        """The busiest replica's finished requests over a fair share (1.0: even)."""
        total = sum(self.done)
        return max(self.done) / total * len(self.done) if total else float("nan")


_COUNTERS = {"vllm:prompt_tokens_total": "prompt", "vllm:prompt_tokens_cached_total": "cached",
             "vllm:prefix_cache_queries_total": "queries", "vllm:prefix_cache_hits_total": "hits",
             "vllm:generation_tokens_total": "generated"}


def samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """Every sample of a /metrics text as (name, labels, value): the one reader of /metrics in the benches (the
    Prometheus client's own parser)."""
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            yield s.name, s.labels, s.value


def metric_total(text: str, *names: str, **labels: str) -> float:
    """The sum of every series of any of ``names`` in a /metrics text (those with ``labels``, when given)."""
    return sum(v for n, lab, v in samples(text) if n in names and all(lab.get(k) == x for k, x in labels.items()))


def engine_counters(urls: list[str]) -> EngineCounters:
    """The counters of every replica at ``urls`` (one that does not answer counts nothing)."""
    out = EngineCounters()
    done = []
    for u in urls:
        n = 0.0
        try:
            text = http_get(u + "/metrics", timeout=5).decode()
        except OSError:
            done.append(0.0)
            continue
        for name, _, v in samples(text):
            out.has_cached |= name == "vllm:prompt_tokens_cached_total"
            if name in _COUNTERS:
                setattr(out, _COUNTERS[name], getattr(out, _COUNTERS[name]) + v)
            elif name == "vllm:request_success_total":
                n += v
        done.append(n)
    out.done = tuple(done)
    return out


def histogram_sums(text: str) -> dict[str, float]:
    """A real vLLM's own prefill and decode histograms, summed over its engines: computed prefill tokens and their
    prefill seconds, decode tokens (generated after each first token) and their decode seconds. Differences of
    two readings are the engine's true rates over the requests that finished between them."""
    def g(k: str) -> float:
        return metric_total(text, "vllm:" + k)

    return {"prefill_tokens": g("request_prefill_kv_computed_tokens_sum"),
            "prefill_seconds": g("request_prefill_time_seconds_sum"),
            "decode_tokens": g("request_generation_tokens_sum") - g("request_decode_time_seconds_count"),
            "decode_seconds": g("request_decode_time_seconds_sum")}


def brain_decision_mean(text: str) -> float | None:
    """The brain's mean decision time in seconds, from its /metrics text."""
    count = metric_total(text, "warmroute_decision_duration_seconds_count")
    return metric_total(text, "warmroute_decision_duration_seconds_sum") / count if count else None


def pace_check(ttft_p50: float, client_lag_p99: float, not_engine_p50: float | None, speedup: float) -> str | None:
    """Why a run measured itself rather than the replicas (None: it measured the replicas). ``ttft_p50`` and
    ``not_engine_p50`` in workload seconds; ``client_lag_p99`` in wall seconds (the replay's own event-loop lag)."""
    if ttft_p50 != ttft_p50 or ttft_p50 <= 0:
        return None
    lag = client_lag_p99 * speedup
    if lag >= CLIENT_LAG_SHARE * ttft_p50:
        return f"the client lagged {lag:.2f} s (p99, workload time) against a TTFT p50 of {ttft_p50:.2f} s"
    if not_engine_p50 is not None and not_engine_p50 == not_engine_p50 \
            and not_engine_p50 >= NOT_ENGINE_SHARE * ttft_p50:
        return (f"{not_engine_p50:.2f} s of the TTFT p50 of {ttft_p50:.2f} s was not the engines' "
                f"(client, Envoy, router, the replicas' HTTP)")
    return None


def class_headers(req) -> dict:
    """A request's flow-control class and tenant, as a trusted client sends them (peers ignore both)."""
    return {"x-warmroute-priority": CLASS_NAMES[req.klass], "x-warmroute-tenant": req.tenant or ""}


def bench_workload(minutes: float, sessions_per_min: float = 6.0, oneshots_per_min: float = 6.0,
                   projects: int = 6) -> WorkloadConfig:
    """The benchmarks' workload (live, and simulated by ``make bench-agree``): more sessions per minute than the
    simulator's default, so that a short run reaches a busy fleet."""
    return WorkloadConfig(minutes=minutes, sessions_per_min=sessions_per_min, projects=projects,
                          oneshots_per_min=oneshots_per_min)


def workload_arguments(ap, minutes: float = 6.0) -> None:
    """The live benches' workload and pace options, one set for all (``bench_workload`` reads them)."""
    ap.add_argument("--minutes", type=float, default=minutes, help="workload minutes per run (workload time)")
    ap.add_argument("--speedup", type=float, default=5.0,
                    help="time compression: at 5x the HTTP path and the brain are a few percent of a TTFT, and live "
                         "agrees with the simulator (make bench-agree)")
    # more sessions per minute than the simulator's default: a short run must reach a busy fleet
    ap.add_argument("--sessions-per-min", type=float, default=6.0)
    ap.add_argument("--oneshots-per-min", type=float, default=6.0)
    ap.add_argument("--projects", type=int, default=6)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--warmup-min", type=float, default=2.0,
                    help="requests before this are not measured (cold caches), as in the simulator's summary")


def scaled_warmroute_config(speedup: float) -> dict:
    """SPEC's time constants divided by the speed-up, so they keep their proportion to the traffic."""
    k = 1.0 / speedup
    return {
        "flow_control": {"wait_s": 30.0 * k, "sheddable_wait_s": 10.0 * k},
        "warm": {"load_refresh_s": 0.5 * k, "active_session_s": 60.0 * k, "rate_fresh_s": 60.0 * k,
                 "arrival_window_s": 60.0 * k, "busy_wait_s": 1.0 * k, "lora_load_s": 0.5 * k,
                 # a mock replica at --speedup S really prefills and decodes S times faster
                 "prefill_tokens_per_s": 5000.0 * speedup, "decode_s_per_token": 0.03 * k},
        "health": {"scrape_interval_s": 3.0 * k, "probing_clean_window_s": 15.0 * k, "cooldown_base_s": 30.0 * k,
                   "cooldown_max_s": 300.0 * k, "streak_reset_live_s": 600.0 * k},
        "pins": {"session_ttl_s": 3600.0 * k, "prefix_ttl_s": 300.0 * k},
        "routing": {"reservation_timeout_s": 3600.0 * k},
        # how late Envoy's access log releases a reservation: 10 ms of real time, 0.2 s of workload time at 20x if
        # left unscaled (Envoy's durations stop at milliseconds)
        "envoy": {"brain_health_check_interval_s": max(0.2, k), "access_log_flush_s": max(0.001, 0.01 * k)},
    }


@dataclass
class Running:
    url: str
    stack: Stack
    procs: list = field(default_factory=list)

    def stop(self) -> None:
        for p in self.procs:
            p.stop()
        self.stack.stop()


def front(contender: str, s: Stack, speedup: float = 1.0, model: str | None = None,
          answer_timeout_s: float = 60.0) -> Running:
    """``contender`` in front of the replicas ``s`` runs (mocks or real engines), as every bench starts it:
    warmroute's brain and Envoy on ``s`` (its variant's overlay already in ``s``'s config: ``contenders.overlaid``),
    or a peer router. A peer must answer a request first (for ``model``); warmroute too when ``model`` is given,
    else once every replica is LIVE."""
    proc = None
    if contender in WARMROUTE:
        s.write_config()
        s.start_brain()
        s.start_envoy()
        s.wait_all_live(60)
        run = Running(s.url, s)
    else:
        url, proc = start_peer(contender, [r.url for r in s.replicas], s.dir, speedup)
        run = Running(url, s, [proc])
    if model is not None or proc is not None:
        wait_answering(run.url, model or MOCK_MODEL, contender, proc, answer_timeout_s)
    return run


def start(contender: str, n: int, mock_args: list[str], speedup: float,
          replica_args: dict[str, list[str]] | None = None) -> Running:
    """A fresh fleet of ``n`` mock replicas and ``contender`` in front of it, answering; ``replica_args``: more
    mock-vllm arguments of replica ``r{i}`` (a mixed fleet's ``--speed``)."""
    replica_args = replica_args or {}
    config = overlaid(scaled_warmroute_config(speedup), contender) if contender in WARMROUTE else None
    s = Stack(0, config=config, mock_args=mock_args)
    try:
        s.replicas = [s.start_replica(f"r{i}", extra=[*mock_args, *replica_args.get(f"r{i}", [])]) for i in range(n)]
        return front(contender, s, speedup)
    except BaseException:
        s.stop()
        raise
