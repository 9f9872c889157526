"""The brain's Prometheus metrics.

The request path only bumps plain counters in ``BrainStats`` (and one histogram); every gauge
and counter below is read from the router and those counters when Prometheus scrapes, so
exporting costs the request path next to nothing (``make bench-core`` prints the ratio).
Label sets come from the core's enums: a new reason, action or cause is exported as it appears.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..core import BodyStatus, PinAction, Router, State, imbalance_index
from ..core.engine_cache import mode_of
from ..core.flow import CLASSES
from .outcomes import WINDOW, Outcomes
from .stats import BrainStats

# One family per pin action; spill and pin are labelled by kind only (their cause is fixed).
PIN_ACTION_METRICS: dict[PinAction, tuple[str, str, bool]] = {
    PinAction.SPILL: ("warmroute_spills", "Pins that could not be used (the request went elsewhere)", False),
    PinAction.REBIND: ("warmroute_rebinds", "Pins moved to another replica, by cause", True),
    PinAction.UNPIN: ("warmroute_unpins", "Pins deleted, by cause", True),
    PinAction.PIN: ("warmroute_pins_created", "Pins created", False),
}


WARM_VIEW = {
    "prefill_tokens_per_second": "Prefill rate learned from the replica's counters, beside no other request (C3)",
    "decode_seconds_per_token": "Decode time per token learned from the replica's counters, beside no other request "
    "(C3)",
    "prefill_slowdown_per_running_request": "How much each request running beside one makes its prefill seconds "
                                            "per token grow, learned (0.1: 10% a request)",
    "decode_slowdown_per_running_request": "How much each request running beside one makes its decode seconds per "
                                           "token grow, learned (0.1: 10% a request)",
    "prefix_index_blocks": "Blocks the prefix index believes the replica holds (C2)",
    "prefix_index_capacity_blocks": "The index's bound: the replica's cache size in blocks (C2)",
    "predicted_wait_seconds": "Prefill work ahead on the replica, as the warm policy sees it (C3)",
    "in_flight_work_seconds": "Predicted engine seconds of this router's requests in flight (C1, C5)",
    "active_session_tokens": "Context of the sessions active on the replica (its working set)",
    "cache_tokens": "The replica's KV cache in tokens (scraped blocks x block size; warm.cache_tokens until scraped)",
    "pending_kv_tokens": "Prompt tokens of requests still in their predicted prefill: KV not yet in the scraped usage",
    "engine_tokens_per_estimated_token": "The engine's prompt tokens per token the profile estimated (its tokenizer "
                                         "and chat template, learned from its prompt_tokens; 1 until learned)",
    "first_token_overhead_seconds": "What the replica's first tokens take beyond the cost model (its API server's "
                                    "own work), learned from Envoy's timing: the line's value at 0 prompt tokens; its "
                                    "peers' until measured",
    "first_token_overhead_seconds_per_token": "The same overhead's growth per prompt token (tokenizing and hashing "
                                              "the whole prompt)",
    "restore_seconds_per_token": "An offloading connector's time to restore a token to the GPU, learned from "
                                 "vllm:kv_offload_load_time over the tokens it loaded (no sample until measured)",
}


MAX_TENANT_SERIES = 200  # tenants by their hash, the most spent first: a series per API key would be unbounded


def _by_label(name: str, doc: str, label: str, counts: "Mapping[str, float]") -> CounterMetricFamily:
    """A counter family of one label, a series for each key counted so far."""
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, n in sorted(counts.items()):
        family.add_metric([key], n)
    return family


def _tenants(caps) -> Iterable[Metric]:
    """Per tenant (its hash, as flow control counts it), what its token cap counted and refused."""
    spent = CounterMetricFamily("warmroute_tenant_tokens",
                                "Engine tokens a capped tenant's placed requests cost (their "
                                "prompts' uncached part and expected answers), counted by every brain, by tenant "
                                f"hash; the {MAX_TENANT_SERIES} largest", labels=["tenant"])
    capped = CounterMetricFamily("warmroute_tenant_capped_requests", "Requests refused 429 at their tenant's token "
                                 "cap, by tenant hash", labels=["tenant"])
    if caps is not None:  # up to MAX_TENANTS counted: a partial selection, not a sort, on each scrape
        for tenant, tokens in heapq.nlargest(MAX_TENANT_SERIES, caps.spent.items(), key=lambda kv: kv[1]):
            spent.add_metric([tenant or "-"], tokens)
        for tenant, n in heapq.nlargest(MAX_TENANT_SERIES, caps.refused.items(), key=lambda kv: kv[1]):
            capped.add_metric([tenant or "-"], n)
    yield spent
    yield capped


class BrainCollector(Collector):
    def __init__(self, router: Router, stats: BrainStats, clock: Callable[[], float]):
        self.router = router
        self.stats = stats
        self.clock = clock

    def collect(self) -> Iterable[Metric]:
        b = self.stats
        r = self.router
        now = self.clock()
        reps = r.replicas

        c = CounterMetricFamily("warmroute_decisions", "Routing decisions by replica and reason", labels=["replica",
                                                                                                          "reason"])
        for (name, reason), n in sorted(b.decisions.items()):
            c.add_metric([name, reason], n)
        yield c
        c = CounterMetricFamily("warmroute_predicted_cached_tokens",
                                "Prompt tokens routing predicted the chosen replica "
                                "held, over the requests placed (engine tokens): against "
                                "warmroute_engine_cached_tokens, "
                                "how far the brain's belief of the caches holds", labels=["replica"])
        for name, n in sorted(b.predicted_cached.items()):
            c.add_metric([name], n)
        yield c
        c = CounterMetricFamily("warmroute_engine_cached_tokens",
                                "The replica's own prefix-cache hits in tokens since it "
                                "started (vllm:prefix_cache_hits), as last scraped", labels=["replica"])
        for rep in reps:
            if rep.engine_cached_tokens is not None:
                c.add_metric([rep.name], rep.engine_cached_tokens)
        yield c
        c = CounterMetricFamily("warmroute_decision_pins",
                                "Decisions by the pin kind that was resolved (none: no pin)", labels=["kind"])
        for kind, n in sorted(b.decisions_by_pin.items()):
            c.add_metric([kind], n)
        yield c
        c = CounterMetricFamily("warmroute_request_bodies", "Requests by what the profile could read of the body "
                                "(anything but ok is routed by headers only)", labels=["status"])
        for status, n in sorted(b.bodies.items()):
            c.add_metric([status], n)
        yield c
        c = CounterMetricFamily("warmroute_decisions_by_path", "Requests the brain answered, by the path that decided "
                                "them: headers (a turn of a session under way, its body never read) or body",
                                labels=["path"])
        headers = b.bodies[BodyStatus.HEADER_PATH]
        c.add_metric(["headers"], headers)
        c.add_metric(["body"], sum(b.bodies.values()) - headers)
        yield c
        c = CounterMetricFamily("warmroute_header_path_declined", "Requests asked about at their headers whose body "
                                "decided them instead, by why (docs/architecture.md, \"Two paths\")", labels=["why"])
        for why, n in sorted(b.header_path_declined.items()):
            c.add_metric([why], n)
        yield c
        fams: dict[str, tuple[CounterMetricFamily, bool]] = {
            a: (CounterMetricFamily(name, doc, labels=["kind", "cause"] if by_cause else ["kind"]), by_cause)
            for a, (name, doc, by_cause) in PIN_ACTION_METRICS.items()}
        for (action, kind, cause), n in sorted(b.pin_events.items()):
            fam, by_cause = fams[action]
            fam.add_metric([kind, cause] if by_cause else [kind], n)
        yield from (f for f, _ in fams.values())
        g = GaugeMetricFamily("warmroute_pins", "Live pins", labels=["kind"])
        e = CounterMetricFamily("warmroute_pin_expirations", "Pins that died of idleness (TTL)", labels=["kind"])
        ev = CounterMetricFamily("warmroute_pin_evictions",
                                 "Pins dropped, least recently used first, past pins.max_pins",
                                 labels=["kind"])
        for t in (r.session_pins, r.prefix_pins):
            g.add_metric([t.kind], len(t))
            e.add_metric([t.kind], t.expired)
            ev.add_metric([t.kind], t.evicted)
        yield g
        yield e
        yield ev

        state = GaugeMetricFamily("warmroute_replica_state", "1 for the replica's current health state",
                                  labels=["replica", "state"])
        drained = GaugeMetricFamily("warmroute_replica_drained", "1 if an operator drained the replica",
                                    labels=["replica"])
        ejections = CounterMetricFamily("warmroute_ejections", "Ejections of the replica", labels=["replica"])
        cooldown = GaugeMetricFamily("warmroute_cooldown_seconds", "Ejection cooldown of the replica's current streak",
                                     labels=["replica"])
        remaining = GaugeMetricFamily("warmroute_cooldown_remaining_seconds", "Seconds left of the current cooldown",
                                      labels=["replica"])
        er = GaugeMetricFamily("warmroute_effective_running", "max(scraped running, wlc_in_flight)", labels=["replica"])
        ew = GaugeMetricFamily("warmroute_effective_waiting", "scraped waiting + in-flight not yet seen by a scrape",
                               labels=["replica"])
        wlc = GaugeMetricFamily("warmroute_wlc_in_flight", "Token-weighted in-flight work of this router",
                                labels=["replica"])
        inflight = GaugeMetricFamily("warmroute_in_flight_requests", "Requests of this router in flight",
                                     labels=["replica"])
        sr = GaugeMetricFamily("warmroute_scraped_running", "vllm:num_requests_running at the last good scrape",
                               labels=["replica"])
        sw = GaugeMetricFamily("warmroute_scraped_waiting", "vllm:num_requests_waiting at the last good scrape",
                               labels=["replica"])
        kv = GaugeMetricFamily("warmroute_scraped_kv_usage", "KV cache usage (0-1) at the last good scrape",
                               labels=["replica"])
        for rep in reps:
            h = rep.health
            for s in State:
                state.add_metric([rep.name, s.value], 1.0 if h.state is s else 0.0)
            drained.add_metric([rep.name], 1.0 if rep.drained else 0.0)
            ejections.add_metric([rep.name], h.ejections)
            cooldown.add_metric([rep.name], h.cooldown_s)
            remaining.add_metric([rep.name], max(0.0, h.cooldown_until - now) if h.state is State.EJECTED else 0.0)
            er.add_metric([rep.name], rep.effective_running)
            ew.add_metric([rep.name], rep.effective_waiting)
            wlc.add_metric([rep.name], rep.wlc_in_flight)
            inflight.add_metric([rep.name], rep.in_flight_requests)
            sr.add_metric([rep.name], rep.scraped_running)
            sw.add_metric([rep.name], rep.scraped_waiting)
            kv.add_metric([rep.name], rep.kv_usage)
        yield from (state, drained, ejections, cooldown, remaining, er, ew, wlc, inflight, sr, sw, kv)
        yield GaugeMetricFamily("warmroute_cooldown_max_seconds", "The cooldown ceiling (SPEC A2: 300 s)",
                                value=r.cfg.health.cooldown_max_s)

        sc = CounterMetricFamily("warmroute_scrapes", "Scrapes of the replicas' /metrics by result", labels=["replica",
                                                                                                             "result"])
        for (name, result), n in sorted(b.scrapes.items()):
            sc.add_metric([name, result], n)
        yield sc
        yield CounterMetricFamily("warmroute_reservation_safety_timeouts",
                                  "Reservations released by the safety timeout (their end was never seen)",
                                  value=r.safety_timeouts)
        yield CounterMetricFamily("warmroute_reservation_liveness_timeouts",
                                  "Reservations no access-log entry named within the liveness bound (a lost or rogue "
                                  "ext_proc call)", value=r.liveness_timeouts)
        yield CounterMetricFamily("warmroute_passive_ejections_refused",
                                  "Users' requests' failures that would have ejected more than "
                                  "health.max_passive_ejection_percent of the fleet", value=r.passive_ejections_refused)
        yield GaugeMetricFamily("warmroute_open_reservations", "Reservations not yet released",
                                value=r.open_reservations)
        yield CounterMetricFamily("warmroute_access_log_releases", "Reservations released by Envoy's access log",
                                  value=b.releases_by_log)
        yield CounterMetricFamily("warmroute_forged_response_ids", "Stored-response ids in the brain's minted form "
                                  "whose MAC did not verify: answered 404, no replica asked",
                                  value=b.forged_response_ids)
        yield CounterMetricFamily("warmroute_response_releases", "Reservations released by the endpoint picker at "
                                  "the response's end (or its stream's)", value=b.releases_by_response)
        yield CounterMetricFamily("warmroute_picker_streams_reset", "Endpoint-picker streams that ended before their "
                                  "response did (client gone, replica reset, gateway restart)",
                                  value=b.picker_streams_reset)
        yield CounterMetricFamily("warmroute_discovery_failures",
                                  "Replica discovery lookups that failed; the last good "
                                  "replica set stays", value=b.discovery_failures)
        yield GaugeMetricFamily("warmroute_discovery_up", "1 when the discovery source's last lookup succeeded; 0: "
                                "the replica set is frozen at the last good one", value=b.discovery_up)
        yield CounterMetricFamily("warmroute_discovery_changes", "Replica sets discovery applied",
                                  value=b.discovery_changes)
        yield _by_label("warmroute_call_faults", "Envoy's calls whose decision raised in the brain, by call (body, "
                        "header, look, door): each request went on without the brain (failure_mode_allow); the brain's "
                        "log names the error", "call", b.call_faults)
        yield CounterMetricFamily("warmroute_reservations_released_envoy_gone",
                                  "Reservations released because every access-log stream from Envoy closed (it died "
                                  "or restarted)", value=b.released_envoy_gone)
        yield _by_label("warmroute_access_log_entries", "Envoy's access-log entries, by the way they came: grpc (its "
                        "access-log service) or door (its fluentd logger at the brain's log door)", "transport",
                        b.log_entries)
        yield _by_label("warmroute_access_log_messages", "Messages that carried access-log entries (one a flush of "
                        "envoy.access_log_flush_s), by the way they came", "transport", b.log_messages)
        yield CounterMetricFamily("warmroute_access_log_door_refused", "Connections the log door closed for a stream "
                                  "that was not Fluentd Forward (what came before stayed)", value=b.log_streams_refused)
        yield CounterMetricFamily("warmroute_access_log_unmatched", "Access-log entries that named no open reservation "
                                  "and no known replica (e.g. requests Envoy answered itself)",
                                  value=b.unmatched_log_entries)
        routable = [x.name for x in reps if x.health.state is not State.EJECTED and not x.drained]
        yield GaugeMetricFamily("warmroute_imbalance_index",
                                "max(share)/mean(share) of decisions over 5 min across routable replicas (SPEC B)",
                                value=imbalance_index(b.window.counts(now), routable))
        yield GaugeMetricFamily("warmroute_replicas_known", "Replicas in the config", value=len(reps))
        info = GaugeMetricFamily("warmroute_routing_policy", "1 for the routing policy in force", labels=["policy"])
        info.add_metric([r.policy.name], 1.0)
        yield info
        views = [(rep, r.policy.replica_view(rep, now)) for rep in reps]
        if any(v is not None for _, v in views):  # the warm policy: what it believes of each replica
            gauges = {k: GaugeMetricFamily(f"warmroute_{k}", doc, labels=["replica"]) for k, doc in WARM_VIEW.items()}
            for rep, view in views:
                for k, v in (view or {}).items():
                    gauges[k].add_metric([rep.name], v)
            yield from gauges.values()
        # each replica's cache mode and what re-hashing its engines' events said
        mode = GaugeMetricFamily("warmroute_cache_exact", "1 when the replica's engines' KV events verified (its "
                                 "cached tokens are the engine's own word), 0 when it is estimated", labels=["replica"])
        blocks = CounterMetricFamily("warmroute_kv_event_blocks", "Blocks the replica's engines reported stored, "
                                     "by what re-hashing them said (verified, mismatched, unverifiable)",
                                     labels=["replica", "result"])
        resident = GaugeMetricFamily("warmroute_exact_resident_blocks", "Exact mode: blocks the replica's engines "
                                     "hold by their KV events, per medium (GPU; an offloading connector's CPU, "
                                     "STORAGE)", labels=["replica", "medium"])
        for rep in reps:
            engines = r.policy.exact_view(rep.name)
            mode.add_metric([rep.name], 1.0 if mode_of(engines)[0] == "exact" else 0.0)
            for res in ("verified", "mismatched", "unverifiable"):
                blocks.add_metric([rep.name, res], sum(eng[f"{res}_blocks"] for eng in engines or ()))
            per_medium: dict[str, int] = {}
            for eng in engines or ():
                for m, n in eng["resident_by_medium"].items():
                    per_medium[m] = per_medium.get(m, 0) + n
            for m, n in sorted(per_medium.items()):
                resident.add_metric([rep.name, m], n)
        yield mode
        yield blocks
        yield resident
        restored = CounterMetricFamily("warmroute_exact_restored_tokens", "Exact mode: prompt tokens past the GPU's "
                                       "hit that routing priced as restored from an offloaded tier of the chosen "
                                       "replica, per medium (warm.offload_tiers)", labels=["replica", "medium"])
        for (name, m), n in sorted(b.exact_restored.items()):
            restored.add_metric([name, m], n)
        yield restored
        hits = CounterMetricFamily("warmroute_exact_cached_tokens", "Exact mode: the engine's cached tokens of "
                                   "the prompts routed to the replica (achieved), and the most any exact replica "
                                   "held of each of them (reachable)", labels=["replica", "of"])
        for rep in reps:
            hits.add_metric([rep.name, "achieved"], b.exact_achieved[rep.name])
            hits.add_metric([rep.name, "reachable"], b.exact_reachable[rep.name])
        yield hits
        yield GaugeMetricFamily("warmroute_config_reloads", "Config reloads since start", value=b.reloads)
        yield from _shared_state(b.shared, r, now)
        yield GaugeMetricFamily("warmroute_flow_held_requests", "Requests flow control holds in the brain (every "
                                "replica saturated for them); 0 while flow_control is off",
                                value=len(r.flow) if r.flow is not None else 0)
        yield _by_label("warmroute_flow_refused", "Requests flow control answered 429 with Retry-After, by reason "
                        "(queue_full, waited_too_long, deadline_unmeetable, router_behind, tenant_over_cap)", "reason",
                        b.flow_refused)
        yield from _tenants(r.caps)
        depth = GaugeMetricFamily("warmroute_flow_queue_depth", "Requests held, by class (critical, standard, "
                                  "sheddable)", labels=["class"])
        released = CounterMetricFamily("warmroute_flow_released", "Held requests let go to a replica (or whose "
                                       "client had gone by then), by class", labels=["class"])
        waited = CounterMetricFamily("warmroute_flow_wait_seconds", "Seconds the released requests were held, by "
                                     "class (over warmroute_flow_released_total: the mean wait)", labels=["class"])
        abandoned = CounterMetricFamily("warmroute_flow_abandoned", "Held requests whose call ended before the brain "
                                        "answered: the client went away, or Envoy's message timer ran out and it "
                                        "failed the request open, by class", labels=["class"])
        for rank, klass in enumerate(CLASSES):
            depth.add_metric([klass], r.flow.queue.depth(rank) if r.flow is not None else 0)
            released.add_metric([klass], b.flow_released[klass])
            waited.add_metric([klass], b.flow_wait_s[klass])
            abandoned.add_metric([klass], b.flow_abandoned[klass])
        yield from (depth, released, waited, abandoned)
        pd = CounterMetricFamily("warmroute_disaggregated", "Requests whose prefill went to a replica of role prefill, "
                                 "by outcome (remote: the decode replica loaded the KV; local_fallback: the leg failed "
                                 "and the decode replica computed the prompt; abandoned: the client left between the "
                                 "legs)", labels=["outcome"])
        for outcome, n in sorted(b.disaggregated.items()):
            pd.add_metric([outcome], n)
        yield pd
        rate = r.policy.transfer
        yield GaugeMetricFamily("warmroute_kv_transfer_tokens_per_second", "KV moved between replicas, prompt tokens a "
                                "second: learned from decode legs, disaggregation.transfer_tokens_per_s until then",
                                value=rate.value if rate is not None else 0.0)


def _shared_state(s, r: Router, now: float) -> Iterable[Metric]:
    """Several brains (shared_state): every series exists, 0 while sharing is off."""
    p = "warmroute_shared_state_"
    yield GaugeMetricFamily(p + "enabled", "1 when shared_state.redis_url is set", value=s.enabled)
    yield GaugeMetricFamily(p + "signed", "1 when entries and snapshots carry a MAC under shared_state.secret_file",
                            value=s.signed)
    rej = CounterMetricFamily(p + "rejected", "Entries and snapshots from Redis not applied, by reason (not signed, "
                              "malformed, too large, from the future)", labels=["reason"])
    for reason, n in sorted(s.rejected.items()):
        rej.add_metric([reason], n)
    yield rej
    over = CounterMetricFamily(p + "peer_bound", "Other brains' events not applied because they passed what one brain "
                               "may claim (open reservations, pending tokens on a replica, chain blocks)",
                               labels=["kind"])
    for kind, n in sorted(r.remote.refused.items()):
        over.add_metric([kind], n)
    yield over
    yield CounterMetricFamily(p + "stream_stuck", "The stream could not advance (an entry with the largest id): "
                              "deleted and started again", value=s.stream_stuck)
    yield CounterMetricFamily(p + "future_ids", "This brain's last entry id or a snapshot's was past the stream's "
                              "newest: resynchronised from the snapshot", value=s.future_ids)
    yield CounterMetricFamily(p + "peers_gone", "Other brains that fell silent past shared_state.peer_timeout_s",
                              value=s.peers_gone)
    silence = GaugeMetricFamily(p + "peer_silence_seconds", "Seconds since each other brain was last heard from "
                                "(until it is gone, at shared_state.peer_timeout_s)", labels=["peer"])
    for peer, seen in sorted(s.peer_seen.items()):
        silence.add_metric([peer], max(0.0, now - seen))
    yield silence
    yield GaugeMetricFamily(p + "up", "1 while Redis answers; 0: routing on this brain's own view", value=s.up)
    yield GaugeMetricFamily(p + "peers", "Other brains heard from within shared_state.peer_timeout_s", value=s.peers)
    yield GaugeMetricFamily(p + "remote_reservations", "Other brains' requests in flight, counted on the replicas here",
                            value=len(r.remote.reservations))
    yield CounterMetricFamily(p + "events_published", "State changes this brain shipped", value=s.published_events)
    yield CounterMetricFamily(p + "events_applied", "Other brains' state changes applied here", value=s.applied_events)
    yield CounterMetricFamily(p + "events_dropped", "State changes not shipped because Redis was away",
                              value=s.dropped_events)
    f = CounterMetricFamily(p + "failures", "Redis failures by kind (connect, auth, timeout, error)", labels=["kind"])
    for kind, n in sorted(s.failures.items()):
        f.add_metric([kind], n)
    yield f
    yield CounterMetricFamily(p + "resyncs", "Snapshot imports after missed changes were trimmed from the stream",
                              value=s.resyncs)
    yield CounterMetricFamily(p + "index_gaps", "Indexed-block deltas dropped: their prefix was unknown here",
                              value=s.index_gaps)
    yield GaugeMetricFamily(p + "lag_seconds", "Wall time from another brain's flush to its changes applied here "
                            "(the last entry)", value=s.lag_seconds)
    yield GaugeMetricFamily(p + "warm_start_seconds", "Snapshot + replay before this brain reported SERVING",
                            value=s.warm_start_seconds)


@dataclass(frozen=True)
class Instruments:
    registry: CollectorRegistry
    decision: Histogram
    scrape: Histogram
    predicted_ttft: Histogram
    ttft_error: Histogram


class PredictionCollector(Collector):
    """Each replica's predicted time to first token against what Envoy saw (``outcomes.Outcomes``)."""

    def __init__(self, router: Router, outcomes: Outcomes):
        self.router, self.outcomes = router, outcomes

    def collect(self) -> Iterable[Metric]:
        p = "warmroute_ttft_prediction_"
        joined = CounterMetricFamily(p + "joined", "Streamed requests whose first token, as Envoy saw it, was joined "
                                     "with the brain's prediction", labels=["replica"])
        bias = GaugeMetricFamily(p + "bias", "Summed predicted over summed observed time to first token, minus one, "
                                 f"over the last {WINDOW} joined requests (+0.3: predicted 30% too slow)",
                                 labels=["replica"])
        mape = GaugeMetricFamily(p + "mape", "Mean absolute percentage error of the predicted time to first token, "
                                 f"over the last {WINDOW} joined requests", labels=["replica"])
        p90 = GaugeMetricFamily(p + "abs_error_p90_seconds", "90th percentile of |predicted - observed| time to first "
                                f"token, over the last {WINDOW} joined requests", labels=["replica"])
        for r in self.router.replicas:
            joined.add_metric([r.name], self.outcomes.joined_total.get(r.name, 0))
            e = self.outcomes.error(r.name)
            if e is not None:
                bias.add_metric([r.name], e.bias)
                mape.add_metric([r.name], e.mape)
                p90.add_metric([r.name], e.p90_abs_error_s)
        yield from (joined, bias, mape, p90)


def make_registry(router: Router, stats: BrainStats, clock: Callable[[], float],
                  outcomes: Outcomes | None = None) -> Instruments:
    reg = CollectorRegistry()
    reg.register(BrainCollector(router, stats, clock))
    reg.register(PredictionCollector(router, outcomes if outcomes is not None else Outcomes()))
    decision = Histogram("warmroute_decision_duration_seconds", "Profile + select + reserve, per request",
                         buckets=(2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 5e-2, 0.25), registry=reg)
    scrape = Histogram("warmroute_scrape_duration_seconds", "Duration of one scrape of a replica's /metrics",
                       buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=reg)
    ttft_buckets = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
    predicted = Histogram("warmroute_predicted_ttft_seconds", "The warm policy's estimated time to first token of "
                          "the replica it chose (C3)", buckets=ttft_buckets, registry=reg)
    error = Histogram("warmroute_ttft_prediction_error_seconds", "|predicted - observed| time to first token of a "
                      "streamed request, observed by Envoy from its last byte sent to the replica to the response "
                      "body's first byte", buckets=ttft_buckets, registry=reg)
    return Instruments(reg, decision, scrape, predicted, error)


def metric_names() -> set[str]:
    """Every metric family the brain exports (names as families carry them: counters without ``_total``)."""
    from ..core import RouterConfig

    router = Router(RouterConfig(policy="warm"), ["r0"], 0.0)
    reg = make_registry(router, BrainStats(["r0"]), lambda: 0.0).registry
    return {m.name for m in reg.collect()}


__all__ = ["BrainCollector", "PIN_ACTION_METRICS", "make_registry", "metric_names"]
