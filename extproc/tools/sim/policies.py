"""Routing policies to compare in the simulator: warmroute's (the real core) and its peers, modelled honestly.

``Warmroute`` drives the real core (``extproc.core.Router``) with a policy from the core's registry,
the same one the config names: ``warmroute`` is the default policy, ``warmroute_<name>`` any other
(``warmroute_seed``, ``warmroute_warm_no_guard`` ...). Peers are modelled from their own source with
their shipped defaults (file named in each class); they know of replica health only what a refused
connection tells them, as with Envoy's built-ins without outlier detection: a request to a dead
replica is retried once elsewhere. ``oracle`` reads the simulated engines' true state: it is a
reference for how close a router that only sees metrics can get, not a peer.
"""

from __future__ import annotations

import math

from extproc.config.schema import EnvoyConfig
from extproc.core import Reason, RequestProfile, Router, RouterConfig, hash_key
from extproc.core.blocks import BLOCK_TOKENS as BLOCK
from extproc.core.apis import Api
from extproc.core.decision import Decision
from extproc.core.names import BodyStatus
from extproc.core.profile import size_decides
from extproc.core.flow import FlowControl
from extproc.core.policy import POLICIES as CORE_POLICIES
from extproc.tools.workload.generate import Request
from extproc.tools.sim.peers import (DynamoDisaggregated, DynamoKvRouter, LeastRequest, LlmdDisaggregated,
                                     LlmdEndpointPicker, LlmdFlowControl, LlmdPrecise, LlmdTokenAware, Oracle, RingHash,
                                     RoundRobin, SGLangCacheAware)
from extproc.tools.sim.policy_base import HOLD, REFUSED, Policy

ACCESS_LOG_PERIODIC_S = EnvoyConfig().access_log_periodic_s  # as the brain's Envoy is rendered by default

__all__ = ["HOLD", "REFUSED", "Policy", "Warmroute", "make_policy"]


class Warmroute(Policy):
    """The real routing core behind the simulator's clock, with a policy from the core's registry."""

    name = "warmroute"
    uses_health = True

    def __init__(self, n: int, seed: int, cfg: RouterConfig | None = None, name: str | None = None,
                 core_policy: str | None = None, flow: bool = False, hold_on_wait: bool = False,
                 exact: bool = False, header_path: bool = False):
        super().__init__(n, seed)
        import dataclasses

        cfg = dataclasses.replace(cfg or RouterConfig(), seed=seed)
        if core_policy is not None:
            cfg = dataclasses.replace(cfg, policy=core_policy)
        self.cfg = cfg
        self.router = Router(cfg, [f"r{i}" for i in range(n)], 0.0)
        self.name = name or "warmroute"
        self.load_refresh_s = cfg.warm.load_refresh_s if self.router.needs_blocks else None
        self._session_keys: dict[int, bytes] = {}
        self._prefix_keys: dict[int, bytes] = {}
        self.pins_on_non_live = 0  # a pin created or moved onto a replica that is not LIVE (must stay 0)
        self.predictions: list[tuple[float, Request]] = []  # (predicted TTFT, request) for the error report
        self._held: dict[int, Request] = {}  # flow control: held requests by id
        self.held_total = 0
        if flow:
            self.router.flow = FlowControl(hold_on_wait=hold_on_wait)
        # exact mode (issue 45): every engine publishes its KV events and the model's tokenizer is configured
        self.exact = exact
        # the header path (issue 61): a turn of a session under way is first priced at its headers (its size, what
        # its home holds of the session, no block chain), as the rendered Envoy asks; the body decides the rest
        self.header_path = header_path
        self.header_turns = 0

    def attach(self, sim) -> None:
        if self.exact:
            from extproc.tools.sim.truth import EngineTruth

            for i in range(self.n):
                self.router.policy.state_of(self.router.replica(f"r{i}")).exact = EngineTruth(sim, i)

    def _profile(self, req: Request) -> RequestProfile:
        sk = None
        if not req.oneshot:
            sk = self._session_keys.get(req.sid)
            if sk is None:
                sk = self._session_keys[req.sid] = hash_key("session", None, str(req.sid))
        pk = self._prefix_keys.get(req.project)
        if pk is None:
            pk = self._prefix_keys[req.project] = hash_key("prefix", None, f"project-{req.project}")
        tokens, blocks = req.estimated()  # counted from the text, as the brain does without the engine's tokens
        if not self.router.needs_blocks:
            blocks = ()
        if self.exact and req.adapter is None:
            return RequestProfile(sk, pk, tokens, "ok", None, blocks, req.pool, req.adapter, priority=req.klass,
                                  tenant=req.tenant, engine_tokens=req.prompt_tokens, api=Api.CHAT,
                                  engine_hashes=(BLOCK, tuple(req.blocks()[: req.prompt_tokens // BLOCK])))
        return RequestProfile(sk, pk, tokens, "ok", None, blocks, req.pool, req.adapter,
                              priority=req.klass, tenant=req.tenant, api=Api.CHAT)  # the agents' chat completions

    def _at_headers(self, req, now, only) -> Decision | None:
        """The header path's decision (None: its body decides)."""
        if req.oneshot or req.adapter is not None or getattr(self, "prefill_set", None):
            return None
        sk = self._session_keys.get(req.sid)
        pin = self.router.session_pins.get(sk, now) if sk is not None else None
        tokens = req.estimated()[0]
        if pin is None or not size_decides(pin.tokens, tokens):
            return None
        profile = RequestProfile(sk, None, tokens, BodyStatus.HEADER_PATH, None, (), req.pool, priority=req.klass,
                                 tenant=req.tenant, api=Api.CHAT, header_path=True)
        d = self.router.select(profile, now, only, hold_key=req.rid if self.router.flow is not None else None)
        if d.reason is Reason.READ_BODY:
            return None
        self.header_turns += 1
        req.extra["header_path"] = True
        return d

    def choose(self, req, now, exclude=frozenset()):
        # the model's replicas; its replicas of role prefill too (the router keeps them for prefill legs)
        exclude = exclude - getattr(self, "prefill_set", frozenset())
        only = [f"r{i}" for i in range(self.n) if i not in exclude] if exclude else None
        if self.header_path and (d := self._at_headers(req, now, only)) is not None:
            return REFUSED if d.reason is Reason.TENANT_CAP else self._accept(req, d, now)
        if self.router.flow is not None:
            d = self.router.select(self._profile(req), now, only, hold_key=req.rid)
            if d.reason is Reason.HELD:
                self._held[req.rid] = req
                self.held_total += 1
                req.extra["held_at"] = now
                return HOLD
            if d.reason in (Reason.QUEUE_FULL, Reason.DEADLINE, Reason.TENANT_CAP):
                return REFUSED
        else:
            d = self.router.select(self._profile(req), now, only)
            if d.reason is Reason.TENANT_CAP:
                return REFUSED
        return self._accept(req, d, now)

    def holds(self) -> bool:
        return bool(self._held)

    def take_ready(self, now):
        ready = [(self._held.pop(key), d) for key, d in self.router.offer(now)]
        out = [(req, self._accept(req, d, now)) for req, d in ready]
        out += [(self._held.pop(key), REFUSED) for key in self.router.flow.refused if key in self._held]
        self.router.flow.refused.clear()
        return out

    def roles(self, prefill):
        super().roles(prefill)
        self.router.set_roles({f"r{k}": "prefill" for k in prefill})
        self.router.disaggregates = True

    def prefill_for(self, req, i, now, prefills):
        pd = req.extra.pop("pd", None)
        if pd is None:
            return None
        if pd[0] not in prefills:  # it died since the decision: prefilled where it is decoded
            self.router.release(pd[1], now)
            return None
        req.extra["pd_reservation"] = pd[1]
        return pd[0]

    def prefill_done(self, req, now):
        self.router.release(req.extra.pop("pd_reservation", None), now)
        req.extra["leg_s"] = now - req.arrival

    def _accept(self, req, d, now):
        if d.replica is None:
            return None
        if d.prefill is not None:
            req.extra["pd"] = (int(d.prefill.replica.name[1:]), d.prefill_reservation)
        req.extra["reservation"] = d.reservation
        req.extra["reason"] = d.reason
        if d.predicted_ttft_s is not None:
            # a prediction counts from its decision, as the brain's join times it (Envoy's upstream request end):
            # time held by flow control before it is no part of what was predicted
            req.extra["predicted_ttft"] = (d.predicted_ttft_s, now - req.arrival)
            if d.reservation is not None:  # its parts: (prefill, the replica's first-token overhead)
                req.extra["predicted_parts"] = (d.reservation.prefill_s, d.reservation.overhead_s)
            req.extra["predicted_cached"] = d.cached_tokens
            if d.restored_tokens:
                req.extra["predicted_restored"] = d.restored_tokens
        if any(e.action in ("pin", "rebind") for e in d.events) and d.replica.state.value != "LIVE":
            self.pins_on_non_live += 1
        for e in d.events:
            key = f"{e.action}:{e.kind}" + (f":{e.cause}" if e.cause and e.cause != "new" else "")
            req.extra.setdefault("events", []).append(key)
        return int(d.replica.name[1:])

    def retry_target(self, req, now, exclude):
        # Envoy retries without asking the brain: the replica cluster's priority 1 (the other
        # replicas) with LEAST_REQUEST, i.e. two random choices on active requests.
        return self.two_choices(exclude)

    def first_token_known_at(self, req, now):
        # as the brain learns it: Envoy's next periodic entry of the request (every envoy.access_log_periodic_s from
        # its start) carries its first token's timing
        res = req.extra.get("reservation")
        if res is None:
            return None
        ticks = math.floor((now - res.started_at) / ACCESS_LOG_PERIODIC_S) + 1
        return res.started_at + ticks * ACCESS_LOG_PERIODIC_S

    def first_token_known(self, req, now):
        res = req.extra.get("reservation")
        if res is not None:  # still running: its entry is a periodic one
            self.router.touch(res, now, first_token=True)

    def done(self, req, now):
        super().done(req, now)
        res = req.extra.pop("reservation", None)
        if res is not None and req.ttft is not None:
            # as the brain joins Envoy's entry: from when the request was sent (its decision), not its arrival
            self.router.first_token_observed(res, req.arrival + req.ttft - res.started_at, now)
        if res is not None and res.transfer_tokens and req.ttft is not None and "leg_s" in req.extra:
            res.leg_s = req.extra["leg_s"]
            self.router.transfer_observed(res, req.ttft)
        self.router.release(res, now)

    def on_scrape(self, i, ok, now, sample=None):
        self.router.on_scrape(f"r{i}", ok, now, sample=sample)

    def on_load(self, i, sample, now):
        self.router.on_load(f"r{i}", sample, now)

    def on_upstream(self, i, ok, now):
        self.router.on_upstream(f"r{i}", ok, now)

    def tick(self, now):
        self.router.tick(now)

    def routable(self, i):
        return self.router.replica(f"r{i}").state.value != "EJECTED"

    def ejected(self, i):
        return self.router.replica(f"r{i}").state.value == "EJECTED"

    def health_transitions(self):
        return list(self.router.transitions)


DEFAULT = RouterConfig().policy
PEERS = {
    "envoy_round_robin": RoundRobin,
    "envoy_least_request": LeastRequest,
    "envoy_ring_hash": RingHash,
    "envoy_ring_hash_bounded_150": lambda n, seed: RingHash(n, seed, hash_balance_factor=150),
    "sglang_cache_aware": SGLangCacheAware,
    "llmd_epp_2025": LlmdEndpointPicker,
    # llm-d's default since mid-2026, "sticky until saturated" (issue 62)
    "llmd_token_aware": LlmdTokenAware,
    "dynamo_kv": DynamoKvRouter,
}
# names a peer had before: commands in dated docs keep running (issue 62 named llm-d's older default by its version)
ALIASES = {"llmd_epp": "llmd_epp_2025"}
REFERENCE = {"oracle": Oracle}
# peers as configured for a fleet that serves LoRA adapters (bench_fleet --simulated); not in COMPARE
LORA_PEERS = {"llmd_epp_lora": lambda n, seed: LlmdEndpointPicker(n, seed, lora_weight=4.0)}
# peers with flow control, as shipped but opt-in (issue 34's extra peer row); not in COMPARE
FLOW_PEERS = {"llmd_epp_flowcontrol": LlmdFlowControl}
# peers that read the engines' KV events (issue 45's rows); not in COMPARE
EXACT_PEERS = {"llmd_precise": LlmdPrecise}
# peers that disaggregate prefill and decode (issue 48's rows), and warmroute on the same replicas aggregated
PD_PEERS = {"llmd_pd": LlmdDisaggregated, "dynamo_pd": DynamoDisaggregated}
AGGREGATED = "warmroute_aggregated"
# `warmroute` is what ships: the default policy with flow control (on by default since issue 34); the same
# without flow control (flow_control.enabled: false) and with it holding by wait too (flow_control.hold_on_wait)
# have names of their own; `warmroute_<core policy>` is any other policy the core's registry holds, alone
NO_FLOW = "warmroute_no_flow"
FLOW_WAIT = "warmroute_flow_wait"
EXACT = "warmroute_exact"  # as it ships, on a fleet whose engines publish KV events and whose tokenizer it has
# the same, blind to an offloaded tier (warm.offload_tiers: []): what is offloaded is priced as computed (issue 63)
EXACT_TIERBLIND = "warmroute_exact_tierblind"
# as it ships, every turn of a session under way is first asked about at its headers (the header path, issue 61); the
# same brains with every body read (envoy.header_path: false) have names of their own
BODY, EXACT_BODY = "warmroute_body", "warmroute_exact_body"
WARMROUTE = ["warmroute", NO_FLOW] + [f"warmroute_{p}" for p in CORE_POLICIES]
COMPARE = ["warmroute", NO_FLOW, f"warmroute_{'seed' if DEFAULT != 'seed' else 'warm'}", *PEERS, "oracle"]
POLICIES = [*WARMROUTE, FLOW_WAIT, EXACT, EXACT_TIERBLIND, BODY, EXACT_BODY, AGGREGATED, *PEERS, *LORA_PEERS,
            *FLOW_PEERS,
            *EXACT_PEERS, *PD_PEERS, *REFERENCE]


def make_policy(name: str, n: int, seed: int, router_cfg: RouterConfig | None = None) -> Policy:
    name = ALIASES.get(name, name)
    if name in ("warmroute", FLOW_WAIT):
        return Warmroute(n, seed, router_cfg, name, flow=True, hold_on_wait=name == FLOW_WAIT, header_path=True)
    if name == NO_FLOW:
        return Warmroute(n, seed, router_cfg, name, header_path=True)
    if name in (EXACT, EXACT_BODY):
        return Warmroute(n, seed, router_cfg, name, flow=True, exact=True, header_path=name == EXACT)
    if name == EXACT_TIERBLIND:
        import dataclasses

        cfg = router_cfg or RouterConfig()
        cfg = dataclasses.replace(cfg, warm=dataclasses.replace(cfg.warm, offload_tiers=()))
        return Warmroute(n, seed, cfg, name, flow=True, exact=True, header_path=True)
    if name == BODY:
        return Warmroute(n, seed, router_cfg, name, flow=True)
    if name == AGGREGATED:
        w = Warmroute(n, seed, router_cfg, name, flow=True, header_path=True)
        w.aggregated = True
        return w
    if name.startswith("warmroute_") and name[len("warmroute_"):] in CORE_POLICIES:
        return Warmroute(n, seed, router_cfg, name, name[len("warmroute_"):])
    factory = PEERS.get(name) or LORA_PEERS.get(name) or FLOW_PEERS.get(name) \
        or EXACT_PEERS.get(name) or PD_PEERS.get(name) or REFERENCE.get(name)
    if factory is None:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
    return factory(n, seed)


__all__ = ["Policy", "RoundRobin", "LeastRequest", "RingHash", "SGLangCacheAware", "LlmdEndpointPicker",
           "LlmdFlowControl", "DynamoKvRouter", "Oracle", "Warmroute", "make_policy", "POLICIES", "PEERS", "ALIASES",
           "COMPARE", "DEFAULT",
           "NO_FLOW"]
