"""The header path: a turn of a session under way decided at its request headers.

Envoy asks the brain with a request's headers before it reads the body when they name a session and declare a size
(``envoy_config.filters.header_path_filter``). The brain answers with the route when the headers decide it: the
session has a home, the home serves the request's model and path, and the cost model keeps the turn there (priced
by its declared size and what the home holds of the session). The body then streams to the replica: no buffer, no
second call, no parse. Anything else reads the body, as before: ``turn`` says why.

Which requests take it, and which read their body (docs/architecture.md, "Two paths"):
- taken: POSTs to the chat, completions and Messages APIs with a session header and a Content-Length, in a fleet that
  serves one model (no alias, no adapter), or whose ``profile.model_header`` names a model the home serves;
- read: new sessions; sessions whose home is not LIVE, cannot take the turn (the cost model would move it, flow
  control would hold it) or no longer holds the session (exact mode: the engine evicted its last block); stored
  Responses (a follow-up's home is its response's); fleets with prefill replicas (the prefill leg needs the body);
  aliases and several models without a model header (the body names the model); compressed bodies; a turn whose
  declared size grew more than a turn adds or shrank (``core.profile.size_decides``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..answers import Answered
from ..contract import CONTENT_ENCODING_HEADER, INFLATED_FROM_HEADER
from ..core.apis import Api
from ..core.decision import Decision
from ..core.flow import CRITICAL
from ..core.models import Resolution
from ..core.names import BodyStatus, Reason
from ..core.profile import RequestProfile, declared_size, header_profile, size_decides, ttft_slo_of

APIS = (Api.CHAT, Api.COMPLETIONS, Api.MESSAGES)

# why a request that asked at its headers read its body (warmroute_header_path_declined_total{why})
WHY = ("policy", "method", "encoded", "api", "no_session", "new_session", "model", "size", "disaggregation",
       "home_declined")


@dataclass(slots=True)
class Asked:
    """What one header call read of its headers, once, for every step of it (the decision, the refusals after it):
    ``read``, whether its header profile was made; ``profile``, that profile (None: its headers name no session or
    declare no size); ``why``, why the headers did not decide it."""
    read: bool = False
    profile: RequestProfile | None = None
    why: str | None = None


def turn(brain, headers: dict[str, str], now: float, more: "dict[str, Any] | None" = None,
         asked: Asked | None = None) -> tuple[str | None, RequestProfile | None, Resolution | None]:
    """(None, its profile, its model's resolution) for a turn the headers may decide; (why not, None, None) else.
    ``more``: further fields of its profile (flow control's), set in the one copy made of it; ``asked`` keeps the
    header profile made."""
    router = brain.router
    if not router.policy.decides_at_headers:
        return "policy", None, None
    why = unread_why(headers)
    if why is not None:
        return why, None, None
    if not declared_size(headers):
        return "size", None, None
    profile = header_profile(headers, router.profile_cfg)
    if asked is not None:
        asked.read, asked.profile = True, profile
    if profile is None:
        return "no_session", None, None
    if profile.api not in APIS:
        return "api", None, None
    pin = router.session_pins.get(profile.session_key, now)
    if pin is None:
        return "new_session", None, None
    models = brain.models
    res = model_said(brain, headers, profile.session_key)
    if res is None or (res.replicas is not None and pin.replica.name not in res.replicas):
        return "model", None, None
    if not size_decides(pin.tokens, profile.tokens):
        return "size", None, None
    if brain.prefill_fleet():
        return "disaggregation", None, None
    bound = models.max_model_len(res.model)
    profile = dataclasses.replace(
        profile, model=res.model, adapter=res.model if models.is_adapter(res.model) else None,
        tokens=min(profile.tokens, bound) if bound is not None else profile.tokens, **(more or {}))
    return None, profile, res


def unread_why(headers: dict[str, str]) -> str | None:
    """Why a request's body must be read before it is routed, by its method and encoding: "method" (not a POST),
    "encoded" (a Content-Encoding the brain cannot see through, or Envoy inflated it); None: its headers may do."""
    if headers.get(":method", "POST") != "POST":
        return "method"
    if headers.get(CONTENT_ENCODING_HEADER, "identity").strip().lower() not in ("", "identity") or \
            headers.get(INFLATED_FROM_HEADER):
        return "encoded"
    return None


def model_said(brain, headers: dict[str, str], session_key: bytes | None) -> Resolution | None:
    """The resolution of the model a request's headers say (``profile.model_header``, or the fleet's one model),
    sent as named (no alias to rewrite); None: only its body can say it."""
    header = brain.cfg.router.profile.model_header
    model = (headers.get(header.lower()) if header else None) or brain.models.one_model()
    if model is None:
        return None
    res = brain.models.resolve(model, session_key, headers.get(":path", "").split("?", 1)[0] or None)
    return None if res.rewritten else res


def refused_behind_queue(brain, headers: dict[str, str], now: float, asked: Asked | None = None) -> Answered | None:
    """A new session refused at its headers where its body would only be read to be refused the same way: flow
    control queues a new session behind its class unpriced (``Router.behind_queue``: nothing of its body counts), and
    that wait already passes its deadline (429 ``deadline_unmeetable``). In a flood of 2,000 small new sessions (no
    look: under 64 KiB) each body was read, a gRPC call, to be refused so, while the turns under way waited behind
    them (issue 59, finding 6). None: its body decides, as before (no flow control, critical work, a session under
    way, no queue ahead, a model or size the headers cannot tell). ``asked``: the header profile the call made."""
    router = brain.router
    if router.flow is None or not router.policy.decides_at_headers:
        return None
    priority = brain.priority(headers)
    if not router.flow.queue.ahead(priority)[0]:  # the common case, first: nothing queued, nothing to refuse behind
        return None
    profile = asked.profile if asked is not None and asked.read else header_profile(headers, router.profile_cfg)
    if profile is None or priority == CRITICAL or profile.api not in APIS or unread_why(headers) is not None:
        return None
    res = model_said(brain, headers, profile.session_key)
    bound = brain.models.max_model_len(res.model) if res is not None else None
    if res is None or (bound is not None and profile.tokens > bound):  # past its context: the engine's 400, never held
        return None
    profile = dataclasses.replace(profile, priority=priority, ttft_slo_s=ttft_slo_of(headers))
    queued, wait = router.behind_queue(profile, now)
    within = router.flow.within(priority, profile.ttft_slo_s)
    if not queued or wait is None or within is None or wait <= within:
        return None
    d = Decision(None, Reason.DEADLINE, predicted_ttft_s=wait)
    brain.stats.record_decision(d, BodyStatus.HEADER_PATH, now)
    return brain.too_many(d, headers)
