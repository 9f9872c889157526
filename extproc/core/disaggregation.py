"""Prefill/decode disaggregation, priced (docs/routing.md "Prefill/decode disaggregation").

The decode replica is chosen first, as any request's replica (cached prefix, queue, KV, guard). Then its prompt's
prefill goes to a replica of role prefill when that beats computing it there, in the cost model's units (seconds
someone waits):

    local  = ttft(decode replica) + prefill(decode replica) x (the streams decoding there
                                                             + those arriving during it / 2)
             (a prefill runs inside the batch's steps: each stream under way waits for it)
    remote = wait(p) + prefill(prompt - cached(p), p) + transfer(prompt - cached(decode replica)) + a decode step

for the prefill replica p whose wait + prefill is least. A prefill under a decode step stays local (nothing to
gain that the estimates can tell). The transfer rate is learned from the decode legs' first tokens; until then,
``disaggregation.transfer_tokens_per_s``, low on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .apis import Api
from .names import BodyStatus

if TYPE_CHECKING:
    from .config import DisaggregationConfig
    from .cost import Estimate
    from .profile import RequestProfile
    from .replica import Replica

DISAGGREGATED_APIS = (Api.CHAT, Api.COMPLETIONS)  # vLLM reads kv_transfer_params on these paths
# a body the brain holds as a JSON object, to send as the prefill leg and rewrite for the decode leg
LEG_BODIES = (BodyStatus.OK, BodyStatus.UNPARSED)
_ALPHA = 0.2
_CLIP = 10.0  # one transfer's rate counts at most 10x either side of what is known: a stalled leg is no rate


@dataclass(slots=True)
class PrefillPlan:
    replica: "Replica"  # where the prefill leg goes
    ttft: float  # the request's predicted first token with the remote prefill
    local_ttft: float  # ... and computed on its decode replica (what it beat, for /decisions)
    prefill_s: float  # the leg's prefill seconds on its replica (booked in its queue)
    prompt: int  # the prompt in that replica's tokens
    transfer_tokens: int  # KV the decode replica loads: what its own cache lacks


class TransferRate:
    """KV tokens a second between replicas: the prior until a decode leg's first token says otherwise."""

    __slots__ = ("value", "samples")

    def __init__(self, prior: float):
        self.value, self.samples = prior, 0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        rate = min(max(tokens / seconds, self.value / _CLIP), self.value * _CLIP)
        self.value = rate if self.samples == 0 else self.value + _ALPHA * (rate - self.value)
        self.samples += 1


def eligible(profile: "RequestProfile", prompt: int, cfg: "DisaggregationConfig") -> bool:
    """Whether a request may have its prefill elsewhere at all: its body held as JSON on an API whose engines read
    kv_transfer_params, no adapter, no size alone, and no more KV to move than ``max_transfer_tokens``."""
    return not (profile.provisional or profile.header_path or profile.body_status not in LEG_BODIES
                or profile.api not in DISAGGREGATED_APIS or profile.adapter is not None
                or (cfg.max_transfer_tokens is not None and prompt > cfg.max_transfer_tokens))


def plan(best: "Estimate", leg: "Estimate", transfer_tps: float, decoding: float, tie_s: float,
         leg_overhead_s: float = 0.0) -> PrefillPlan | None:
    """The prefill leg's plan on ``leg``'s replica when it beats ``best``'s (the decode replica's) own prefill, what
    that costs the ``decoding`` streams there included; else None. ``leg_overhead_s``: the prefill replica's own
    first-token overhead for this prompt (its API server's template, tokenizing and hashing), which the local
    prefill's ``best.ttft`` carries for the decode replica; the decode leg's own is in the learned transfer."""
    moved = best.prompt - best.cached
    ttft = leg.wait + leg.prefill + leg_overhead_s + moved / transfer_tps + best.dec
    if not worth_it(best.ttft + best.risk, best.prefill, decoding, ttft, tie_s):
        return None
    return PrefillPlan(leg.replica, ttft, best.ttft, leg.prefill, leg.prompt, moved)


def worth_it(local_ttft: float, local_prefill_s: float, decoding: float, remote_s: float, tie_s: float) -> bool:
    """Whether the remote prefill beats the local one, what the local prefill costs the batch included."""
    if local_prefill_s < tie_s:
        return False
    return remote_s + tie_s < local_ttft + local_prefill_s * decoding
