"""The brain's side of exact mode: the engines' event readers, the models' tokenizers, and each
request's prompt hashed as the engine will hash it. Exactness is a state per engine, like health: an engine whose
events verify is priced by what it holds; every other engine, and every request this cannot tokenize, by the
estimate as before."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
from array import array
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor

import orjson

from ..config import AppConfig
from ..core.apis import Api
from ..core.engine_cache import EngineCache, mode_of, none_hash
from . import logs
from .engine_tokens import ChatTokens, Later, TokenizerError, encode_in_worker, render_in_worker
from .kv_events import KvEvents
from .scraper import ScrapeListener

log = logging.getLogger("warmroute.exact")
RENDERED = (Api.CHAT, Api.MESSAGES, Api.RESPONSES)  # as vLLM renders them (engine_render)
MAX_JOBS = 4  # long prompts waiting for the worker at once


class Exact(ScrapeListener):
    def __init__(self, cfg: AppConfig, router, scraper, clock, stats, models):
        self.router, self.scraper, self.clock, self.stats, self.models = router, scraper, clock, stats, models
        self.kv = KvEvents(self._on_batch, self._on_lost, clock)
        scraper.listeners.append(self)  # the publishers each replica lists follow (on_kv_sources)
        self.tokenizers: dict[str, ChatTokens] = {}
        self._sources: dict[str, tuple[str, str | None]] = {}  # model -> (its directory, its template file)
        self.block_size: int | None = None  # of the engines that verified (vLLM: one per fleet in practice)
        self.tokenized = self.untokenized = self.deferred = self.learned = self.worker_failed = 0
        self.configured: set[str] = set()  # replicas whose publishers the config names
        self._pool: ProcessPoolExecutor | None = None  # started at the first prompt too long for the request path
        self._pending: set[bytes] = set()
        self._done: deque = deque()
        self.configure(cfg)

    def on_kv_sources(self, name: str, url: str, listed: "dict | None") -> None:
        self.kv.on_sources(name, url, listed)

    def configure(self, cfg: AppConfig) -> None:
        c = self.cfg = cfg.exact_cache
        self.root = none_hash(c.hash_seed)
        # engines whose publishers the operator named are followed there; the others' are asked for at
        # /kv_event_sources (vLLM 0.32) after each start
        configured = {r.name: dict(enumerate(r.kv_events)) for r in cfg.replicas if r.kv_events} if c.enabled else {}
        self.configured = set(configured)
        self.scraper.kv_wanted = {r.name for r in cfg.replicas if r.engine in ("vllm", "auto")
                                  and r.name not in configured} if c.enabled else set()
        for name in list(self.kv.sources):
            if name not in self.scraper.kv_wanted and name not in configured:
                self.kv.forget(name)
        for name, wanted in configured.items():
            self.kv.follow(name, wanted)
        self.scraper.kv_due = (self.scraper.kv_due | self.scraper.kv_wanted) & self.scraper.kv_wanted
        templates = dict(c.chat_templates)
        sources = {m: (path, templates.get(m)) for m, path in c.tokenizers} if c.enabled else {}
        for model in [m for m in self.tokenizers if sources.get(m) != self._sources.get(m)]:
            del self.tokenizers[model]
        for model, (path, template) in sources.items():
            if model not in self.tokenizers:
                self._sources[model] = (path, template)
                try:
                    self.tokenizers[model] = ChatTokens(path, chat_template=template)
                except (TokenizerError, OSError, ValueError) as e:  # that model is estimated; the brain says why
                    logs.event("tokenizer_error", model=model, error=f"{type(e).__name__}: {e}"[:200])

    def _make(self) -> EngineCache:
        return EngineCache(self.cfg.hash_seed, self.cfg.hash_algo)

    def _on_batch(self, name: str, rank: int, events: list, now: float) -> None:
        st = self.router.policy.engine_state(name, rank)
        paths = self.models.adapter_paths(name)  # the adapters' blocks verify with the paths this replica lists
        if not self.router.policy.apply_events(name, rank, events, now,
                                  lambda: EngineCache(self.cfg.hash_seed, self.cfg.hash_algo, paths)):
            return
        st = st or self.router.policy.engine_state(name, rank)
        if st is not None and st.exact is not None:
            st.exact.lora_paths = paths
        if st is not None and st.exact is not None and st.exact.exact:
            self.block_size = st.exact.block_size

    def _on_lost(self, name: str, rank: int, why: str) -> None:
        self.router.policy.events_lost(name, rank, why)
        logs.event("kv_events_lost", replica=name, rank=rank, reason=why[:120])

    def forget(self, name: str) -> None:
        self.kv.forget(name)

    def price(self, profile, body: bytes | None, model: str | None):
        """``profile`` with the engine's tokens and block hashes when this can make them, else as it came."""
        lora = None
        if profile.adapter is not None:  # its base model's tokens; its name and path in every block's hash
            of = self.models.adapter_of(profile.adapter)
            if of is None:
                return profile
            model, lora = of[0], ("lora", profile.adapter, of[1])
        ct = self.tokenizers.get(model) if model is not None else None
        if ct is None or not body or profile.api not in RENDERED or len(body) > self.cfg.max_body_bytes:
            return profile
        self._learn_done()
        bs = self.block_size  # known once an engine verified: before, the tokens alone (every replica estimated)
        key = profile.session_key
        if key is not None and len(body) > self.cfg.inline_chars and not ct.extends(key):
            # a session's first turn here, longer than the request path tokenizes: not even read or rendered here (a
            # 40 KB conversation's parse and template cost ~1 ms on top of the estimate's 0.2): a worker does it all
            self.deferred += 1
            self._tokenize_later(ct, key, Later(None, (body, profile.api)), model)
            return profile
        try:
            doc = profile.doc if profile.doc is not None else orjson.loads(body)  # parsed once, by the profile
            salt = doc.get("cache_salt") if isinstance(doc, dict) and isinstance(doc.get("cache_salt"), str) else None
            got = ct.prompt(doc, key, profile.api, (bs, self.root, salt, lora) if bs else None,
                            self.cfg.inline_chars) if isinstance(doc, dict) else None
        except orjson.JSONDecodeError:
            got = None
        if isinstance(got, Later):
            self.deferred += 1
            self._tokenize_later(ct, key, got, model)
            return profile
        if not got or not got[0]:
            self.untokenized += 1
            return profile
        self.tokenized += 1
        tokens, hashes = got
        return dataclasses.replace(profile, engine_tokens=len(tokens),
                                   engine_hashes=(bs, hashes) if hashes is not None else None)

    def _tokenize_later(self, ct: ChatTokens, key: bytes | None, later: Later, model: str | None) -> None:
        """A session's long prompt tokenized in a worker process, off the event loop (the tokenizer holds the GIL:
        a thread would stall every decision as long); when it is done, the session's next turns extend it. One
        job per session at a time, ``MAX_JOBS`` in all: beyond, the session stays estimated until one ends."""
        if key is None or key in self._pending or len(self._pending) >= MAX_JOBS:
            return
        if self._pool is None:
            # spawned, not forked: a fork of a process with gRPC's threads is not safe
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        fut: Future
        try:
            if later.text is not None:
                fut = self._pool.submit(encode_in_worker, ct.tokenizer_json, later.text)
            else:  # rendered there too
                assert model is not None and later.request is not None  # a body to render, of a known model
                path, template = self._sources[model]
                fut = self._pool.submit(render_in_worker, path, template, *later.request)
        except RuntimeError:  # the pool broke (its process died) or is shut down: a fresh one next time
            self._pool = None
            return
        self._pending.add(key)
        # deque: safe from the pool's thread
        fut.add_done_callback(lambda f: self._done.append((ct, key, later.text, f)))

    def _learn_done(self) -> None:
        while self._done:
            ct, key, text, f = self._done.popleft()
            self._pending.discard(key)
            if f.cancelled() or f.exception() is not None:
                self.worker_failed += 1
                continue
            got = f.result()
            if text is None:  # rendered there too: (its text, its ids), or None when it could not be
                if got is None:
                    continue
                text, got = got
            toks = array("I")
            toks.frombytes(got)
            ct.learn(key, text, toks)
            self.learned += 1

    def view(self) -> dict:
        """The brain's side of exact mode, for /state: prompts tokenized as the engine does, and how."""
        return {"tokenizers": sorted(self.tokenizers), "tokenized": self.tokenized, "untokenized": self.untokenized,
                "tokenized_by_worker": self.learned, "waiting_for_worker": len(self._pending),
                "deferred_to_worker": self.deferred, "worker_failures": self.worker_failed,
                "sessions_kept": sum(t.sessions_kept for t in self.tokenizers.values())}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def observe(self, profile, d) -> None:
        """A placed decision on an exact replica: what it held of the prompt against the most any exact one held."""
        if profile.engine_hashes is None or d.replica is None:
            return
        pol = self.router.policy
        got = pol.cached_on(d.replica.name, profile.engine_hashes)
        if got is None:
            return
        if d.restored_tokens and d.restored_from is not None:
            self.stats.exact_restored[(d.replica.name, d.restored_from)] += d.restored_tokens
        # only an engine that holds the first block the chosen one lacks can have held more: one look at each,
        # a walk only there (walking every replica's run cost replicas x blocks on every request)
        bs, hashes = profile.engine_hashes
        best = got
        if bs and got // bs < len(hashes):
            beyond = hashes[got // bs]
            for r in self.router.replicas:
                if r is not d.replica and pol.holds_block(r.name, bs, beyond):
                    best = max(best, pol.cached_on(r.name, profile.engine_hashes) or 0)
        self.stats.exact_achieved[d.replica.name] += got
        self.stats.exact_reachable[d.replica.name] += best

    def replica_view(self, name: str) -> dict:
        engines = self.router.policy.exact_view(name)
        mode, why = mode_of(engines)
        # where the brain found the engines' publishers: the config's replicas[].kv_events (or discovery's ports), or
        # the replica's own GET /kv_event_sources
        events = "configured" if name in self.configured else "listed" if self.kv.sources.get(name) else None
        resident: dict[str, int] = {}
        for e in engines or ():
            for m, n in e["resident_by_medium"].items():
                resident[m] = resident.get(m, 0) + n
        return {"mode": mode, "reason": why, "engines": engines, "events_from": events,
                "resident_by_medium": resident,
                "cached_tokens": {"achieved": self.stats.exact_achieved[name],
                                  "reachable": self.stats.exact_reachable[name]},
                "restored_tokens": {m: n for (r, m), n in sorted(self.stats.exact_restored.items()) if r == name}}
