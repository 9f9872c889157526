"""Per-tenant token caps (issue 63): what one tenant may make the fleet compute in a minute, in the engine's tokens
(the prompt's uncached part and the answer). Fairness (``core.flow``) orders who goes next while requests wait; a cap
bounds what a tenant takes at all, so that one sending five times its share slows the others no more than its share
does. Each tenant has a bucket of one minute's tokens, refilled continuously; a request is let in while its tenant's
bucket holds anything, and what it costs is taken once it is placed (its prompt's uncached part as priced, and its
expected answer), so a large request may leave the bucket in debt, at most one minute's worth: the tenant then waits
for the refill, told so by Retry-After. Several brains count each other's requests (shared state, ``Router._spend``).
Tenants are counted by their hash (``flow.tenant_key``); nothing else of them is kept."""

from __future__ import annotations

import itertools

from .flow import tenant_key

# buckets kept at most (tenants as many as API keys, or a client inventing credentials): past it the full ones (as
# good as never seen) are forgotten, then the least recently charged, down to nine tenths, so that the walk is paid
# once per tenth of it and not on every request. A tenant forgotten in debt starts again with a full bucket
MAX_TENANTS = 100_000


class TenantCaps:
    __slots__ = ("default", "per_tenant", "buckets", "spent", "refused")

    def __init__(self, per_minute: float, per_tenant: dict[str | None, float] | None = None):
        self.default = per_minute  # tokens a minute of a tenant not named (0: no cap)
        self.per_tenant = per_tenant or {}  # tenant key -> its own (0: none)
        self.buckets: dict[str | None, tuple[float, float]] = {}  # tenant key -> (tokens left, when)
        self.spent: dict[str | None, float] = {}  # tenant key -> tokens taken since the start (metrics)
        self.refused: dict[str | None, int] = {}  # tenant key -> requests refused at its cap (metrics)

    def rate_of(self, tenant: str | None) -> float:
        return self.per_tenant.get(tenant, self.default)

    def _left(self, tenant: str | None, rate: float, now: float) -> float:
        b = self.buckets.get(tenant)
        if b is None:
            return rate
        left, at = b
        return min(rate, left + rate / 60.0 * max(0.0, now - at))

    def retry_after(self, tenant: str | None, now: float) -> float | None:
        """Seconds until the tenant may send again (its bucket empty or in debt), or None: it may now."""
        rate = self.rate_of(tenant)
        if rate <= 0:
            return None
        left = self._left(tenant, rate, now)
        if left > 0:
            return None
        self.refused[tenant] = self.refused.get(tenant, 0) + 1
        return (-left + 1.0) / (rate / 60.0)

    def spend(self, tenant: str | None, tokens: float, now: float) -> None:
        """A request of the tenant placed (by this brain or another): its cost out of the bucket."""
        rate = self.rate_of(tenant)
        if rate <= 0 or tokens <= 0:
            return
        left = max(-rate, self._left(tenant, rate, now) - tokens)
        self.buckets.pop(tenant, None)  # re-inserted last: the dict's order is the order of last charge
        self.buckets[tenant] = (left, now)
        self.spent[tenant] = self.spent.get(tenant, 0.0) + tokens
        if len(self.buckets) > MAX_TENANTS:
            for t in [t for t in self.buckets if self._left(t, self.rate_of(t), now) >= self.rate_of(t)]:
                del self.buckets[t]
            for t in list(itertools.islice(self.buckets, max(0, len(self.buckets) - MAX_TENANTS * 9 // 10))):
                del self.buckets[t]
        if len(self.spent) > MAX_TENANTS:
            self.spent.clear()  # a counter per API key is what MAX_TENANTS bounds: a restart of the counts
            self.refused.clear()


def caps_of(flow_control) -> TenantCaps | None:
    """The caps a config's ``flow_control`` asks for (None: no tenant is capped); tenants are named there, counted here
    by their hash."""
    named = {tenant_key(name): float(rate) for name, rate in flow_control.tenant_caps}
    if not flow_control.tenant_tokens_per_minute and not any(named.values()):
        return None
    return TenantCaps(float(flow_control.tenant_tokens_per_minute), named)


__all__ = ["TenantCaps", "MAX_TENANTS", "caps_of"]
