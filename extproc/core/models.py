"""Which replicas serve which model (SPEC issue 21 "Several models").

Each replica serves the models its ``/v1/models`` lists (re-read on every health scrape) or that its
config names. A request goes only to the replicas that serve its body's ``model``; a name no replica
serves is answered 404 in vLLM's own shape, never sent to a replica that would refuse it. A model
alias maps a client's name to served names, weighted (a canary takes a share of an alias's traffic),
as the Gateway API Inference Extension's ``InferenceModelRewrite`` does.

A replica whose models are not known yet (no successful ``/v1/models``: a new replica, or a server
without that endpoint) may take a model no known replica serves: until the fleet says otherwise the
request is not refused. A request without ``model`` goes anywhere (vLLM serves its own model then).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Collection, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Target:
    model: str  # the served name the request goes to
    weight: float


@dataclass(frozen=True, slots=True)
class Resolution:
    """Where a request for one model may go."""

    model: str | None  # the served name (an alias resolved); None: the request names none
    replicas: frozenset[str] | None  # eligible replicas; None: any; empty: no replica serves it (404)
    rewritten: bool = False  # the client asked for an alias: the body's model must say ``model``

    @property
    def unknown(self) -> bool:
        return self.replicas is not None and not self.replicas


class ModelCatalog:
    def __init__(self, aliases: Mapping[str, tuple[Target, ...]] | None = None, seed: int | None = None):
        self.aliases = dict(aliases or {})
        # replica -> {model id -> the replica's own model object} (None: not known)
        self._served: dict[str, dict[str, dict] | None] = {}
        self._configured: set[str] = set()  # replicas whose models the config names (scrapes do not change them)
        self._random = random.Random(seed)
        # built from _served when a request first needs it after a change, so that a request costs dictionary
        # look-ups, not a walk over the fleet: model -> replicas serving it, replicas not known yet, adapters
        self._index: dict[str, frozenset[str]] | None = None
        self._unknown: frozenset[str] = frozenset()
        self._adapters: frozenset[str] = frozenset()

    def _built(self) -> dict[str, frozenset[str]]:
        if self._index is None:
            index: dict[str, set[str]] = {}
            adapters = set()
            for replica, models in self._served.items():
                for mid, obj in (models or {}).items():
                    index.setdefault(mid, set()).add(replica)
                    if obj.get("parent"):
                        adapters.add(mid)
            self._index = {m: frozenset(rs) for m, rs in index.items()}
            self._unknown = frozenset(r for r, ms in self._served.items() if ms is None)
            self._adapters = frozenset(adapters)
        return self._index

    # ---------------------------------------------------------------- sources

    def configure(self, replicas: Mapping[str, Collection[str] | None]) -> None:
        """The replica set (a reload or discovery): configured model lists, others learned from scrapes."""
        self._index = None
        for name in [n for n in self._served if n not in replicas]:
            del self._served[name]
        self._configured = {n for n, ms in replicas.items() if ms}
        for name, models in replicas.items():
            if models:
                self._served[name] = {m: {"id": m, "object": "model", "owned_by": "warmroute"} for m in models}
            else:
                self._served.setdefault(name, None)

    def learned(self, replica: str, models: list[dict] | None) -> bool:
        """What one replica's /v1/models said (None: it could not be read); True if its set changed."""
        if replica in self._configured or replica not in self._served or models is None:
            return False
        new = {m["id"]: m for m in models}
        old = self._served[replica]
        if old != new:
            self._served[replica] = new
            self._index = None
        return old is None or set(old) != set(new)

    def is_adapter(self, model: str | None) -> bool:
        """A LoRA adapter: a model a replica lists with a parent (vLLM lists its adapters so)."""
        self._built()
        return model in self._adapters

    def served_by(self, replica: str) -> list[str] | None:
        models = self._served.get(replica)
        return sorted(models) if models is not None else None

    # ---------------------------------------------------------------- choice

    def resolve(self, model: str | None, session_key: bytes | None = None) -> Resolution:
        if model is None:
            return Resolution(None, None)
        targets = self.aliases.get(model)
        name = self._pick(targets, session_key) if targets else model
        serving = self._built().get(name)
        rewritten = bool(targets) and name != model
        if serving is not None and len(serving) == len(self._served) or not self._served:
            return Resolution(name, None, rewritten)  # every replica serves it (or there are none): no subset
        # no replica known to serve it: those whose models are not known yet may (never refuse blind)
        return Resolution(name, serving or self._unknown, rewritten)

    def _pick(self, targets: tuple[Target, ...], session_key: bytes | None) -> str:
        """A weighted choice; a session always gets the same one (its cache is on that model's replicas)."""
        total = sum(t.weight for t in targets)
        if session_key is not None:
            x = int.from_bytes(hashlib.blake2b(session_key, digest_size=8).digest(), "big") / 2**64 * total
        else:
            x = self._random.random() * total
        for t in targets:
            x -= t.weight
            if x < 0:
                return t.model
        return targets[-1].model

    # ---------------------------------------------------------------- the list

    def union(self, eligible: Collection[str] | None = None) -> list[dict]:
        """What GET /v1/models answers: every model a replica (of ``eligible``) serves, each once, as the first
        replica that lists it describes it; then each alias whose targets are served, as a model of its own."""
        out: dict[str, dict] = {}
        for name, models in sorted(self._served.items()):
            if models is None or (eligible is not None and name not in eligible):
                continue
            for mid, obj in models.items():
                out.setdefault(mid, obj)
        for alias, targets in self.aliases.items():
            if alias not in out and any(t.model in out for t in targets):
                out[alias] = {"id": alias, "object": "model", "owned_by": "warmroute",
                              "root": next(t.model for t in targets if t.model in out)}
        return [out[k] for k in sorted(out)]


def not_found_body(model: str) -> dict:
    """vLLM's answer to a model it does not serve (``OpenAIServing._check_model``: NotFoundError, 404)."""
    return {"error": {"message": f"The model `{model}` does not exist.", "type": "NotFoundError", "param": None,
                      "code": 404}}


__all__ = ["ModelCatalog", "Resolution", "Target", "not_found_body"]
