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

from .engine import BLOCK

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

    def at_load(self, load: float) -> "WorkloadConfig":
        """The load ladder (``--load L``): every arrival rate scaled by ``load``."""
        return replace(self, sessions_per_min=self.sessions_per_min * load, oneshots_per_min=self.oneshots_per_min * load)


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
    _blocks: list | None = None

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


class Workload:
    def __init__(self, cfg: WorkloadConfig, seed: int):
        self.cfg = cfg
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

    def _lognormal(self, median: float, sigma: float = 0.8, rng: random.Random | None = None) -> float:
        return median * math.exp((rng or self.rng).gauss(0.0, sigma))

    def _rid(self) -> int:
        self._next_rid += 1
        return self._next_rid

    def _sid(self) -> int:
        self._next_sid += 1
        return self._next_sid

    def arrivals(self) -> list[tuple[float, str]]:
        """Start times of sessions and one-shots over the run: [(t, "session" | "oneshot")]."""
        out = []
        end = self.cfg.minutes * 60
        for kind, per_min in (("session", self.cfg.sessions_per_min), ("oneshot", self.cfg.oneshots_per_min)):
            t = 0.0
            while per_min > 0:
                t += self.rng.expovariate(per_min / 60)
                if t >= end:
                    break
                out.append((t, kind))
        if self.cfg.noisy_tenant_x > 0:
            t, per_min = 0.0, self.cfg.noisy_tenant_x * self.cfg.sessions_per_min / self.cfg.projects
            while per_min > 0:
                t += self.noisy_rng.expovariate(per_min / 60)
                if t >= end:
                    break
                out.append((t, "noisy_session"))
        out.sort()
        return out

    def new_noisy_session(self) -> Session:
        """A session of the noisy tenant (project index ``cfg.projects``, tenant ``noisy``)."""
        c, rng = self.cfg, self.noisy_rng
        long = rng.random() < c.long_share
        turns = max(2, min(c.turns_max, int(self._lognormal(c.turns_median, 0.7, rng))))
        start = rng.randint(*c.long_start_tokens) if long else 0
        self._next_noisy_sid += 1
        return Session(self._next_noisy_sid, c.projects, turns, long, start, random.Random(rng.random()))

    def new_session(self) -> Session:
        c = self.cfg
        long = self.rng.random() < c.long_share
        turns = max(2, min(c.turns_max, int(self._lognormal(c.turns_median, 0.7))))
        start = self.rng.randint(*c.long_start_tokens) if long else 0
        project = self.rng.choices(range(c.projects), self.project_weights)[0]
        return Session(self._sid(), project, turns, long, start, random.Random(self.rng.random()))

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
        return Request(self._rid(), s.sid, s.project, sys_t + s.context, sys_t, out, now, session=s, klass=klass,
                       tenant="noisy" if s.project == c.projects else f"p{s.project}")

    def after_answer(self, s: Session, req: Request) -> float:
        """The answer joins the context; returns the think time before the next turn."""
        s.context += req.max_tokens
        return s.rng.expovariate(1 / self.cfg.think_s_mean)

    def oneshot(self, now: float) -> Request:
        c = self.cfg
        project = self.rng.choices(range(c.projects), self.project_weights)[0]
        sys_t = self.system_tokens[project]
        user = int(self._lognormal(c.user_tokens_median))
        out = max(16, min(c.output_tokens_max, int(self._lognormal(c.output_tokens_median, 0.6))))
        return Request(self._rid(), self._sid(), project, sys_t + user, sys_t, out, now, oneshot=True, klass=2,
                       tenant=f"p{project}")


def text_for(req: Request, system_texts: list[str]) -> tuple[str, str]:
    """(system prompt, user content) as real text of about the right token counts (4 chars a token).

    The system text is the project's, so it shares a prefix across sessions as in the model.
    """
    user_chars = max(4, (req.prompt_tokens - req.system_tokens) * 4)
    seed = f"s{req.sid}-" if not req.oneshot else f"o{req.rid}-"
    body = (seed + "context line of code and tool output. ") * (user_chars // 40 + 1)
    return system_texts[req.project], body[:user_chars]
