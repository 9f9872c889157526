"""What the brain counts for its metrics, in one object the collector reads at scrape time.

The request path only bumps plain counters here; nothing is formatted until Prometheus asks.
Every series exists from the start (at 0), with label sets taken from the core's enums.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Iterable

from ..core import BodyStatus, Decision, PinKind, Reason
from ..core.flow import CLASSES
from ..core.names import PIN_EVENTS
from .header_path import WHY as HEADER_PATH_WHY

IMBALANCE_WINDOW_S = 300.0  # SPEC A5: the imbalance alert looks at 5 minutes
_BUCKET_S = 10.0
SCRAPE_RESULTS = ("ok", "failed")


# the brain's calls from Envoy, as warmroute_call_faults_total{call} names them
CALLS = ("body", "header", "look", "door")


class DecisionWindow:
    """Decisions per replica over the last 5 minutes, in 10 s buckets (for the imbalance index)."""

    def __init__(self, window_s: float = IMBALANCE_WINDOW_S):
        self.n = int(window_s / _BUCKET_S)
        self.buckets: deque[tuple[int, Counter]] = deque()

    def add(self, replica: str, now: float) -> None:
        b = int(now // _BUCKET_S)
        if not self.buckets or self.buckets[-1][0] != b:
            self.buckets.append((b, Counter()))
            while self.buckets and self.buckets[0][0] <= b - self.n:
                self.buckets.popleft()
        self.buckets[-1][1][replica] += 1

    def counts(self, now: float) -> Counter:
        b = int(now // _BUCKET_S)
        out: Counter = Counter()
        for k, c in self.buckets:
            if k > b - self.n:
                out.update(c)
        return out


class SharedStats:
    """What the metrics say of sharing (``warmroute_shared_state_*``): every series exists, 0 when off."""

    def __init__(self) -> None:
        self.enabled = 0
        self.up = 0
        self.peers = 0
        self.published_events = 0
        self.published_entries = 0
        self.applied_events = 0
        self.dropped_events = 0  # changes not shipped while Redis was away
        self.failures: dict[str, int] = {"connect": 0, "auth": 0, "timeout": 0, "error": 0}
        self.resyncs = 0  # snapshot imports after entries this brain missed were trimmed away
        self.replayed_entries = 0
        self.snapshots_written = 0
        self.lag_seconds = 0.0  # wall time from another brain's flush to its entry being applied here
        self.warm_start_seconds = 0.0
        self.index_gaps = 0
        self.signed = 0  # 1: entries and snapshots carry a MAC under shared_state.secret_file
        self.rejected: dict[str, int] = {}  # entries and snapshots not applied, by reason
        self.stream_stuck = 0  # the stream could not advance (a planted largest id): deleted and started again
        self.future_ids = 0  # this brain's last id, or a snapshot's, was past the stream's newest: resynchronised
        self.peers_gone = 0  # other brains that fell silent past peer_timeout_s
        self.peer_seen: dict[str, float] = {}  # brain id -> when last heard (the brain's clock)


class BrainStats:
    def __init__(self, replica_names: Iterable[str] = ()):
        self.decisions: Counter[tuple[str, str]] = Counter()  # (replica, reason)
        # calls whose decision raised, by call (body, header, look, door): Envoy routed each without the brain
        self.call_faults: Counter[str] = Counter(dict.fromkeys(CALLS, 0))  # every series from the start, at 0
        self.decisions_by_pin: Counter[str] = Counter()  # pin kind resolved, or "none"
        self.pin_events: Counter[tuple[str, str, str]] = Counter()  # (action, kind, cause)
        self.bodies: Counter[str] = Counter()  # body status: how much traffic is routed by headers only
        # (replica, ok|failed|deferred: timed out while the loop stalled, retried)
        self.scrapes: Counter[tuple[str, str]] = Counter()
        self.window = DecisionWindow()
        self.releases_by_log = 0
        self.forged_response_ids = 0  # stored-response ids in the minted form whose MAC did not verify: answered 404
        self.releases_by_response = 0  # endpoint picker: released at the response's end, or its stream's
        self.picker_streams_reset = 0  # endpoint picker: a stream that ended before its response did
        # the header path (brain.header_path): requests that asked at their headers and read their body, by why
        self.header_path_declined: Counter[str] = Counter({k: 0 for k in HEADER_PATH_WHY})
        self.flow_refused: Counter[str] = Counter({"queue_full": 0, "waited_too_long": 0,
                                                            "deadline_unmeetable": 0, "router_behind": 0})  # 429s
        # flow control: held requests let go, and the seconds they waited, per class (a name of core.flow.CLASSES)
        self.flow_released: Counter[str] = Counter({k: 0 for k in CLASSES})
        self.flow_wait_s: Counter[str] = Counter({k: 0.0 for k in CLASSES})
        # held requests whose call ended before the brain answered: the client went away, or Envoy's message timer
        # ran out and it failed the request open (a held request the brain lost shows here)
        self.flow_abandoned: Counter[str] = Counter({k: 0 for k in CLASSES})
        # prefill/decode disaggregation: requests whose prefill went to another replica, by how it ended (remote:
        # the decode replica loaded its KV; local_fallback: the leg failed, the decode replica computed it;
        # abandoned: the client left between the legs)
        self.disaggregated: Counter[str] = Counter({k: 0 for k in ("remote", "local_fallback", "abandoned")})
        self.discovery_failures = 0  # discovery lookups that failed (the last good replica set stayed)
        self.discovery_changes = 0  # replica sets discovery applied
        self.discovery_up = 1  # 0 while the discovery source's last lookup failed
        self.released_envoy_gone = 0  # reservations of an Envoy whose access-log streams all closed
        self.unmatched_log_entries = 0  # access-log entries that named no reservation and no replica
        # access-log entries by the way they came (grpc, door: release.AccessLogService, log_door), and messages of each
        self.log_entries: Counter[str] = Counter({"grpc": 0, "door": 0})
        self.log_messages: Counter[str] = Counter({"grpc": 0, "door": 0})
        self.log_streams_refused = 0  # log door connections closed for what was not Fluentd Forward
        self.reloads = 0
        # the cached tokens routing predicted for the requests it placed, per replica (engine tokens): set beside
        # the engine's own prefix-cache hits, how far the brain's belief of the caches holds
        self.predicted_cached: Counter[str] = Counter()
        # exact mode, per replica: the engine's cached tokens of the prompts routed there (achieved), and
        # the most any exact replica held of each (reachable)
        self.exact_achieved: Counter[str] = Counter()
        self.exact_reachable: Counter[str] = Counter()
        # exact mode with an offloaded tier: (replica, medium) -> prompt tokens routing priced as restored from it
        self.exact_restored: Counter[tuple[str, str]] = Counter()
        self.shared = SharedStats()
        self.zero_series(replica_names)

    def count_log_entries(self, transport: str, n: int) -> None:
        """A message of ``n`` access-log entries by ``transport``."""
        self.log_entries[transport] += n
        self.log_messages[transport] += 1

    def record_decision(self, d: Decision, body_status: BodyStatus, now: float) -> None:
        name = d.replica_name or "-"
        self.decisions[(name, d.reason)] += 1
        self.decisions_by_pin[d.pin_kind or "none"] += 1
        self.bodies[body_status] += 1
        self.window.add(name, now)
        if d.replica_name is not None:
            self.predicted_cached[d.replica_name] += d.cached_tokens
        for e in d.events:
            self.pin_events[(e.action, e.kind, e.cause)] += 1

    def zero_series(self, replica_names: Iterable[str]) -> None:
        """Export every series from the start: rate() and alerts see 0, not an absent series."""
        for name in replica_names:
            self.predicted_cached[name] += 0
            for reason in Reason:
                if reason not in (Reason.NO_HEALTHY, Reason.UNKNOWN_MODEL, Reason.UNSERVED_PATH, Reason.INFLATE_LIMIT,
                                  Reason.UNSUPPORTED_ENCODING, Reason.CLIENT_KV_TRANSFER, Reason.RESPONSE_GONE,
                                  Reason.HELD, Reason.QUEUE_FULL, Reason.READ_BODY,
                                  Reason.DEADLINE, Reason.TENANT_CAP):
                    self.decisions[(name, reason)] += 0
            for result in SCRAPE_RESULTS:
                self.scrapes[(name, result)] += 0
        for kind in PinKind:
            self.decisions_by_pin[kind] += 0
        self.decisions_by_pin["none"] += 0
        for key in PIN_EVENTS:
            self.pin_events[key] += 0
        for status in BodyStatus:
            self.bodies[status] += 0

    def decisions_per_replica(self) -> Counter[str]:
        per: Counter[str] = Counter()
        for (name, _reason), n in self.decisions.items():
            per[name] += n
        return per
