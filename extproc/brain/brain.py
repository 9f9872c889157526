"""The brain: owns the router, the wall clock and the counters; every network handler is a thin shell on it.

Each concern lives in a file of its own: ``decide`` (the ext_proc answer; ``intake``: how far behind it reads),
``release`` (the
access log), ``scraper``, ``reload``, ``admin`` (``view``: /state), ``metrics``; ``server`` starts them all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import ssl
import time
from dataclasses import dataclass, field
from typing import Collection

from ..config import AppConfig, ConfigError, first_answer_s, load_config
from ..contract import CONTENT_ENCODING_HEADER, INFLATED_FROM_HEADER, REQUEST_ID_HEADER
from ..core import ChainCache, Decision, PinAction, Router, State, Transition, build_profile
from ..core.models import ModelCatalog, Resolution
from ..core.profile import RequestProfile
from ..core.apis import (PROCESS_KEY, Holder, ResponseHomes, holder_of, mint_response_id, with_request_id,
                        without_kv_transfer)
from ..core.names import BodyStatus, PinKind, Reason
from ..core.caps import caps_of
from ..core.flow import CLASSES, CRITICAL, STANDARD, FlowControl, FlowQueue
from ..core.profile import BODY_ARRIVING_KEY, BODY_KV_TRANSFER_KEY, credential_scope, replace_model, tenant_of, \
    ttft_slo_of
from ..envoy_config import CdsFile
from . import header_path, logs
from .. import answers
from ..answers import Answered, Held, Placed
from ..picker.messages import path_of
from .legs import Legs, legs_of, new_session
from .metrics import make_registry
from .release import EnvoyPresence, Ledger, Releaser
from .reload import apply_config
from .exact import Exact
from .scraper import ScrapeListener, Scraper, tls_context
from .decision_log import DecisionLog
from .picks import PICK, Pick, Picks, endpoint
from .stats import BrainStats
from .view import state_of

_LOGGED_ACTIONS = (PinAction.REBIND, PinAction.UNPIN)
# the share of the look's bound (``Brain.look_bound_s``) that new sessions' bodies waiting to be read make a burst:
# flow control's flood mode starts there, before the look refuses any
BURST_SHARE = 0.25


@dataclass(slots=True)
class HeldRequest:
    """A request flow control holds, in one record: its key (the core's queue prices it under that), what its decision
    needs once it goes (its profile, its model's resolution, since when it waits), what its answer is written from
    (the front's headers, body, phase and subset) and where the front waits for that answer."""

    key: object
    profile: RequestProfile
    res: Resolution
    since: float
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes | None = None
    phase: str = ""
    only: "set[str] | None" = None
    answer: "asyncio.Future | None" = None  # the front's call waits on it (None: no front waits yet)

    @property
    def waiting(self) -> bool:
        """Someone still takes its answer (a placement nobody takes is released at once)."""
        return self.answer is None or not self.answer.done()

    def answered_as(self, headers: dict[str, str], body: bytes | None, phase: str,
                    only: "set[str] | None" = None) -> None:
        self.headers, self.body, self.phase, self.only = headers, body, phase, only


class Brain(ScrapeListener):
    def __init__(self, cfg: AppConfig, clock=time.monotonic, config_path: str | None = None):
        self.cfg = cfg
        self.clock = clock
        self.config_path = config_path
        self.router = Router(cfg.router, [r.name for r in cfg.replicas], self.clock())
        self.router.listeners.append(self._on_transition)
        self.stats = BrainStats(r.name for r in cfg.replicas)
        self.ledger = Ledger(self.router)
        self.releaser = Releaser(self.router, self.ledger, self.stats, self.clock)
        self.envoy = EnvoyPresence(self.router, self.ledger, self.stats, self.clock)
        self.scraper = Scraper(self.router, self.stats, self.clock, cfg.router.health.scrape_interval_s)
        self.scraper.configure(cfg.router.health, cfg.router.warm.load_refresh_s if self.router.needs_blocks else None)
        self.cds = CdsFile(cfg.envoy.cds_path)
        self.chains = ChainCache()  # C2: a session's next turn hashes only what is new
        self.response_homes = ResponseHomes()  # stored responses whose ids clients chose (minted ones say it)
        # what minted response ids are signed with: this process's key until the server sets the fleet's (or its
        # key file's) at start, so that a restarted brain, or another brain, still reads the ids it made
        self.response_key = PROCESS_KEY
        # a static fleet is known at start; a discovered one once its source first answered (readiness)
        self.discovered = cfg.discovery.source == "static"
        self.discovery_error: str | None = None
        self.pin_log = logs.Summarised("pin_change")
        self.models = ModelCatalog(dict(cfg.aliases))
        # the last decisions by Envoy's request id (which the client gets back as x-request-id): what the brain
        # predicted for a request, to hold against what the engine reported (GET /decisions). Hashes and names only
        self.decisions = DecisionLog()
        self.picks = Picks(self)  # the endpoint picker's front asks these
        self._legs_http = None  # prefill legs' HTTP session, made at the first (legs.py)
        self.router.disaggregates = cfg.brain.protocol != "endpoint-picker"  # a picker's gateway carries one leg
        # flow control: what each held request needs to be answered (key -> headers, body, phase; body status)
        self.held: dict[object, HeldRequest] = {}  # flow control's held requests, by key: one record each
        self._hold_keys = itertools.count(1)
        # the quickest first token predicted for a turn of a session under way lately (and when), and the last turn
        self._turn_ttft_s, self._turn_least_at, self._turn_at = 0.0, -math.inf, -math.inf
        if cfg.flow_control.enabled:
            f = cfg.flow_control
            self.router.flow = FlowControl(FlowQueue(f.max_requests, f.max_bytes),
                                           (None, f.wait_s, min(f.wait_s, f.sheddable_wait_s)), f.hold_on_wait)
        self.router.caps = caps_of(cfg.flow_control)
        self.scraper.listeners.append(self)  # the catalog learns each replica's models and paths (ScrapeListener)
        self.exact = Exact(cfg, self.router, self.scraper, self.clock, self.stats, self.models)  # the engines' own word
        self._set_replicas(cfg)
        m = make_registry(self.router, self.stats, self.clock, self.releaser.outcomes)
        self.registry, self.decision_seconds, self.scraper.seconds = m.registry, m.decision, m.scrape
        self.predicted_ttft, self.releaser.ttft_error = m.predicted_ttft, m.ttft_error

    def _set_replicas(self, cfg: AppConfig) -> None:
        self.scraper.urls = {r.name: r.url for r in cfg.replicas}
        self.scraper.engines = {r.name: r.engine for r in cfg.replicas}
        try:
            self.scraper.tls = {r.name: (tls_context(r.tls_ca_file, r.tls_cert_file, r.tls_key_file), r.sni)
                                for r in cfg.replicas if r.tls}
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"replicas: cannot load a TLS file ({e})") from None
        self.releaser.by_address = {endpoint(r): r.name for r in cfg.replicas}
        self.endpoint_of = {r.name: endpoint(r) for r in cfg.replicas}
        self.models.aliases = dict(cfg.aliases)
        self.models.configure({r.name: r.models for r in cfg.replicas}, {r.name: r.paths for r in cfg.replicas})
        self.scraper.models_wanted = {r.name for r in cfg.replicas if not r.models}
        self.scraper.paths_wanted = {r.name for r in cfg.replicas if not r.paths}
        # a replica no longer configured with paths, or new: its /openapi.json at its next good scrape
        wanted = self.scraper.paths_wanted
        missing = {n for n in wanted if self.models.paths_of(n) is None}
        self.scraper.paths_due = (self.scraper.paths_due | missing) & wanted
        self.exact.configure(cfg)
        self.router.set_roles({r.name: r.role for r in cfg.replicas})

    def on_models(self, name: str, models: "list[dict] | None") -> bool:
        if self.models.learned(name, models):
            served = self.models.served_by(name) or []
            # a replica may list a thousand adapters: the log line names the first few and counts the rest
            logs.event("models_changed", replica=name, models=served[:10], count=len(served))
            return True
        return False

    def on_paths(self, name: str, paths: "list[str] | None") -> None:
        if self.models.learned_paths(name, paths):
            listed = self.models.paths_of(name)
            logs.event("paths_changed", replica=name, count=None if listed is None else len(listed),
                       api=None if listed is None else [p for p in listed if p.startswith("/v1/")][:10])

    def liveness_bound_s(self) -> float | None:
        """How long a reservation may go unnamed by Envoy before it counts as a lost or rogue call.

        Envoy logs each request in flight every ``envoy.access_log_periodic_s``, however long it runs. A
        reservation is made once ext_proc has the body (at most ``ext_proc_timeout_s`` after Envoy asked), and
        its first periodic entry comes within one period of the request's start; retries on other replicas
        add their connect timeouts. Twice the period is the margin for a late flush."""
        e = self.cfg.envoy
        if not e.access_log_periodic_s:
            return None
        return 2 * e.access_log_periodic_s + first_answer_s(self.cfg) + (e.retries
                                                                         + 1) * e.upstream_connect_timeout_s + 1.0

    def _on_transition(self, t: Transition) -> None:
        extra = {}
        rep = self.router.find(t.replica)
        if t.new is State.EJECTED and rep is not None:  # what the operator asks of an ejection: dead, or busy?
            h = rep.health
            extra = {"since_scrape_s": round(t.at - h.last_scrape_ok_at, 1), "since_served_s": round(
                t.at - h.served_at, 1), "in_flight": rep.in_flight_requests}
        logs.event("state_change", replica=t.replica, old=t.old.value, new=t.new.value, reason=t.reason,
                   cooldown_s=t.cooldown_s, streak=t.streak, **extra)

    def choose(self, headers: dict[str, str], body: bytes | None, only: Collection[str] | None = None,
               hold_key: object = None) -> Decision:
        """Profile + select + reserve: one synchronous call (the atomic WLC reserve). Every front decides here.
        ``hold_key``: flow control may hold the request under it (Reason.HELD; see ``let_go``)."""
        t0 = time.perf_counter()
        now = self.clock()
        r = self.router
        if headers.get(CONTENT_ENCODING_HEADER, "identity").strip().lower() not in ("", "identity"):
            # still encoded after Envoy (it inflates a lone gzip): the replica would read bytes it cannot parse, and
            # the brain price them as a prompt of their compressed size
            d = Decision(None, Reason.UNSUPPORTED_ENCODING)
            self.stats.record_decision(d, BodyStatus.ENCODED, now)
            return d
        if body is None and headers.get(BODY_KV_TRANSFER_KEY):
            d = Decision(None, Reason.CLIENT_KV_TRANSFER)
            self.stats.record_decision(d, BodyStatus.HEADERS_ONLY, now)
            return d
        wait = r.over_cap(tenant_of(headers, r.profile_cfg), self.priority(headers), now) if r.caps else None
        if wait is not None:  # its tenant took its tokens for now: not even parsed
            d = Decision(None, Reason.TENANT_CAP, retry_after_s=wait)
            self.stats.record_decision(d, BodyStatus.ABSENT if body is None else BodyStatus.UNPARSED, now)
            return d
        profile = build_profile(headers, body, r.profile_cfg, self.chains if r.needs_blocks else None)
        if body is None and headers.get(BODY_ARRIVING_KEY):
            profile = dataclasses.replace(profile, deferred=True)
        if profile.body_status is BodyStatus.NOT_JSON and headers.get(INFLATED_FROM_HEADER) \
                and not headers.get(CONTENT_ENCODING_HEADER):
            # Envoy inflated it and it does not read: it was cut off at envoy.max_inflate_ratio (Envoy passes the rest
            # on silently), or was never JSON. Either way no replica could read it: a 413 that says why
            d = Decision(None, Reason.INFLATE_LIMIT)
            self.stats.record_decision(d, profile.body_status, now)
            return d
        holder = None
        if profile.stored_ref is not None or profile.stores_response:
            # a client-named response's home is its tenant's alone, or (no tenant) its credential's
            scope = profile.tenant or tenant_of(headers, r.profile_cfg) or credential_scope(headers)
            if scope is not None:
                profile = dataclasses.replace(profile, response_scope=scope)
        if profile.stored_ref is not None:  # it follows, reads or cancels a stored response: only its holder has it
            held = holder_of(profile.stored_ref, (x.name for x in r.replicas), self.response_homes, now,
                             self.response_key, profile.response_scope)
            if held is Holder.FORGED:
                self.stats.forged_response_ids += 1
            if held is Holder.GONE or held is Holder.FORGED:
                d = Decision(None, Reason.RESPONSE_GONE, response_id=profile.stored_ref)
                self.stats.record_decision(d, profile.body_status, now)
                return d
            holder = held if isinstance(held, str) else None
        elif profile.stores_response and profile.response_id is not None:
            # a create under an id its scope already holds (a retry, say) goes where that response lives: two stored
            # responses of one id on two replicas would leave its follow-ups reading either
            home = self.response_homes.get(profile.response_id, now, profile.response_scope)
            holder = home if home is not None and r.find(home) is not None else None
        if profile.candidates is not None:
            res = self.models.resolve_candidates(profile.candidates, profile.session_key, path_of(headers) or None)
        else:
            res = self.models.resolve(profile.model, profile.session_key, path_of(headers) or None)
        bound = self.models.max_model_len(res.model)
        if bound is not None and profile.tokens > bound:  # no replica of it reads more: never price it as more
            profile = dataclasses.replace(profile, tokens=bound)
            # past the model's context the engine answers 400 at once: flow control neither holds it nor refuses
            # it as a deadline it could never meet (a 429 would tell the client to retry what cannot succeed)
            hold_key = None
        if res.replicas is not None and not res.replicas:
            d = Decision(None, Reason.UNSERVED_PATH if res.unserved_path else Reason.UNKNOWN_MODEL,
                         model=profile.model)
            self.stats.record_decision(d, profile.body_status, now)
            return d
        if res.replicas is not None:
            only = res.replicas if only is None else res.replicas.intersection(only)
        if self.models.is_adapter(res.model):
            profile = dataclasses.replace(profile, adapter=res.model)
        # a body's first bytes (the endpoint picker decided before the rest came): no conversation to tokenize
        profile = self.exact.price(profile, body if profile.body_status is not BodyStatus.PARTIAL else None,
                                   res.model or profile.model)
        if profile.doc is not None:  # read by now; a held request keeps its body, not its parse too (several times it)
            profile = dataclasses.replace(profile, doc=None)
        if hold_key is not None:
            flow = (tenant_of(headers, r.profile_cfg), self.priority(headers), ttft_slo_of(headers))
            if flow != (profile.tenant, profile.priority, profile.ttft_slo_s):  # a copy costs ~20 µs: only if needed
                profile = dataclasses.replace(profile, tenant=flow[0], priority=flow[1], ttft_slo_s=flow[2])
        d = r.select(profile, now, only, holder, hold_key, len(body) if body else 0)
        if d.reason is Reason.HELD:
            self.held[hold_key] = HeldRequest(hold_key, profile, res, now)  # what its decision needs once it goes
            self.stats.record_decision(d, profile.body_status, now)
            return d
        return self._decided(d, profile, res, now, t0)

    def _decided(self, d: Decision, profile, res, now: float, t0: float | None = None) -> Decision:
        """The brain's books on a placed decision, at once or after flow control held it: the served model, the
        stored response's home, the metrics, the pin log."""
        d.model, d.rewrite_model, d.kv_transfer = res.model, res.rewritten, profile.kv_transfer
        if profile.stores_response and d.replica is not None:  # "store": false: nothing to find later, no rewrite
            if profile.response_id is not None:  # the client named it: remember where it will live (first writer)
                self.response_homes.record(profile.response_id, d.replica.name, now, profile.response_scope)
            else:  # the brain names it, and the name says where it lives
                d.response_id = mint_response_id(d.replica.name, profile.response_root, self.response_key)
        if t0 is not None:  # a held request's wait is not the decision's cost
            self.decision_seconds.observe(time.perf_counter() - t0)
        self.stats.record_decision(d, profile.body_status, now)
        self.exact.observe(profile, d)
        if d.predicted_ttft_s is not None:
            self.predicted_ttft.observe(d.predicted_ttft_s)
            if profile.session_key is not None and not any(e.action is PinAction.PIN and e.kind is PinKind.SESSION
                                                           for e in d.events):  # a turn of a session under way
                # the quickest lately: a burst's own queues make later turns' predictions long, which must not
                # loosen the bound the look holds the burst to
                if now - self._turn_least_at > self.cfg.router.warm.active_session_s \
                        or d.predicted_ttft_s <= self._turn_ttft_s:
                    self._turn_ttft_s, self._turn_least_at = d.predicted_ttft_s, now
                self._turn_at = now
        for e in d.events:
            if e.action in _LOGGED_ACTIONS:
                self.pin_log.add(now, (e.action, e.kind, e.cause, d.replica_name), action=e.action, kind=e.kind,
                                 cause=e.cause, replica=d.replica_name)
        return d

    def decide(self, headers: dict[str, str], body: bytes | None,
               phase: str = "request_body") -> "Placed | Answered | Held | Legs":
        """The rendered Envoy's front: the choice as a replica (Envoy's cluster) and a reservation id Envoy logs back;
        with flow control, ``Held``: the answer comes from ``let_go`` once a replica has room."""
        if body is None and headers.get(":method") == "GET" and path_of(headers) == "/v1/models":
            return answers.models(self.models.union())  # Envoy's models route: the fleet's, not one replica's
        key = next(self._hold_keys) if self.router.flow is not None else None
        d = self.choose(headers, body, hold_key=key)
        if d.reason is Reason.HELD:
            self.held[key].answered_as(headers, body, phase)
            return Held(key)
        if d.reason in (Reason.QUEUE_FULL, Reason.DEADLINE, Reason.TENANT_CAP):
            return self.too_many(d, headers)
        return self._answer(d, headers, body, phase)

    def at_headers(self, headers: dict[str, str], asked: header_path.Asked | None = None) -> Placed | Answered | None:
        """The header path (``header_path``): a turn of a session under way answered at its request headers, its
        body streamed to its home without passing through the brain. None: its body decides (Envoy sends it).
        ``asked``: what the call read of its headers, kept for the look after it."""
        d = self.decide_at_headers(headers, None, asked=asked)
        if d is None:  # its body decides, unless it would only be read to be refused
            return header_path.refused_behind_queue(self, headers, self.clock(), asked)
        out = self._answer(d, headers, None, "request_headers")
        assert not isinstance(out, Legs)  # a prefill leg needs the body: the header path never plans one
        return out

    def decide_at_headers(self, headers: dict[str, str], only: "set[str] | None", arriving: bool = False,
                          asked: header_path.Asked | None = None) -> Decision | None:
        t0 = time.perf_counter()
        now = self.clock()
        flow = self.router.flow is not None
        more = {"priority": self.priority(headers), "ttft_slo_s": ttft_slo_of(headers)} if flow else {}
        why, profile, res = header_path.turn(self, headers, now, {**more, "deferred": True} if arriving else more,
                                             asked)
        if asked is not None:
            asked.why = why
        if profile is not None:
            # never held: a turn flow control would hold reads its body
            key = next(self._hold_keys) if flow else None
            assert res is not None  # a profile comes with its model's resolution
            allowed = res.replicas if only is None else only if res.replicas is None else res.replicas & only
            d = self.router.select(profile, now, allowed, hold_key=key)
            if d.reason is not Reason.READ_BODY:
                d.header_path = True
                return self._decided(d, profile, res, now, t0)
            why = "home_declined"
        self.stats.header_path_declined[why or "unknown"] += 1
        return None

    def look(self, headers: dict[str, str], read_wait_s: float, backlog_s: float | None = None,
             new_session: bool = False) -> Answered | None:
        """The look at a large body's headers before its body is read (flow control on; ``envoy_config`` renders it): a
        request that is no turn of a session the brain knows, arriving while its body would wait to be read longer
        than a turn of the sessions under way takes (``look_bound_s``), is refused with 429 before it is sent, instead
        of delaying their turns behind it or timing
        out and failing open into the engines ahead of them. Critical work is never refused. None: let it come.
        Other bodies already waiting a quarter of that bound to be read (``backlog_s``: measured, never this
        request's own size, let alone one only declared; default ``read_wait_s``) are a burst: flow control's flood
        mode starts (``FlowControl.flooded``), whether this one is let through or not. ``new_session``: the header call
        already found its session new (no pin), here at the same moment."""
        if self.router.flow is None:
            return None
        now = self.clock()
        r = self.router
        priority = self.priority(headers)
        wait = r.over_cap(tenant_of(headers, r.profile_cfg), priority, now) if r.caps else None
        if wait is not None:  # a capped tenant's large body: refused before it is uploaded
            return self.too_many(Decision(None, Reason.TENANT_CAP, retry_after_s=wait), headers)
        bound = self.look_bound_s(now)
        burst = (read_wait_s if backlog_s is None else backlog_s) > bound * BURST_SHARE
        if (not burst and read_wait_s <= bound) or priority == CRITICAL:
            return None
        if not new_session:
            profile = build_profile(headers, None, self.router.profile_cfg, None)
            if profile.session_key is not None and r.session_pins.get(profile.session_key, now) is not None:
                return None
        if burst:  # started at the first refusal only, 6-8 new sessions were placed before it by cost, the sessions
            # under way's replicas included: each a 25K prefill ahead of their turns (issue 59)
            self.router.flow.flooded(now)
        if read_wait_s <= bound:
            return None
        self.stats.flow_refused["router_behind"] += 1
        return answers.too_many("router_behind", max(self.cfg.flow_control.retry_after_s, math.ceil(read_wait_s)),
                                path_of(headers))

    def look_bound_s(self, now: float) -> float:
        """How far behind the brain may read before the look refuses new sessions (see ``look``): the quickest turn
        of a session under way lately, at least half of envoy.ext_proc_timeout_s (what a brain that late costs a
        request is what its operator already accepts; below it is a busy brain's jitter, not a burst), half
        Envoy's first timer with no session under way."""
        bound = first_answer_s(self.cfg) / 2
        if now - self._turn_at <= self.cfg.router.warm.active_session_s:
            bound = min(bound, max(self._turn_ttft_s, self.cfg.envoy.ext_proc_timeout_s / 2))
        return bound

    def _answer(self, d: Decision, headers: dict[str, str], body: bytes | None,
                phase: str) -> "Placed | Answered | Legs":
        if d.reason is Reason.TENANT_CAP:  # at its headers: its body is never read
            return self.too_many(d, headers)
        answer = self.immediate(d, headers)
        if answer is not None:
            return answer
        assert d.replica is not None and d.reservation is not None  # placed: an answer naming a replica
        d.reservation.at_headers = d.header_path
        rid = self.ledger.issue(d.reservation, headers.get(REQUEST_ID_HEADER))
        self.decisions.remember(headers.get(REQUEST_ID_HEADER), d, self.clock())
        sent = self.body_for(d, body)
        engine = d.engine if d.steer else None
        replica = d.replica.name
        if d.prefill is not None:
            legs = legs_of(self, d, headers, sent if sent is not None else body, phase,
                            lambda b: Placed(replica, rid, engine, b if b is not None else sent))
            if legs is not None:
                return legs
        return Placed(replica, rid, engine, sent)

    def legs_http(self):
        """The prefill legs' connections (one pool for the brain's life)."""
        if self._legs_http is None or self._legs_http.closed:
            self._legs_http = new_session()
        return self._legs_http

    async def close_legs(self) -> None:
        """The prefill legs' HTTP session, closed (shutdown)."""
        if self._legs_http is not None:
            await self._legs_http.close()

    def priority(self, headers: dict[str, str]) -> int:
        """The request's class from flow_control.priority_header (a name of CLASSES; anything else: standard)."""
        v = headers.get(self.cfg.flow_control.priority_header.lower(), "").strip().lower()
        return CLASSES.index(v) if v in CLASSES else STANDARD

    def too_many(self, d: "Decision | str", headers: dict[str, str] | None = None) -> Answered:
        """Flow control's 429 (a reason, or a refused decision: a capped tenant's says when it may send again)."""
        why = d if isinstance(d, str) else d.reason.value
        self.stats.flow_refused[why] += 1
        retry = self.cfg.flow_control.retry_after_s
        if not isinstance(d, str) and d.retry_after_s is not None:
            retry = max(1, math.ceil(d.retry_after_s))
        return answers.too_many(why, retry, path_of(headers) if headers is not None else "")

    def hold_key(self) -> object:
        """A key to hold a request under while flow control is on (None: it is off)."""
        return next(self._hold_keys) if self.router.flow is not None else None

    def let_go(self) -> "list[tuple[HeldRequest, Placed | Answered | Legs | Pick]]":
        """Flow control: the held requests that go now (each placed by the policy at this moment) and those refused
        (held past flow_control.wait_s, or pushed out by a higher class), with their answers."""
        flow = self.router.flow
        if flow is None or not self.held:
            return []
        now = self.clock()
        out = []
        for key, d in self.router.offer(now):
            h = self.held.pop(key)
            self.stats.flow_released[CLASSES[h.profile.priority]] += 1
            self.stats.flow_wait_s[CLASSES[h.profile.priority]] += now - h.since
            if not h.waiting:
                self.router.release(d.reservation, now)
                self.router.release(d.prefill_reservation, now)  # a prefill leg planned for it: never sent
                continue
            d = self._decided(d, h.profile, h.res, now)
            out.append((h, self.picks.pick_of(d, h.headers, h.body, h.only) if h.phase == PICK
                        else self._answer(d, h.headers, h.body, h.phase)))
        for key in flow.refused:
            refused = self.held.pop(key, None)
            if refused is not None:
                answer = self.too_many("waited_too_long", refused.headers)
                out.append((refused, Pick([], None, immediate=answer) if refused.phase == PICK else answer))
        flow.refused.clear()
        return out

    def cancel(self, key: object) -> None:
        """A held request's call ended before its answer (Envoy closed the stream: its client went away, or its
        message timer ran out)."""
        self.router.cancel(key, self.clock())
        held = self.held.pop(key, None)
        if held is not None:
            self.stats.flow_abandoned[CLASSES[held.profile.priority]] += 1

    def immediate(self, d: Decision, headers: dict[str, str]) -> Answered | None:
        """The brain's own answer when no replica is to be asked (None: one is), in the shape the path's API
        answers errors in."""
        return answers.immediate(d.reason, path_of(headers), model=d.model or "", served=self.models.base_models,
                                inflate_ratio=self.cfg.envoy.max_inflate_ratio, response_id=d.response_id or "")

    def prefill_fleet(self) -> bool:
        """A fleet with prefill replicas: its engines run a KV connector that reads kv_transfer_params."""
        return self.router.disaggregates and any(r.role == "prefill" for r in self.router.replicas)

    def body_for(self, d: Decision, body: bytes | None) -> bytes | None:
        """The body to send instead of the client's (None: the client's): without a client's kv_transfer_params, the
        served model for an alias, the response's minted id."""
        if body is None:
            return None
        # only the brain's prefill leg sets them (legs.py)
        known = d.kv_transfer
        out = without_kv_transfer(body, known, known is None and self.prefill_fleet())
        if d.rewrite_model and d.model is not None:
            out = replace_model(out if out is not None else body, d.model) or out
        if d.response_id is not None:
            out = with_request_id(out if out is not None else body, d.response_id)
        return out

    def caches_reset(self, name: str) -> None:
        """Replica ``name``'s engines emptied their prefix caches at the operator's word (admin API)."""
        self.router.policy.caches_reset(name, self.clock())

    def recent_decisions(self, request_id: str | None = None, last: int | None = None) -> list[dict]:
        """GET /decisions: the remembered decisions (of one request id, or the last ``last``), newest last."""
        return self.decisions.rows(request_id, last, self.releaser.outcomes.observed_of)

    def on_log_entry(self, entry) -> None:
        self.releaser.on_entry(entry)
        if self.releaser.periodic_seen and self.router.liveness_timeout_s is None:
            # only once Envoy shows it sends periodic entries: an Envoy configured without them (pasted
            # snippets, a foreign gateway) must not see its long requests' reservations expire
            self.router.liveness_timeout_s = self.liveness_bound_s()

    def read_config(self) -> AppConfig:
        """The config file, parsed (ConfigError: the old config stays). Blocking: the shell runs it in a thread,
        so that no file, however crafted, holds the event loop and its decisions."""
        if not self.config_path:
            raise ConfigError("the brain was started without a config file")
        return load_config(self.config_path)

    async def reload_async(self) -> dict:
        """``reload`` with the file read and parsed off the event loop; only the apply runs on it."""
        import asyncio

        return self.reload(await asyncio.to_thread(self.read_config))

    def reload(self, new: AppConfig | None = None) -> dict:
        """Apply ``new`` (default: the config file, read now) with ``reload.apply_config``; with
        ``envoy.cds_path`` Envoy's clusters follow. Replicas a discovery source found stay: the file's
        ``replicas`` list is its static source only."""
        new = new if new is not None else self.read_config()
        if new.discovery.source != "static":
            new = dataclasses.replace(new, replicas=self.cfg.replicas, allow_no_replicas=True)
        info = self._apply(new)
        self.stats.reloads += 1
        logs.event("config_reload", **info)
        return info

    def apply_discovered(self, replicas: list) -> None:
        """A discovery source's new replica set: added ones start EJECTED, removed ones get nothing new (their
        requests in flight finish and release as usual)."""
        info = self._apply(dataclasses.replace(self.cfg, replicas=tuple(replicas), allow_no_replicas=True))
        self.stats.discovery_changes += 1
        self.discovery_error = None
        self.stats.discovery_up = 1
        self.discovered = True
        logs.event("discovery_change", source=self.cfg.discovery.source, added=info["added"],
                   removed=info["removed"], replicas=info["replicas"])

    def discovery_ok(self) -> None:
        if self.discovery_error is not None:
            logs.event("discovery_recovered", source=self.cfg.discovery.source, replicas=len(self.cfg.replicas))
        self.discovery_error = None
        self.stats.discovery_up = 1

    def discovery_failed(self, error: str) -> None:
        """The source failed: the last good set stays. Logged once per distinct error, counted every time."""
        self.stats.discovery_failures += 1
        self.stats.discovery_up = 0
        if error != self.discovery_error:
            logs.event("discovery_failed", source=self.cfg.discovery.source, error=error,
                       replicas_kept=len(self.cfg.replicas))
        self.discovery_error = error

    def _apply(self, new: AppConfig) -> dict:
        self.cfg, info = apply_config(self.router, self.cfg, new, self.clock())
        self._set_replicas(self.cfg)
        self.cds = CdsFile(self.cfg.envoy.cds_path)
        self.cds.write(self.cfg)
        self.scraper.configure(self.cfg.router.health,
                               self.cfg.router.warm.load_refresh_s if self.router.needs_blocks else None)
        if self.router.liveness_timeout_s is not None:  # the bound follows envoy.access_log_periodic_s (0: off)
            self.router.liveness_timeout_s = self.liveness_bound_s()
        self.stats.zero_series(r.name for r in self.cfg.replicas)
        for name in info.get("removed", ()):  # pods renamed at every rollout: their errors must not pile up
            self.releaser.outcomes.forget(name)
        return info

    def tick(self) -> None:
        now = self.clock()
        self.router.tick(now)
        self.pin_log.flush(now)

    def state(self) -> dict:
        """GET /state (``view.state_of``)."""
        return state_of(self)


__all__ = ["Brain", "Pick", "endpoint"]
