"""GET /state: the brain's view of itself, as the admin API serves it (hashes and replica names only). Each
function reads a ``Brain`` (not imported: ``brain.py`` imports this file)."""

from __future__ import annotations

from ..core.flow import CLASSES


def _shared_view(brain, now: float) -> dict:
    sh = brain.stats.shared
    return {"enabled": bool(sh.enabled), "up": bool(sh.up), "signed": bool(sh.signed),
            "peers": {p: round(now - seen, 1) for p, seen in sorted(sh.peer_seen.items())},
            "peers_gone": sh.peers_gone, "rejected": dict(sorted(sh.rejected.items())),
            "stream_stuck": sh.stream_stuck, "future_ids": sh.future_ids,
            "peer_bound": dict(brain.router.remote.refused), "peer_chain_blocks": brain.router.remote.blocks}


def state_of(brain) -> dict:
    """What GET /state shows: every replica as routing sees it, the decisions, the reservations, the bounded tables,
    discovery, flow control and shared state. Hashes and replica names only."""
    per = brain.stats.decisions_per_replica()
    now = brain.clock()
    reps = brain.router.snapshot()
    for r in reps:
        r["decisions"] = per.get(r["name"], 0)
        r["url"] = brain.scraper.urls.get(r["name"])
        engine = brain.scraper.engines.get(r["name"], "vllm")
        r["engine"] = f"auto ({brain.scraper.detected.get(r['name'], '?')})" if engine == "auto" else engine
        r["scrape_error"] = brain.scraper.errors.get(r["name"])
        r["models"] = brain.models.served_by(r["name"])
        r["paths"] = brain.models.paths_of(r["name"])
        r["engines"] = brain.router.policy.engines_view(r["name"])
        r["cache"] = brain.exact.replica_view(r["name"])  # exact (the engine's own events, verified) or estimated
        v = brain.router.policy.replica_view(brain.router.replica(r["name"]), now)
        if v is not None:  # what routing believes is queued there: all of it goes when requests end
            r["predicted"] = {k: round(v[k], 3) for k in ("predicted_wait_seconds", "in_flight_work_seconds",
                                                          "pending_kv_tokens", "active_session_tokens",
                                                          "cache_tokens")}
            r["learned"] = {k: round(v[k], 6) for k in ("prefill_tokens_per_second", "decode_seconds_per_token",
                                                        "prefill_slowdown_per_running_request",
                                                        "decode_slowdown_per_running_request",
                                                        "engine_tokens_per_estimated_token",
                                                        "first_token_overhead_seconds",
                                                        "first_token_overhead_seconds_per_token",
                                                        "restore_seconds_per_token") if k in v}
        r["cooldown_remaining_s"] = max(0.0, r.pop("cooldown_until") - now)
        # routing's predicted cached tokens beside the engine's own hits: a shortfall is context the brain
        # counted as held that the engine had evicted
        r["cached_tokens"] = {"predicted": brain.stats.predicted_cached[r["name"]],
                              "engine": brain.router.replica(r["name"]).engine_cached_tokens}
        # the predicted time to first token against what Envoy saw, over the last streamed requests here
        err = brain.releaser.outcomes.error(r["name"])
        r["prediction_error"] = err.as_dict() if err is not None else None
    return {
        "policy": brain.router.cfg.policy,
        "selects": brain.router.selects,
        "replicas": reps,
        "recent_transitions": [
            {"at_s_ago": round(now - t.at, 1), "replica": t.replica, "old": t.old.value, "new": t.new.value,
             "reason": t.reason, "cooldown_s": t.cooldown_s}
            for t in list(brain.router.transitions)[-20:]
        ],
        "decisions_by_reason": {f"{k[0]}/{k[1]}": v for k, v in sorted(brain.stats.decisions.items())},
        "bodies": {k: v for k, v in sorted(brain.stats.bodies.items()) if v},
        "open_reservations": brain.router.open_reservations,
        "oldest_open_reservations": brain.router.reservations.oldest(now),
        "releases_by_access_log": brain.stats.releases_by_log,
        "unmatched_access_log_entries": brain.stats.unmatched_log_entries,
        "safety_timeouts": brain.router.safety_timeouts,
        "liveness_timeouts": brain.router.liveness_timeouts,
        "liveness_bound_s": brain.router.liveness_timeout_s,
        "released_envoy_gone": brain.stats.released_envoy_gone,
        "access_log_streams": brain.envoy.open_streams,
        "session_pins": len(brain.router.session_pins),
        "prefix_pins": len(brain.router.prefix_pins),
        "chain_cache": {"sessions": len(brain.chains), "blocks": brain.chains.blocks,
                        "max_sessions": brain.chains.max_sessions, "max_blocks": brain.chains.max_blocks},
        "request_ids_held": len(brain.ledger.by_request_id),
        "released_at_issue": brain.ledger.released_at_issue,
        "superseded_at_headers": brain.ledger.superseded_at_headers,
        "protocol": brain.cfg.brain.protocol,
        "releases_by_response": brain.stats.releases_by_response,
        "discovery": {"source": brain.cfg.discovery.source, "synced": brain.discovered,
                      "error": brain.discovery_error, "changes": brain.stats.discovery_changes,
                      "failures": brain.stats.discovery_failures},
        "flow_control": _flow_state(brain),
        "shared_state": _shared_view(brain, now),
        "exact_cache": brain.exact.view(),
    }


def _flow_state(brain) -> dict | None:
    """Flow control per class: held now, let go and their mean wait; refusals by reason (None: off)."""
    flow = brain.router.flow
    if flow is None:
        return None
    released, waited = brain.stats.flow_released, brain.stats.flow_wait_s
    return {"held": len(flow), "held_bytes": flow.queue.bytes,
            "classes": {name: {"held": flow.queue.depth(k), "released": released[name],
                               "mean_wait_s": round(waited[name] / released[name], 3) if released[name] else None}
                        for k, name in enumerate(CLASSES)},
            "refused": dict(brain.stats.flow_refused), "abandoned": dict(brain.stats.flow_abandoned),
            # the look before a large body's upload: how far behind the brain may read before it refuses new
            # sessions (a turn of the sessions under way, predicted; half Envoy's first timer with none)
            "look_bound_s": round(brain.look_bound_s(brain.clock()), 4),
            # what a new session's first turn counts at in the working sets that hold new sessions (the learned share
            # of new sessions that came back; a session back counts in full): below 1, more sessions are let in
            # than all their contexts would fit
            "returning_share": None if (share := brain.router.policy.returning_share()) is None else round(share, 3)}
