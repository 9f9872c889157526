"""What every simulated router implements (``Policy``): choose a replica for a request, hear how it ended, and
what it may hold (flow control) and send again."""

from __future__ import annotations

import random

from extproc.core import LoadSample
from extproc.tools.workload.generate import Request

HOLD = -1  # choose(): flow control holds the request (it comes back from take_ready)
REFUSED = -2  # choose() or take_ready(): 429 with Retry-After: the client sends it again after RETRY_AFTER_S
RETRY_AFTER_S = 2.0


class Policy:
    name = "policy"
    uses_health = False
    pins_on_non_live = 0  # a policy with pins counts those created or moved onto a replica that is not LIVE
    load_refresh_s: float | None = None  # how often it reads replicas' load metrics (None: never)

    def __init__(self, n: int, seed: int):
        self.n = n
        self.rng = random.Random(seed)
        self.in_flight = [0] * n

    def attach(self, sim) -> None:
        """Called once by the simulation (the oracle reads the engines through it)."""

    def choose(self, req: Request, now: float, exclude: frozenset[int] = frozenset()) -> int | None:
        raise NotImplementedError

    def holds(self) -> bool:
        """Whether requests are held (flow control): the simulator then asks ``take_ready`` again."""
        return False

    def take_ready(self, now: float) -> list[tuple[Request, int | None]]:
        """Held requests that go now, each with its replica (None: it cannot be served)."""
        return []

    def retry_target(self, req: Request, now: float, exclude: frozenset[int]) -> int | None:
        """Where Envoy retries a request whose replica refused the connection."""
        return self.choose(req, now, exclude)

    def pool(self, exclude: frozenset[int]) -> list[int]:
        return [i for i in range(self.n) if i not in exclude]

    def two_choices(self, exclude: frozenset[int]) -> int | None:
        """Envoy's LEAST_REQUEST: two random choices, the one with fewer active requests wins."""
        pool = self.pool(exclude)
        if not pool:
            return None
        a, b = self.rng.choice(pool), self.rng.choice(pool)
        return a if self.in_flight[a] <= self.in_flight[b] else b

    aggregated = False  # True: the same replicas as whole ones, never disaggregated (the P/D baseline)

    def roles(self, prefill: frozenset[int]) -> None:
        """Replicas of role prefill (the simulator keeps them out of ``choose``)."""
        self.prefill_set = prefill

    def prefill_for(self, req: Request, i: int, now: float, prefills: list[int]) -> int | None:
        """The prefill replica for a request decoded on ``i`` (None: ``i`` prefills it): never, unless a P/D policy."""
        return None

    def prefill_done(self, req: Request, now: float) -> None:
        pass

    def start(self, req: Request, i: int, now: float) -> None:
        self.in_flight[i] += 1

    def done(self, req: Request, now: float) -> None:
        if req.replica is not None:
            self.in_flight[req.replica] -= 1

    def first_token(self, req: Request, now: float) -> None:
        """The request's first token streamed (what a front sees as the response body's first chunk)."""

    def first_token_known_at(self, req: Request, now: float) -> float | None:
        """When the router learns of the first token that streamed at ``now`` while the request runs on (None: it
        does not, before the request's end)."""
        return None

    def first_token_known(self, req: Request, now: float) -> None:
        """What ``first_token_known_at`` said came (the request may have ended since)."""

    def on_scrape(self, i: int, ok: bool, now: float, sample: LoadSample | None = None) -> None:
        pass

    def on_load(self, i: int, sample: LoadSample, now: float) -> None:
        pass

    def on_upstream(self, i: int, ok: bool, now: float) -> None:
        pass

    def tick(self, now: float) -> None:
        pass

    def routable(self, i: int) -> bool:
        """Whether the policy itself would send traffic to replica i (for the imbalance index)."""
        return True

    def health_transitions(self) -> list:
        return []

    def ejected(self, i: int) -> bool:
        return False
