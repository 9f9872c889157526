"""What one selection returns, and the reservation it holds until Envoy ends the request."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

from .names import Cause, PinAction, PinKind, Reason

if TYPE_CHECKING:
    from .disaggregation import PrefillPlan
    from .replica import Replica


@dataclass(slots=True)
class Reservation:
    """In-flight weight held on a replica from selection until Envoy ends the request."""

    id: int
    replica: "Replica"
    weight_milli: int
    started_at: float
    released: bool = False
    work_s: float = 0.0  # the warm policy's predicted engine seconds for this request (C1)
    predicted_ttft_s: float | None = None  # the warm policy's estimate, to compare with what Envoy saw
    overhead_s: float = 0.0  # of which the replica's learned first-token overhead (the rest is the cost model's)
    token: str = ""  # the shell's unguessable name for it (only its holder, Envoy, can name it back)
    seen_at: float = 0.0  # when Envoy last said the request is alive (its start, or a periodic log entry)
    engine: int | None = None  # the data-parallel engine it went to (warm policy)
    # what the request added to its replica's predicted prefill queue, taken back when it ends, whatever the ending
    # (a 413, a reset, a cancel, a body never sent): its prefill seconds and its prompt tokens counted as pending KV
    prefill_s: float = 0.0
    pending_tokens: int = 0
    provisional: bool = False  # charged before its body was known (headers alone): a bounded guess
    booking: object = None  # the policy's own books of it (``Decision.booking``): nobody else reads them
    claimed: int = 0  # another brain's reservation: the pending tokens it claimed on its replica (Remote's bound)
    remote: bool = False  # another brain's (shared state): its end is that brain's to say
    leg_s: float = 0.0  # a decode leg: seconds from the decision to its send (its prefill leg's)
    transfer_tokens: int = 0  # a decode leg: the KV tokens it loads from its prefill replica (the rate is learned)
    # a decode leg: what to call when its request ended without reaching a replica (the KV is handed over anyway)
    handoff: "Callable[[], None] | None" = None
    at_headers: bool = False  # named to Envoy at the request's headers (the header path): its body was never read


@dataclass(frozen=True, slots=True)
class PinEvent:
    """A pin table change of one decision: ``action`` on a pin of ``kind``, and why."""

    action: PinAction
    kind: PinKind
    cause: Cause = Cause.NONE


@dataclass(slots=True)
class Decision:
    replica: "Replica | None"
    reason: Reason
    pin_kind: PinKind | None = None  # the pin resolved for this request, if any
    events: list[PinEvent] = field(default_factory=list)
    reservation: Reservation | None = None
    predicted_ttft_s: float | None = None  # warm policy: the estimate that chose the replica (C3)
    cached_tokens: int = 0  # warm policy: prompt tokens the chosen replica probably holds (the engine's tokens)
    prompt_tokens: int = 0  # warm policy: the prompt in the chosen engine's tokens, as priced
    prefix: int | None = None  # warm policy: the last block hash of ``cached_tokens`` (what it shares there)
    restored_tokens: int = 0  # warm policy: of the prompt past ``cached_tokens``, what an offloaded tier restores there
    restored_from: str | None = None  # warm policy: that tier's medium (CPU, STORAGE)
    work_s: float = 0.0  # warm policy: predicted engine seconds of this request
    # warm policy, a replica with several data-parallel engines: the engine priced (None: one engine)
    engine: int | None = None
    retry_after_s: float | None = None  # Reason.TENANT_CAP: when its tenant may send again
    # stored responses: the id the brain writes into the body for the response this request creates (minted), or
    # the id of the one found gone
    response_id: str | None = None
    steer: bool = False  # True: the answer names the engine (X-data-parallel-rank)
    model: str | None = None  # the served model it goes to (an alias resolved)
    rewrite_model: bool = False  # the client named an alias: the body must name ``model`` instead
    kv_transfer: bool | None = None  # the body names its own kv_transfer_params (None: not known): dropped when sent
    # prefill/decode disaggregation: the prefill leg's plan (None: the replica computes the prompt itself) and the
    # weight it holds on its prefill replica until the leg ends
    prefill: "PrefillPlan | None" = None
    prefill_reservation: Reservation | None = None
    header_path: bool = False  # decided at its request headers: its body never read
    # what the policy priced, to take back in on_reserved / plan_prefill: opaque to the fleet
    booking: object = None
    # Reason.HELD: the prompt tokens a second its candidates prefill at (what drains the queue) and when its best
    # replica was predicted to have room (0: the policy does not say)
    drain_tps: float = 0.0
    free_at: float = 0.0

    @property
    def replica_name(self) -> str | None:
        return self.replica.name if self.replica is not None else None


class FleetView(Protocol):
    """What a policy sees of the fleet: the replicas (read only) and the candidate pool (A4 step 1)."""

    @property
    def replicas_view(self) -> list["Replica"]: ...

    @property
    def pool_epoch(self) -> int | None:
        """The pool's version: it changes whenever the pool does (None: a view of one replica, priced whole)."""

    @property
    def only(self) -> "Collection[str] | None":
        """The replicas a gateway allows (None: every one)."""

    def pool(self) -> tuple[list["Replica"], list["Replica"]]:
        """(LIVE, PROBING) replicas, drained ones left out."""
