"""Which replicas serve which model (SPEC "Several models").

Each replica serves the models its ``/v1/models`` lists (re-read on every health scrape) or that its
config names. A request goes only to the replicas that serve its body's ``model``; a name no replica
serves is answered 404 in vLLM's own shape, never sent to a replica that would refuse it. A model
alias maps a client's name to served names, weighted (a canary takes a share of an alias's traffic),
as the Gateway API Inference Extension's ``InferenceModelRewrite`` does.

A replica whose models are not known yet (no successful ``/v1/models``: a new replica, or a server
without that endpoint) may take a model no known replica serves: until the fleet says otherwise the
request is not refused. A request without ``model`` goes anywhere (vLLM serves its own model then).

The path's API narrows the same way: vLLM registers its routes by what the model does (``build_app``: the
completion routes for a generating model, ``/v1/embeddings`` and ``/pooling`` for a pooling one), so a replica
serves the paths its ``/openapi.json`` lists, or those its config names. A replica whose paths are not known
takes any path; a path no replica serves (and every replica's paths known) is answered 404.
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
    unserved_path: str | None = None  # replicas serve the model, but none of them this path (404)

    @property
    def unknown(self) -> bool:
        return self.replicas is not None and not self.replicas and self.unserved_path is None


MAX_PATHS = 2000  # an /openapi.json listing more is not believed (vLLM lists ~60)
MAX_PATH_CHARS = 256


def path_pattern(path: str) -> "str | tuple[tuple[str | None, ...], bool]":
    """A path a replica serves: exact, or (segments, prefix): a segment with OpenAPI's ``{name}`` in it (None)
    stands for any one non-empty segment, and a pattern ending in '*' is a prefix whose last segment may go on.

    Matched segment by segment, never as a regular expression: the templates come from whatever answers a
    replica's /openapi.json, and ``/{a}{b}{c}...`` as a regex backtracks for minutes on a long request path."""
    prefix = path.endswith("*")
    body = path[:-1] if prefix else path
    if "{" not in body and not prefix:
        return path
    return tuple(None if "{" in s else s for s in body.split("/")), prefix


def path_matches(pattern: "tuple[tuple[str | None, ...], bool]", path: str) -> bool:
    """``path`` against a templated or prefix pattern of ``path_pattern``: linear in the path's length."""
    segments, prefix = pattern
    got = path.split("/")
    if len(got) < len(segments) or (not prefix and len(got) != len(segments)):
        return False
    last = len(segments) - 1
    for i, s in enumerate(segments):
        if s is None:
            if not got[i]:
                return False
        elif not (got[i] == s or (prefix and i == last and got[i].startswith(s))):
            return False
    return True


class _PathTrie:
    """Templated and prefix paths by segment, so that a request's path costs a walk over its own segments whatever
    the number of templates (a replica may list 2,000: a list of them cost 0.7 ms a decision). The walk keeps the
    set of nodes the path can be at (a segment may match a literal and a ``{parameter}`` both), never backtracks."""

    __slots__ = ("literal", "param", "end", "prefixes")

    def __init__(self):
        self.literal: dict[str, _PathTrie] = {}
        self.param: _PathTrie | None = None
        self.end: set[str] = set()  # replicas whose template ends here
        self.prefixes: list[tuple[str | None, set[str]]] = []  # (start of the next segment, replicas) of 'x*' paths

    def _child(self, seg: str | None) -> "_PathTrie":
        if seg is None:
            if self.param is None:
                self.param = _PathTrie()
            return self.param
        return self.literal.setdefault(seg, _PathTrie())

    def add(self, pattern: "tuple[tuple[str | None, ...], bool]", replica: str) -> None:
        segments, prefix = pattern
        node = self
        for seg in segments[:-1] if prefix else segments:
            node = node._child(seg)
        if not prefix:
            node.end.add(replica)
            return
        last = segments[-1]
        for start, replicas in node.prefixes:
            if start == last:
                replicas.add(replica)
                return
        node.prefixes.append((last, {replica}))

    def match(self, path: str) -> frozenset[str]:
        out: set[str] = set()
        nodes = [self]
        for seg in path.split("/"):
            nxt = []
            for n in nodes:
                for start, replicas in n.prefixes:
                    if (seg if start is None else seg.startswith(start)) and not replicas <= out:
                        out |= replicas
                child = n.literal.get(seg)
                if child is not None:
                    nxt.append(child)
                if n.param is not None and seg:
                    nxt.append(n.param)
            nodes = nxt
            if not nodes:
                break
        for n in nodes:
            out |= n.end
        return frozenset(out)


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
        self._adapter_of: dict[str, tuple[str, str] | None] = {}  # adapter -> (its base model, its path), if one
        self._max_len: dict[str | None, int] = {}  # model (None: any) -> the largest max_model_len listed for it
        # replica -> the paths it serves (None: not known, any path); an index like the models' one
        self._paths: dict[str, frozenset[str] | None] = {}
        self._paths_configured: set[str] = set()
        self._path_index: "tuple[dict[str, frozenset[str]], _PathTrie, frozenset[str]] | None" = None

    def _built(self) -> dict[str, frozenset[str]]:
        if self._index is None:
            index: dict[str, set[str]] = {}
            adapters = set()
            max_len: dict[str | None, int] = {}
            loaded: dict[str, set] = {}
            for replica, models in self._served.items():
                for mid, obj in (models or {}).items():
                    index.setdefault(mid, set()).add(replica)
                    if obj.get("parent"):
                        adapters.add(mid)
                        loaded.setdefault(mid, set()).add((obj["parent"], obj.get("root")))
                    n = obj.get("max_model_len")
                    if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                        for k in (mid, None):
                            max_len[k] = max(max_len.get(k, 0), n)
            self._max_len = max_len
            self._index = {m: frozenset(rs) for m, rs in index.items()}
            self._unknown = frozenset(r for r, ms in self._served.items() if ms is None)
            self._adapters = frozenset(adapters)
            self._adapter_of = {a: next(iter(w)) if len(w) == 1 and isinstance(next(iter(w))[1], str) else None
                                for a, w in loaded.items()}
        return self._index

    def _built_paths(self):
        if self._path_index is None:
            exact: dict[str, set[str]] = {}
            trie = _PathTrie()
            for replica, paths in self._paths.items():
                for p in paths or ():
                    pattern = path_pattern(p)
                    if isinstance(pattern, str):
                        exact.setdefault(p, set()).add(replica)
                    else:
                        trie.add(pattern, replica)
            self._path_index = ({p: frozenset(rs) for p, rs in exact.items()}, trie,
                                frozenset(r for r, ps in self._paths.items() if ps is None))
        return self._path_index

    def _serving_path(self, path: str | None) -> frozenset[str] | None:
        """The replicas that serve ``path`` (None: any, as far as anyone knows)."""
        if path is None:
            return None
        exact, trie, unknown = self._built_paths()
        if len(unknown) == len(self._paths):
            return None
        out = exact.get(path, frozenset()) | unknown | trie.match(path)
        return None if len(out) == len(self._paths) else out

    # ---------------------------------------------------------------- sources

    def configure(self, replicas: Mapping[str, Collection[str] | None],
                  paths: Mapping[str, Collection[str] | None] | None = None) -> None:
        """The replica set (a reload or discovery): configured model and path lists, others learned from the
        replicas."""
        self._index = None
        self._path_index = None
        paths = paths or {}
        for name in [n for n in self._paths if n not in replicas]:
            del self._paths[name]
        was_configured, self._paths_configured = self._paths_configured, {n for n in replicas if paths.get(n)}
        for name in replicas:
            named = paths.get(name)
            if named:
                self._paths[name] = frozenset(named)
            elif name in was_configured or name not in self._paths:
                self._paths[name] = None  # to be learned
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

    def learned_paths(self, replica: str, paths: Collection[str] | None) -> bool:
        """The paths one replica's /openapi.json lists (None: it has none to read); True if they changed."""
        if replica in self._paths_configured or replica not in self._paths:
            return False
        new = frozenset(paths) if paths is not None else None
        if self._paths[replica] == new:
            return False
        self._paths[replica] = new
        self._path_index = None
        return True

    def paths_of(self, replica: str) -> list[str] | None:
        paths = self._paths.get(replica)
        return sorted(paths) if paths is not None else None

    def is_adapter(self, model: str | None) -> bool:
        """A LoRA adapter: a model a replica lists with a parent (vLLM lists its adapters so)."""
        self._built()
        return model in self._adapters

    def adapter_of(self, model: str | None) -> tuple[str, str] | None:
        """(its base model, its path) for a LoRA adapter that every replica listing it loads from one path (vLLM's
        /v1/models ``root``: the path goes into the engine's block hashes); None otherwise."""
        self._built()
        return self._adapter_of.get(model) if model is not None else None

    def adapter_paths(self, replica: str) -> dict[str, str]:
        """The adapters one replica lists, each with the path it loaded it from."""
        return {m: o["root"] for m, o in (self._served.get(replica) or {}).items()
                if o.get("parent") and isinstance(o.get("root"), str)}

    def max_model_len(self, model: str | None) -> int | None:
        """The most tokens a request for ``model`` can hold, as the replicas list it (None: any model; the answer
        None: no replica says)."""
        self._built()
        return self._max_len.get(model) or self._max_len.get(None)

    def base_models(self) -> list[str]:
        """The models served, adapters left out (what vLLM's 404 lists as its valid names)."""
        self._built()
        return sorted({m for models in self._served.values() if models for m in models if m not in self._adapters})

    def one_model(self) -> str | None:
        """The model when the fleet serves one and only one: every replica lists it alone, with no alias and no adapter
        (then a request's headers say its model: the header path). None otherwise, or while a replica's models are not
        known yet."""
        index = self._built()
        if self.aliases or self._adapters or self._unknown or len(index) != 1:
            return None
        ((model, serving),) = index.items()
        return model if len(serving) == len(self._served) else None

    def served_by(self, replica: str) -> list[str] | None:
        models = self._served.get(replica)
        return sorted(models) if models is not None else None

    # ---------------------------------------------------------------- choice

    def resolve(self, model: str | None, session_key: bytes | None = None, path: str | None = None) -> Resolution:
        name, rewritten, by_model = None, False, None
        if model is not None:
            targets = self.aliases.get(model)
            name = self._pick(targets, session_key) if targets else model
            serving = self._built().get(name)
            rewritten = bool(targets) and name != model
            # every replica serves it (or there are none): no subset
            if not (serving is not None and len(serving) == len(self._served) or not self._served):
                # no replica known to serve it: those whose models are not known yet may (never refuse blind)
                by_model = serving or self._unknown
                if not by_model:
                    return Resolution(name, by_model, rewritten)
        by_path = self._serving_path(path)
        if by_path is None:
            return Resolution(name, by_model, rewritten)
        eligible = by_path if by_model is None else by_model & by_path
        return Resolution(name, eligible, rewritten, None if eligible else path)

    def resolve_candidates(self, candidates: Collection[str], session_key: bytes | None = None,
                           path: str | None = None) -> Resolution:
        """A body whose model could not be read: it goes where any of the names it may mean is served, and where
        none is, anywhere its path is served; a model a replica serves is never answered 404."""
        eligible: set[str] = set()
        for c in candidates:
            res = self.resolve(c, session_key, path)
            if res.replicas is None:
                return Resolution(None, None)
            eligible |= res.replicas
        if eligible:
            return Resolution(None, frozenset(eligible))
        res = self.resolve(None, session_key, path)
        return Resolution(None, res.replicas or None)

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


MAX_LISTED_MODELS = 20  # a 404 names at most this many of the models served


def not_found_body(model: str, valid: Collection[str] = ()) -> dict:
    """vLLM's answer to a model it does not serve (0.32: ``OpenAIServing._check_model`` in
    ``entrypoints/serve/engine/serving.py``: NotFoundError, 404, param "model", and its served names, which for a
    fleet are the base models its replicas serve)."""
    names = list(valid)[:MAX_LISTED_MODELS]
    more = ", ..." if len(valid) > MAX_LISTED_MODELS else ""
    return {"error": {"message": f"The model `{model}` does not exist. Valid aliases: {', '.join(names)}{more}.",
                      "type": "NotFoundError", "param": "model", "code": 404}}


def path_not_served_body(path: str) -> dict:
    """No replica (of the model the body names) serves the path: the error shape vLLM's clients parse."""
    return {"error": {"message": f"No replica of this model serves {path[:MAX_PATH_CHARS]}.", "type": "NotFoundError",
                      "param": None, "code": 404}}


__all__ = ["MAX_PATHS", "MAX_PATH_CHARS", "ModelCatalog", "Resolution", "Target", "not_found_body",
           "path_matches", "path_not_served_body", "path_pattern"]
