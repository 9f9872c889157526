"""Every word the core says about a decision, as enums: reasons, pin kinds, pin actions, causes, body status.

Metrics, logs, the simulator and tests take their label sets from these, so a new member is
exported as soon as it exists (no dict lookup that raises on an unknown string). They are
``StrEnum``s: each compares equal to, and formats as, its SPEC word.
"""

from __future__ import annotations

import enum


class Reason(enum.StrEnum):
    """Why a replica was chosen (A4)."""

    AFFINITY = "affinity"  # the resolved pin was usable
    LOAD = "load"  # least-loaded (seed) or least cost (warm)
    FALLBACK = "fallback"  # step 5: nothing LIVE or PROBING, a random known replica
    HOLDER = "holder"  # the one replica holding the stored response the request reads, whatever its state
    NO_HEALTHY = "no_healthy_instances"  # nothing known: an immediate 503
    UNKNOWN_MODEL = "model_not_found"  # no replica serves the body's model: an immediate 404 in vLLM's shape
    UNSERVED_PATH = "path_not_served"  # replicas serve the model, none of them the path's API: an immediate 404
    # a compressed body that does not read once inflated: cut off at envoy.max_inflate_ratio, an immediate 413
    INFLATE_LIMIT = "body_inflates_too_far"
    # a Content-Encoding Envoy does not undo (it inflates gzip alone): no replica reads such a body, and its size says
    # nothing of its prompt; an immediate 415
    UNSUPPORTED_ENCODING = "unsupported_content_encoding"
    # a body too big for the brain to read names its own kv_transfer_params (Envoy saw it): an immediate 400, since
    # only the brain's prefill leg may tell an engine where KV comes from (the brain strips them from bodies it reads)
    CLIENT_KV_TRANSFER = "kv_transfer_params_not_allowed"
    # the stored response a request follows, reads or cancels was held by a replica no longer in the fleet: an
    # immediate 404 in vLLM's shape, as that replica would have answered had it lost it
    RESPONSE_GONE = "stored_response_gone"
    # flow control (core.flow): every candidate is saturated for it, so it waits in the router's queue; or the
    # queue is full of its class and above
    HELD = "held"
    QUEUE_FULL = "queue_full"
    # flow control's admission: held, its predicted time to first token (the queue ahead of it, then the best
    # replica's wait and prefill) passes its deadline: refused at once rather than when the deadline passes
    DEADLINE = "deadline_unmeetable"
    # the header path: the request's headers alone do not decide it (its home would not take it, or no
    # home is known); nothing is booked, and its body decides it as any other's
    READ_BODY = "read_body"
    # the request's tenant took its token cap for now (core.caps): an immediate 429 with Retry-After, nothing booked
    TENANT_CAP = "tenant_over_cap"


class Hold(enum.Enum):
    """What may make a policy hold a request in the router (Reason.HELD) instead of placing it: flow control's word
    for one ``select``."""

    NEVER = 0  # flow control off, or critical work: always placed
    SATURATED = 1  # a request that fits on no candidate (or waits behind every session under way) is held
    WAITING = 2  # that, and one every candidate makes wait longer than its own prefill (flow_control.hold_on_wait)
    # SATURATED, and in a flood (the brain refusing new sessions at the look) a new session whose replica has
    # sessions under way and more than its own prefill queued, whatever the other candidates have queued
    FLOODED = 3


class PinKind(enum.StrEnum):
    SESSION = "session"
    PREFIX = "prefix"


class PinAction(enum.StrEnum):
    PIN = "pin"  # a new pin (cause NEW)
    SPILL = "spill"  # the pin could not be used; the request went elsewhere
    REBIND = "rebind"  # the pin moved to another replica
    UNPIN = "unpin"  # the pin was deleted


class Cause(enum.StrEnum):
    NONE = ""
    NEW = "new"
    SPILLS = "spills"  # session: 3 spills in a row; prefix: the second spill
    FORCE = "force"  # effective_running(pin) - min_r >= force_rebind_gap
    DEAD = "dead"  # the pin's replica is not LIVE, drained or removed
    COST = "cost"  # warm policy: another replica is cheaper, re-prefill included (C4)


class BodyStatus(enum.StrEnum):
    """What the request profile could read from the body."""

    OK = "ok"
    ABSENT = "absent"  # no body was seen (GET, or the shell did not buffer it)
    EMPTY = "empty"
    NOT_JSON = "not_json"
    NOT_OBJECT = "not_object"
    TOO_LARGE = "too_large"  # larger than profile.max_body_bytes: routed by headers only
    UNPARSED = "unparsed"  # larger than profile.parse_max_bytes: headers, size and raw block chain only
    HEADERS_ONLY = "headers_only"  # a body too big to copy to the brain: session from headers, tokens from its size
    ENCODED = "encoded"  # a Content-Encoding Envoy did not undo (it inflates gzip): routed by headers and size
    HEADER_PATH = "header_path"  # a turn of a session under way decided at its headers: its body never read
    # decided on its body's first bytes (what the block chain reads) while the rest was still arriving: the endpoint
    # picker's full-duplex stream; session from headers, tokens from its size, the rest streamed past unread
    PARTIAL = "partial"


# (action, kind, cause) triples the core can emit, for metrics that export every series from the start.
PIN_EVENTS: tuple[tuple[PinAction, PinKind, Cause], ...] = tuple(
    [(PinAction.PIN, k, Cause.NEW) for k in PinKind]
    + [(PinAction.SPILL, k, Cause.NONE) for k in PinKind]
    + [(a, k, c) for a in (PinAction.REBIND, PinAction.UNPIN) for k in PinKind
       for c in (Cause.SPILLS, Cause.FORCE, Cause.DEAD, Cause.COST)]
)
