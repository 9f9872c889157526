"""The mock's engine loop: the engine model run in workload time against the wall clock, and each request's token
events handed to its HTTP handler."""

from __future__ import annotations

import asyncio
import math
import time

from extproc.tools.engine.model import DECODE_HORIZON_S, Engine, EngineConfig, EngineRequest
from extproc.core.bounded import within

MIN_EMIT_WALL_S = 0.002  # a decode run's tokens go out at most this often (wall time); at real speed, every step


class Aborted(Exception):
    pass


class Waiter:
    """Token events of one request from the engine loop to its HTTP handler."""

    __slots__ = ("queue", "req", "first_at", "last_at")

    def __init__(self, req: EngineRequest):
        self.req = req
        self.queue: asyncio.Queue = asyncio.Queue()
        self.first_at: float | None = None  # engine time of the first token (a preempted request keeps its first)
        self.last_at: float | None = None  # engine time of its last tokens (inter-token latency)


class Driver:
    """Runs the engine in workload time, with the simulator's stepping, against the wall clock.

    The engine's clock is workload time: a step starts where the previous one
    ended (or at the arrival that woke an idle engine), and a client is
    answered when the wall clock reaches that step's end divided by
    ``speedup``. A late event loop therefore delays the answer but never the
    engine, so the simulator and the mock compute the same schedule, and the
    mock's own lateness (asyncio, HTTP, a busy machine) is measured per
    request as ``lag`` instead of silently inflating every later step.
    Pure-decode steps are run ``horizon_s`` at a time, as the simulator does
    (an arrival cuts the run at the next step boundary), so a 20x-compressed
    14 ms step is not a 0.7 ms timer the event loop cannot keep.
    """

    def __init__(self, cfg: EngineConfig, speedup: float, horizon_s: float = DECODE_HORIZON_S, index: int = 0):
        self.engine = Engine(cfg)
        self.index = index  # its data-parallel rank
        self.speedup = speedup
        self.horizon_s = horizon_s
        self.w0 = time.monotonic()
        self.clock = 0.0  # workload time where the next step starts
        self.waiters: dict[int, Waiter] = {}
        self.prefilled: set[int] = set()
        # the moments an engine's metrics move (tools/engine/metrics.py, Exporter): first token, tokens streamed,
        # finish, step
        self.on_first = lambda k, er: None
        self.on_chunk = lambda k, n, interval_s: None  # n tokens of one request, interval_s wall after its last
        self.on_done = lambda k, er: None
        self.on_step = lambda k: None
        self.on_lag = lambda lag_s: None  # wall seconds a first token reached its client after its due time
        self._wake = asyncio.Event()
        self._end: float | None = None  # workload time the step (or decode run) in progress ends
        self._next_rid = 0
        self.task: asyncio.Task | None = None

    def now(self) -> float:
        return (time.monotonic() - self.w0) * self.speedup

    def wall(self, t: float) -> float:
        return self.w0 + t / self.speedup

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    def _emit(self, w: Waiter, n: int, first: bool, at: float) -> None:
        if not first and w.last_at is not None:
            self.on_chunk(self.index, n, (at - w.last_at) / self.speedup)
        elif first and n > 1:
            self.on_chunk(self.index, n - 1, 0.0)
        w.last_at = at
        w.queue.put_nowait((n, first))

    def submit(self, blocks: list[int], prompt_tokens: int, max_tokens: int, lora: str | None = None,
               external: int = 0, keep: bool = False) -> Waiter:
        self._next_rid += 1
        er = EngineRequest(self._next_rid, blocks, prompt_tokens, max_tokens, self.now(), lora=lora,
                           external=external, keep=keep)
        w = Waiter(er)
        self.waiters[er.rid] = w
        self.engine.add(er)
        if self._end is None:
            self._wake.set()
        else:
            cut = self.engine.cut_run(er.arrival)  # vLLM admits it at the next step boundary
            if cut is not None:
                self._end = cut
                self._wake.set()
        return w

    def abort(self, w: Waiter) -> None:
        self.waiters.pop(w.req.rid, None)
        self.prefilled.discard(w.req.rid)
        self.engine.abort(w.req)

    def abort_all(self) -> None:
        self.engine.abort_all()
        self.prefilled.clear()
        for w in self.waiters.values():
            w.queue.put_nowait(Aborted())
        self.waiters.clear()

    async def _sleep_until(self, t: float) -> None:
        """Until the wall clock reaches engine time ``t``, or the step in progress ends earlier (an arrival cut it)."""
        while (delay := self.wall(min(t, self._end)) - time.monotonic()) > 0:
            self._wake.clear()
            try:  # within, not wait_for: a cancel that lands as an arrival wakes it must stop the engine
                await within(self._wake.wait(), delay)
            except TimeoutError:
                pass

    async def _run(self) -> None:
        e = self.engine
        while True:
            if not e.busy:
                self._wake.clear()
                await self._wake.wait()
                continue
            if e.waiting and not e.running:  # idle until now: the step starts at the arrival
                self.clock = max(self.clock, e.waiting[0].arrival)
            before = {r.rid: r.generated for r in e.running}
            dur, first, done = e.step(self.clock, self.horizon_s)
            if dur <= 0:
                await asyncio.sleep(0.001)
                continue
            self._end = self.clock + dur
            emitted = dict(before)
            run = e._run  # a run of pure-decode steps: each of its requests gets one token per step
            if run is not None:
                start, step_s, _, decoding = run
                # stream as vLLM does, a token per step, but not more often than the event loop can keep at high
                # compression (the schedule is the engine's either way; only the chunking changes)
                every = max(1, math.ceil(MIN_EMIT_WALL_S * self.speedup / step_s))
                k = every
                while start + k * step_s < self._end - 1e-12:
                    await self._sleep_until(start + k * step_s)
                    if start + k * step_s >= self._end - 1e-12:  # an arrival cut the run before this boundary
                        break
                    for r in decoding:
                        w = self.waiters.get(r.rid)
                        upto = min(r.generated, before.get(r.rid, 0) + k)
                        if w is not None and upto > emitted.get(r.rid, 0):
                            self._emit(w, upto - emitted.get(r.rid, 0), False, start + k * step_s)
                            emitted[r.rid] = upto
                    k += every
            await self._sleep_until(self._end)
            self.clock, self._end = self._end, None
            late = time.monotonic() - self.wall(self.clock)
            self.on_step(self.index)
            for r in first:
                if r.rid not in self.prefilled:  # once per request, as vLLM counts it (not again after preemption)
                    self.prefilled.add(r.rid)
                    self.on_first(self.index, r)
                    self.on_lag(late)
            firsts = {r.rid for r in first}
            for r in [*e.running, *done]:
                w = self.waiters.get(r.rid)
                new = r.generated - emitted.get(r.rid, 0)
                if w is not None and new > 0:
                    if w.first_at is None:
                        w.first_at = self.clock
                    self._emit(w, new, r.rid in firsts, self.clock)
            for r in done:
                self.prefilled.discard(r.rid)
                self.on_done(self.index, r)
                w = self.waiters.pop(r.rid, None)
                if w is not None:
                    w.queue.put_nowait(None)
