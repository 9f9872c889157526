"""The seed's users as a workload: coding-agent sessions over several projects.

Each project has a shared system prompt of several thousand tokens; a
session is tens to hundreds of turns whose context grows by the user's
message (tool output, file contents) and the previous answer; a share of
sessions works on long contexts reaching 128-256K tokens; one-shot
requests arrive on the side. Sessions arrive as a Poisson process and are
closed-loop: the next turn starts after the previous answer plus a think
time. Everything is drawn from one seeded RNG, so a seed is a workload.

A prompt is described by its token count and its 16-token block hashes:
blocks inside the project's system prompt are shared by every session of
the project; later blocks belong to the session. That is what an engine's
prefix cache sees. ``text_for`` renders the same prompt as real text for
driving servers over HTTP (the live benchmark).
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass, field, replace

from extproc.core.blocks import BLOCK_TOKENS as BLOCK

MOCK_MODEL = "mock-coder-30b"  # what the workload asks for and the mock serves by default (one name for all)


def hash_of(name: str) -> int:
    return zlib.crc32(name.encode())


_SYS = 1 << 60
_SESS = 2 << 60


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    minutes: float = 30.0
    projects: int = 6
    project_weights_zipf: float = 1.0  # a few projects are busier than the rest
    system_tokens: tuple[int, int] = (3_000, 8_000)
    sessions_per_min: float = 2.0
    turns_median: float = 40.0
    turns_max: int = 300
    user_tokens_median: float = 600.0  # tool output, diffs, user messages
    output_tokens_median: float = 250.0
    output_tokens_max: int = 2_000
    think_s_mean: float = 4.0
    long_share: float = 0.10  # sessions that load big files: start at 60-120K tokens of context
    long_start_tokens: tuple[int, int] = (60_000, 120_000)
    long_user_tokens_median: float = 6_000.0
    max_context: int = 256_000
    oneshots_per_min: float = 6.0
    # flow control's noisy tenant: one more tenant whose sessions arrive at this many times an average project's
    # rate (0: none). Its draws come from a stream of their own: the other tenants' workload is the same with it
    noisy_tenant_x: float = 0.0
    # a burst: (start minute, minutes, factor), every arrival rate times ``factor`` over that window. The extra
    # arrivals draw from a stream of their own, so the rest of the workload is the same with it or without
    burst: tuple[float, float, float] | None = None
    # what estimating costs (issue 45): the engine's tokens per token a router estimates from text, drawn per text
    # (a project's system prompt, a session's own turns, a one-shot's message) uniformly from this range; the
    # engine counts ``prompt_tokens`` as always. None: the estimate is the engine's count. On the tiny model's
    # real tokenizer: 1.2-1.9 (words, code-like lines, hex digests)
    token_scale: tuple[float, float] | None = None

    def at_load(self, load: float) -> "WorkloadConfig":
        """The load ladder (``--load L``): every arrival rate scaled by ``load``."""
        return replace(self, sessions_per_min=self.sessions_per_min * load,
                       oneshots_per_min=self.oneshots_per_min * load)


@dataclass(slots=True)
class Session:
    sid: int
    project: int
    turns: int
    long: bool
    context: int  # tokens after the system prompt so far (history)
    rng: random.Random  # its own draws, so the stream does not depend on the order answers come back
    turn: int = 0


@dataclass(slots=True)
class Request:
    """One request of the workload; the simulator fills the outcome fields."""

    rid: int
    sid: int  # session id; one-shots get a fresh one
    project: int
    prompt_tokens: int
    system_tokens: int
    max_tokens: int
    arrival: float
    oneshot: bool = False
    session: Session | None = None
    # outcome
    replica: int | None = None
    ttft: float | None = None
    e2e: float | None = None
    cached_tokens: int = 0
    error: str | None = None
    retries: int = 0
    extra: dict = field(default_factory=dict)
    # a fleet of several models (Simulation's ``pools``): the base model's pool it goes to, and its LoRA adapter
    pool: str | None = None
    adapter: str | None = None
    # flow control's priority class (0 critical, 1 standard, 2 sheddable) and tenant; read by warmroute_flow alone
    klass: int = 1
    tenant: str | None = None
    # the engine's tokens per estimated token of its system prompt and of the rest (WorkloadConfig.token_scale)
    sys_scale: float = 1.0
    text_scale: float = 1.0
    _blocks: list | None = None
    _estimate: tuple | None = None

    def blocks(self) -> list[int]:
        """The prompt's 16-token block ids (the last, partial block included); computed once."""
        if self._blocks is None:
            self._blocks = self._make_blocks()
        return self._blocks

    def _make_blocks(self) -> list[int]:
        n = -(-self.prompt_tokens // BLOCK)
        sys_full = self.system_tokens // BLOCK
        out = [_SYS | (self.project << 24) | k for k in range(min(n, sys_full))]
        out += [_SESS | (self.sid << 24) | k for k in range(sys_full, n)]
        if self.adapter is not None:  # vLLM puts the adapter in its block hashes: an adapter's prefix is its own
            salt = (hash_of(self.adapter) & 0xFFFF) << 44
            out = [b ^ salt for b in out]
        return out


    def estimated(self) -> tuple[int, list[int]]:
        """(tokens, full 16-token block ids) as a router that estimates from the text counts them: its blocks
        are of estimated tokens, so they cover different stretches of the prompt than the engine's, and how many
        engine tokens they stand for is a scale the router must learn. The engine's blocks when nothing is
        modelled."""
        if self._estimate is None:
            if self.sys_scale == self.text_scale == 1.0:
                self._estimate = (self.prompt_tokens, self.blocks()[:self.prompt_tokens // BLOCK])
            else:
                est_sys = self.system_tokens / self.sys_scale
                est = round(est_sys + (self.prompt_tokens - self.system_tokens) / self.text_scale)
                sys_full = int(est_sys) // BLOCK
                n = est // BLOCK
                out = [_SYS | (self.project << 24) | k for k in range(min(n, sys_full))]
                out += [_SESS | (self.sid << 24) | k for k in range(sys_full, n)]
                if self.adapter is not None:
                    salt = (hash_of(self.adapter) & 0xFFFF) << 44
                    out = [b ^ salt for b in out]
                self._estimate = (max(1, est), out)
        return self._estimate


def text_scale(seed: int, kind: str, ident: int, span: tuple[float, float]) -> float:
    """One text's engine tokens per estimated token: a draw of its own, so the workload's streams stay as they are."""
    return random.Random(f"{seed}:{kind}:{ident}").uniform(*span)


class Workload:
    def __init__(self, cfg: WorkloadConfig, seed: int):
        self.cfg = cfg
        self.seed = seed
        self.rng = random.Random(seed)
        w = [1 / (i + 1) ** cfg.project_weights_zipf for i in range(cfg.projects)]
        total = sum(w)
        self.project_weights = [x / total for x in w]
        self.system_tokens = [self.rng.randint(*cfg.system_tokens) for _ in range(cfg.projects)]
        self._next_rid = 0
        self._next_sid = 0
        self.noisy_rng = random.Random(seed * 7919 + 17)
        self._next_noisy_sid = 10_000_000  # ids of its own: the others' sessions keep theirs
        if cfg.noisy_tenant_x > 0:
            self.system_tokens.append(self.noisy_rng.randint(*cfg.system_tokens))  # project index cfg.projects
        self.burst_rng = random.Random(seed * 7927 + 29)
        self._next_burst_sid = 20_000_000

    def _lognormal(self, median: float, sigma: float = 0.8, rng: random.Random | None = None) -> float:
        return median * math.exp((rng or self.rng).gauss(0.0, sigma))

    def _rid(self) -> int:
        self._next_rid += 1
        return self._next_rid

    def _sid(self) -> int:
        self._next_sid += 1
        return self._next_sid

    def arrivals(self) -> list[tuple[float, str]]:
        """Start times of sessions and one-shots over the run: [(t, kind)], kind one of ``KINDS``; ``start``
        makes each."""
        c, out, end = self.cfg, [], self.cfg.minutes * 60
        out += self._poisson(self.rng, c.sessions_per_min, 0.0, end, "session")
        out += self._poisson(self.rng, c.oneshots_per_min, 0.0, end, "oneshot")
        if c.noisy_tenant_x > 0:
            out += self._poisson(self.noisy_rng, c.noisy_tenant_x * c.sessions_per_min / c.projects, 0.0, end,
                                 "noisy_session")
        if c.burst is not None:
            start_min, minutes, factor = c.burst
            lo, hi = start_min * 60, min(end, (start_min + minutes) * 60)
            out += self._poisson(self.burst_rng, (factor - 1) * c.sessions_per_min, lo, hi, "burst_session")
            out += self._poisson(self.burst_rng, (factor - 1) * c.oneshots_per_min, lo, hi, "burst_oneshot")
        out.sort()
        return out

    @staticmethod
    def _poisson(rng: random.Random, per_min: float, lo: float, hi: float, kind: str) -> list[tuple[float, str]]:
        out, t = [], lo
        while per_min > 0:
            t += rng.expovariate(per_min / 60)
            if t >= hi:
                break
            out.append((t, kind))
        return out

    def start(self, kind: str, t: float) -> "Session | Request":
        """What an arrival of ``arrivals`` starts at ``t``: a session (its turns come from ``next_turn``) or a
        one-shot request."""
        if kind == "session":
            return self.new_session()
        if kind == "noisy_session":
            return self.new_noisy_session()
        if kind == "burst_session":
            return self._session_of(self.burst_rng, self._burst_sid(), self._project(self.burst_rng))
        if kind == "burst_oneshot":
            return self._oneshot_of(self.burst_rng, self._burst_sid(), self._project(self.burst_rng), t)
        return self.oneshot(t)

    def _burst_sid(self) -> int:
        self._next_burst_sid += 1
        return self._next_burst_sid

    def _project(self, rng: random.Random) -> int:
        return rng.choices(range(self.cfg.projects), self.project_weights)[0]

    def new_noisy_session(self) -> Session:
        """A session of the noisy tenant (project index ``cfg.projects``, tenant ``noisy``)."""
        self._next_noisy_sid += 1
        return self._session_of(self.noisy_rng, self._next_noisy_sid, self.cfg.projects)

    def new_session(self) -> Session:
        c = self.cfg
        long = self.rng.random() < c.long_share
        turns = max(2, min(c.turns_max, int(self._lognormal(c.turns_median, 0.7))))
        start = self.rng.randint(*c.long_start_tokens) if long else 0
        project = self._project(self.rng)
        return Session(self._sid(), project, turns, long, start, random.Random(self.rng.random()))

    def _session_of(self, rng: random.Random, sid: int, project: int) -> Session:
        """A session drawn from a stream of its own (the noisy tenant's, the burst's)."""
        c = self.cfg
        long = rng.random() < c.long_share
        turns = max(2, min(c.turns_max, int(self._lognormal(c.turns_median, 0.7, rng))))
        start = rng.randint(*c.long_start_tokens) if long else 0
        return Session(sid, project, turns, long, start, random.Random(rng.random()))

    def next_turn(self, s: Session, now: float) -> Request | None:
        """The session's next request, or None when it is over (turns done or context full)."""
        c = self.cfg
        if s.turn >= s.turns:
            return None
        user = self._lognormal(c.long_user_tokens_median if s.long else c.user_tokens_median, rng=s.rng)
        s.context += int(user)
        sys_t = self.system_tokens[s.project]
        if sys_t + s.context >= c.max_context:
            return None
        s.turn += 1
        out = max(16, min(c.output_tokens_max, int(self._lognormal(c.output_tokens_median, 0.6, s.rng))))
        # flow control's classes: a session's turns standard, 5% of sessions critical (by id, not by a draw: the
        # workload's random stream stays what it was), one-shots sheddable; each project a tenant
        klass = 0 if (s.sid * 2654435761) % 100 < 5 else 1
        return self._scaled(Request(self._rid(), s.sid, s.project, sys_t + s.context, sys_t, out, now, session=s,
                                    klass=klass, tenant="noisy" if s.project == c.projects else f"p{s.project}"))

    def _scaled(self, r: Request) -> Request:
        span = self.cfg.token_scale
        if span is not None:
            r.sys_scale = text_scale(self.seed, "project", r.project, span)
            r.text_scale = text_scale(self.seed, "session", r.sid, span)
        return r

    def after_answer(self, s: Session, req: Request) -> float:
        """The answer joins the context; returns the think time before the next turn."""
        s.context += req.max_tokens
        return s.rng.expovariate(1 / self.cfg.think_s_mean)

    def oneshot(self, now: float) -> Request:
        return self._oneshot_of(self.rng, self._sid(), self._project(self.rng), now)

    def _oneshot_of(self, rng: random.Random, sid: int, project: int, now: float) -> Request:
        c = self.cfg
        sys_t = self.system_tokens[project]
        user = int(self._lognormal(c.user_tokens_median, rng=rng))
        out = max(16, min(c.output_tokens_max, int(self._lognormal(c.output_tokens_median, 0.6, rng))))
        return self._scaled(Request(self._rid(), sid, project, sys_t + user, sys_t, out, now, oneshot=True, klass=2,
                                    tenant=f"p{project}"))


def text_for(req: Request, system_texts: list[str]) -> tuple[str, str]:
    """(system prompt, user content) as real text of about the right token counts (4 chars a token).

    The system text is the project's, so it shares a prefix across sessions as in the model.
    """
    user_chars = max(4, (req.prompt_tokens - req.system_tokens) * 4)
    seed = f"s{req.sid}-" if not req.oneshot else f"o{req.rid}-"
    body = (seed + "context line of code and tool output. ") * (user_chars // 40 + 1)
    return system_texts[req.project], body[:user_chars]
