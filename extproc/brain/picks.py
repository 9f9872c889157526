"""The endpoint picker's side of the brain (Gateway API Inference Extension): a request's pick as ``ip:port``
endpoints, its fallbacks, and the reservation the picker's front itself releases when the response ends (no access
log comes from a foreign gateway)."""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable, Collection
from typing import Protocol

from ..answers import Answered
from ..config import AppConfig
from ..contract import REQUEST_ID_HEADER
from ..core import Decision, Reason, Reservation
from ..core.apis import Api, api_of
from ..core.models import ModelCatalog
from ..core.profile import BODY_MODEL_KEY, BODY_PARTIAL_KEY, declared_size, partial_reach
from ..core.router import NO_HEALTHY
from ..picker.messages import path_of

from ..core.router import Router
from .decision_log import DecisionLog
from .header_path import model_said, unread_why
from .release import Releaser

PICK = "pick"  # a held request's phase when the endpoint picker's front waits for it (its answer is a Pick)


def endpoint(r) -> str:
    """A replica as gateways name it: ``ip:port``, an IPv6 address in brackets."""
    return f"[{r.host}]:{r.port}" if ":" in r.host else f"{r.host}:{r.port}"


@dataclass(slots=True)
class Pick:
    endpoints: list[str]  # best first, then where the gateway retries; empty: nothing to pick
    reservation: Reservation | None
    dp_rank: int | None = None  # the pick's data-parallel engine, sent as X-data-parallel-rank
    subset_empty: bool = False  # the gateway's subset named no endpoint the brain knows
    body: bytes | None = None  # the body to send instead (a model alias rewritten to the served name)
    unknown_model: str | None = None  # no replica serves the model the body names: answer 404
    unserved_path: str | None = None  # no replica (of the model) serves the request's path: answer 404
    immediate: Answered | None = None  # the answer to give at once instead (a 413)
    held: object = None  # flow control holds it: the pick comes later from ``let_go`` under this key


class Deciding(Protocol):
    """What a pick asks of the brain."""

    cfg: AppConfig
    router: Router
    models: ModelCatalog
    releaser: Releaser
    decisions: DecisionLog
    held: dict
    endpoint_of: dict[str, str]
    clock: Callable[[], float]

    def choose(self, headers: dict[str, str], body: bytes | None, only: Collection[str] | None = None,
               hold_key: object = None) -> Decision: ...

    def decide_at_headers(self, headers: dict[str, str], only: "set[str] | None",
                          arriving: bool = False) -> Decision | None: ...

    def too_many(self, d: "Decision | str", headers: dict[str, str] | None = None) -> Answered: ...

    def immediate(self, d: Decision, headers: dict[str, str]) -> Answered | None: ...

    def body_for(self, d: Decision, body: bytes | None) -> bytes | None: ...

    def hold_key(self) -> object: ...

    def prefill_fleet(self) -> bool: ...


class Picks:
    def __init__(self, brain: Deciding):
        self.brain = brain
        self._untrusted_of: tuple[AppConfig, frozenset[str]] | None = None

    def pick_at_headers(self, headers: dict[str, str], subset: list[str] | None) -> "Pick | None":
        """The endpoint picker's header path: the pick of a turn its headers decide (its work booked once its body has
        passed: ``Router.arrived``), or None (its body decides)."""
        only = None
        if subset is not None:
            only = {self.brain.releaser.by_address[a] for a in subset if a in self.brain.releaser.by_address}
            if not only:
                return None
        untrusted = self.untrusted
        if untrusted and any(h in headers for h in untrusted):
            headers = {k: v for k, v in headers.items() if k not in untrusted}
        d = self.brain.decide_at_headers(headers, only, arriving=True)
        return self.pick_of(d, headers, None, only) if d is not None else None

    def pick(self, headers: dict[str, str], body: bytes | None, subset: list[str] | None) -> Pick:
        """The endpoint picker's front: the choice and its fallbacks as ``ip:port``, and the reservation the
        front itself releases when the response ends (no access log comes from a foreign gateway).

        ``subset``: the gateway's hint; endpoints it names that the brain does not know are ignored, and
        none known -> no pick (the front answers 503, as the protocol asks)."""
        only = None
        if subset is not None:
            only = {self.brain.releaser.by_address[a] for a in subset if a in self.brain.releaser.by_address}
            if not only:
                return Pick([], None, None, subset_empty=True)
        untrusted = self.untrusted
        if untrusted and any(h in headers for h in untrusted):  # a client's own class or tenant: nobody stripped it
            headers = {k: v for k, v in headers.items() if k not in untrusted}
        key = self.brain.hold_key()
        if headers.get(BODY_PARTIAL_KEY):  # its first bytes (``early_reach``): the front sends the rest as it came
            model = self._partial_model(headers)
            headers = {**headers, BODY_MODEL_KEY: model} if model is not None else headers
        d = self.brain.choose(headers, body, only, hold_key=key)
        sent = None if headers.get(BODY_PARTIAL_KEY) else body
        if d.reason is Reason.HELD:
            self.brain.held[key].answered_as(headers, sent, PICK, only)
            return Pick([], None, held=key)
        if d.reason in (Reason.QUEUE_FULL, Reason.DEADLINE, Reason.TENANT_CAP):
            return Pick([], None, immediate=self.brain.too_many(d, headers))
        return self.pick_of(d, headers, sent, only)

    def early_reach(self, headers: dict[str, str]) -> int | None:
        """How many of its body's first bytes decide a request the endpoint picker's full-duplex stream would
        otherwise decide on its headers alone (its declared size past ``brain_body_max_bytes``): what the block chain
        reads (``core.profile.partial_reach``), when nothing past them can move it: a POST to the chat or completions
        API, its model known without its body (the fleet's one model, or the model header) and sent as it came (no
        alias), no prefill leg to send. The rest passes through unread. None: decided as before."""
        b = self.brain
        size = declared_size(headers)
        limit = b.cfg.envoy.brain_body_max_bytes
        if not b.router.needs_blocks or size is None or size <= limit or unread_why(headers) is not None \
                or api_of(path_of(headers)) not in (Api.CHAT, Api.COMPLETIONS) or b.prefill_fleet() \
                or self._partial_model(headers) is None:
            return None
        return min(partial_reach(b.router.profile_cfg), limit)

    def connectors(self) -> bool:
        """The fleet's engines run a KV connector that acts on kv_transfer_params (a replica of role prefill or
        decode): the picker reads a body it passes on unread for a client's own."""
        return any(r.role != "both" for r in self.brain.router.replicas)

    def _partial_model(self, headers: dict[str, str]) -> str | None:
        """The model of a request decided on its body's first bytes (its body may name it last), when its headers
        say it: the model header, or the fleet's one model; and sent as named (no alias to rewrite)."""
        res = model_said(self.brain, headers, None)
        return res.model if res is not None and (res.replicas is None or res.replicas) else None

    def pick_of(self, d: Decision, headers: dict[str, str], body: bytes | None,
                 only: "set[str] | None") -> Pick:
        """A placed decision as the endpoint picker's answer."""
        if d.reason is Reason.TENANT_CAP:  # at its headers (the header path)
            return Pick([], None, immediate=self.brain.too_many(d, headers))
        if d.reason == Reason.UNKNOWN_MODEL:
            return Pick([], None, unknown_model=d.model or "", immediate=self.brain.immediate(d, headers))
        if d.reason == Reason.UNSERVED_PATH:
            return Pick([], None, unserved_path=path_of(headers), immediate=self.brain.immediate(d, headers))
        if d.reason in (Reason.INFLATE_LIMIT, Reason.UNSUPPORTED_ENCODING, Reason.CLIENT_KV_TRANSFER,
                        Reason.RESPONSE_GONE):
            return Pick([], None, immediate=self.brain.immediate(d, headers))
        if d.reason == NO_HEALTHY:
            return Pick([], None)
        assert d.replica is not None  # placed
        names = [d.replica, *self.brain.router.next_best(d.replica, self.brain.cfg.brain.picker_fallbacks, only)]
        rank = d.engine if d.steer else None
        count = self.brain.router.policy.engine_count
        if rank is not None and any(count(r.name) <= rank for r in names):
            rank = None  # a fallback without that engine would refuse the header: let the front ends choose
        self.brain.decisions.remember(headers.get(REQUEST_ID_HEADER), d, self.brain.clock())
        return Pick([self.brain.endpoint_of[r.name] for r in names], d.reservation, rank, body=self.brain.body_for(d,
                                                                                                                   body))

    def end(self, res: Reservation, served: str | None, failed: bool | None, first_byte_s: float | None) -> None:
        """A picked request ended (its response's end, or the stream's): release it and count the outcome."""
        self.brain.releaser.finish(res, self.brain.releaser.by_address.get(served) if served else None, failed,
                                   first_byte_s)

    @property
    def untrusted(self) -> frozenset[str]:
        """Headers a picker ignores: what the gateway in front may pass from clients unstripped (brain.trust_gateway_
        headers, or the trust_downstream_* settings, say otherwise). Worked out once per config, not per pick."""
        cached = self._untrusted_of
        if cached is not None and cached[0] is self.brain.cfg:
            return cached[1]
        self._untrusted_of = (self.brain.cfg, untrusted_headers(self.brain.cfg))
        return self._untrusted_of[1]


def untrusted_headers(cfg: AppConfig) -> frozenset[str]:
    """Headers a picker ignores: what the gateway in front may pass from clients unstripped (brain.trust_gateway_
    headers, or the trust_downstream_* settings, say otherwise)."""
    if cfg.brain.trust_gateway_headers:
        return frozenset()
    out = set()
    if cfg.flow_control.enabled and not cfg.flow_control.trust_downstream_priority_header:
        out.add(cfg.flow_control.priority_header.lower())
    p = cfg.router.profile
    if p.tenant_source == "header" and p.tenant_header and not cfg.envoy.trust_downstream_tenant_header:
        out.add(p.tenant_header.lower())
    return frozenset(out)
