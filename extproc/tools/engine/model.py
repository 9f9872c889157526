"""A model of one vLLM replica's engine: continuous batching over a paged KV cache.

One implementation, two clocks: the simulator calls ``step`` in virtual
time, the mock server in real time. Nothing here reads a clock.

What it models, after vLLM v1's scheduler:
- KV capacity in tokens, in blocks of 16; a sequence holds
  ceil(context / 16) blocks.
- Automatic prefix caching: a prompt is a chain of block hashes; full
  blocks whose hash is cached are not recomputed. Unreferenced cached
  blocks stay until evicted, least recently used first.
- A waiting queue (FCFS) when ``max_num_seqs`` or KV space runs out;
  preemption by recompute (the newest running sequence is sent back to the
  front of the queue) when a decode step cannot get a block.
- Chunked prefill: each step has a token budget shared by decodes (1 token
  each) and prefill chunks.
- Step time = base + per-sequence cost + cost of the prefill tokens
  computed (the uncached part only) + cost of KV read by the decodes.
- Optionally a CPU tier under the GPU cache (vLLM's OffloadingConnector,
  LMCache): a cached block evicted from the GPU goes down to it (least
  recently used out when full); a prompt's run of blocks past its GPU hit
  that the tier holds is restored at ``restore_s_per_token`` instead of
  computed. The load is charged to the step that admits the request, as a
  prefill chunk would be (vLLM loads on a stream of its own while the
  request waits: the request's time is the same, the others' a little
  longer here).

Defaults are calibrated to the seed's replica: a ~30B coding model
(MoE, ~3B active) on 2x RTX 3090 with TP=2, ~300K tokens of KV. See
``EngineConfig`` for each number and where it comes from.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from itertools import islice
from dataclasses import dataclass, field, replace
from typing import Sequence

from extproc.core.blocks import BLOCK_TOKENS as BLOCK

# Pure-decode steps are batched up to this much engine time (a request arriving meanwhile cuts the run at
# the next step boundary, where vLLM would admit it): the simulator's and the mock's stepping alike. Keeps 30
# minutes of 4 replicas well under a minute of simulation, and a compressed mock off sub-millisecond timers.
DECODE_HORIZON_S = 0.2


@dataclass(frozen=True, slots=True)
class EngineConfig:
    # 2x24 GB minus ~17 GB of FP8 weights and activations leaves ~28 GB; at ~96 KB per token
    # (48 layers, 4 KV heads x 128 dims, fp16, K+V) that is ~300K tokens (the seed's figure).
    kv_tokens: int = 300_000
    max_num_seqs: int = 64  # vLLM's default is 256; 2x3090 deployments run 32-64 for long contexts
    max_num_batched_tokens: int = 8192  # vLLM v1's default chunked-prefill budget
    # Decode: ~70 tok/s for one stream on 2x3090 TP=2 with a 3B-active MoE (community llama-bench /
    # vLLM reports 60-110 tok/s); the step grows with batch size and with the KV read.
    step_base_s: float = 0.014
    step_per_seq_s: float = 0.0002
    kv_read_s_per_ktoken: float = 0.00004  # 1M tokens of context in a decode batch adds 40 ms per step
    # Prefill: ~6,000 tok/s on 2x3090 for this model class (vLLM benchmark_serving reports 4-9K).
    prefill_s_per_token: float = 1 / 6000
    # vLLM's --no-enable-prefix-caching: every prompt is computed whole, no block outlives its sequence
    prefix_caching: bool = True
    # LoRA (vLLM --enable-lora --max-loras N): N adapter slots on the GPU; the requests of one step use at most N
    # adapters (vLLM's scheduler skips a waiting request whose adapter would be one too many), and a step that
    # brings an adapter into a slot pays lora_load_s for it (0 slots: LoRA off)
    max_loras: int = 0
    lora_load_s: float = 0.0
    # an offloaded tier under the GPU cache (0: none): blocks evicted from the GPU are kept here, least recently used
    # out first, and a prompt's run of them past its GPU hit is restored at restore_s_per_token. KV at ~96 KB a token
    # (the default engine) over PCIe 4.0 x16 at ~6 GB/s effective for paged blocks: ~16 us a token, a tenth of
    # computing it; llm-d's measured pull of 48K tokens took 12% of the recompute, 2K tokens 45%
    cpu_tier_tokens: int = 0
    restore_s_per_token: float = 1 / 60000

    @property
    def num_blocks(self) -> int:
        return self.kv_tokens // BLOCK

    def scaled(self, speed: float = 1.0, kv_tokens: int | None = None) -> "EngineConfig":
        """The same engine ``speed`` times as fast (prefill and decode alike), optionally with another KV size."""
        return replace(
            self,
            kv_tokens=kv_tokens if kv_tokens is not None else self.kv_tokens,
            step_base_s=self.step_base_s / speed,
            step_per_seq_s=self.step_per_seq_s / speed,
            kv_read_s_per_ktoken=self.kv_read_s_per_ktoken / speed,
            prefill_s_per_token=self.prefill_s_per_token / speed,
            restore_s_per_token=self.restore_s_per_token / speed,
        )


@dataclass(slots=True, eq=False)  # identity: the scheduler's lists hold the very requests
class EngineRequest:
    """A prompt as block hashes (the last, partial block included) plus its token counts."""

    rid: int
    blocks: Sequence[int]
    prompt_tokens: int
    max_tokens: int
    arrival: float
    # filled by the engine
    computed: int = 0  # prompt tokens already in KV (cached or prefilled)
    generated: int = 0
    held: list = field(default_factory=list)  # block ids held
    cached_tokens: int = 0
    scheduled_at: float | None = None  # first admission: where vLLM's prefill time starts
    first_token_at: float | None = None
    finished_at: float | None = None
    preemptions: int = 0
    lora: str | None = None  # the LoRA adapter it runs with (None: the base model)
    # prefill/decode disaggregation: prompt tokens whose KV another replica computed and sent (the decode leg), and
    # whether its blocks stay held when it ends, for a decode replica to read (the prefill leg)
    external: int = 0
    external_tokens: int = 0  # of them, what it loaded (beyond its local cache hit)
    restored_tokens: int = 0  # prompt tokens restored from the CPU tier (beyond the GPU's hit)
    restore_s: float = 0.0  # the engine seconds their load took
    keep: bool = False

    @property
    def context(self) -> int:
        return self.computed + self.generated


class Engine:
    """Scheduler state of one replica. ``step(now)`` runs one (or several identical) decode steps."""

    def __init__(self, cfg: EngineConfig | None = None):
        self.cfg = cfg or EngineConfig()
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.free_blocks = self.cfg.num_blocks  # never used, or evicted: no hash
        self.cached: OrderedDict[int, int] = OrderedDict()  # hash -> refcount 0, LRU first (evictable)
        self.refs: dict[int, int] = {}  # hash -> refcount > 0 (in use, also cached)
        self.used_blocks = 0  # blocks held by running sequences
        self._run: tuple | None = None  # the run of repeated decode steps in progress: (start, step, repeat, decoding)
        # counters with vLLM's meaning
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.preemptions = 0
        self.finished = 0
        self.aborted = 0
        # vLLM's counters a router may learn rates from (prompt_tokens, request_prefill_time_seconds,
        # generation_tokens, request_decode_time_seconds, requests finished)
        self.prompt_tokens_total = 0
        self.prompt_requests_total = 0  # the requests prompt_tokens_total counts (time_to_first_token's count)
        self.prefill_seconds_total = 0.0
        self.generation_tokens_total = 0
        self.decode_seconds_total = 0.0
        # vLLM before 0.11 counted a prefix-cache look-up (queries and hits) every time the scheduler tried to
        # admit a request, so a request that waits for KV is counted again on every step it waits
        self.lookup_queries = 0
        self.lookup_hits = 0
        self.lora_slots: OrderedDict[str, None] = OrderedDict()  # adapters on the GPU, least recently used first
        self.lora_loads = 0  # adapters brought into a slot
        self.steps = 0  # scheduler steps run (a decode run counts each of its steps): SGLang logs stats by them
        self.prefill_steps = 0  # steps that computed prompt tokens (SGLang refreshes its gauges on each)
        # the engine's true speeds, counted when they happen (not when a request finishes, as vLLM reports
        # them): computed prompt tokens and their prefill seconds at each first token, and per decode step
        # the tokens it produced and the seconds each of them took (a benchmark's ground truth for the rates
        # a router learns from the lagging counters)
        self.true_prefill_tokens = 0
        self.true_prefill_seconds = 0.0
        self.true_decode_tokens = 0
        self.true_decode_seconds = 0.0
        # prefill legs of disaggregated requests whose blocks wait for a decode replica to read them (rid -> request)
        self.kept: dict[int, EngineRequest] = {}
        # the CPU tier: hash -> None, least recently used first; what a router's KV events would say of it
        self.cpu: OrderedDict[int, None] = OrderedDict()
        self.restored_tokens_total = 0  # vLLM's prompt_tokens_by_source{external_kv_transfer} of its restores
        self.restore_seconds_total = 0.0  # vllm:kv_offload_load_time
        self._restore_s = 0.0  # loads of the requests admitted in the step being formed

    # ------------------------------------------------------------------ state

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        return self.used_blocks / self.cfg.num_blocks

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def add(self, req: EngineRequest) -> None:
        self.waiting.append(req)

    def abort(self, req: EngineRequest) -> bool:
        """The client went away: drop the request wherever it is (vLLM aborts it too)."""
        if req in self.running:
            self.running.remove(req)
            self._release(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        else:
            return False
        self.aborted += 1
        return True

    def hit_tokens(self, blocks: Sequence[int], prompt_tokens: int) -> int:
        """Prompt tokens its cache holds now (what a KV connector does not load: it has them)."""
        hit = 0
        for h in blocks[:prompt_tokens // BLOCK if self.cfg.prefix_caching else 0]:
            if h in self.refs or h in self.cached:
                hit += 1
            else:
                break
        return min(hit * BLOCK, prompt_tokens - 1)

    def free_kept(self, rid: int) -> bool:
        """A prefill leg's blocks were read, or nobody will read them: they become evictable cache."""
        r = self.kept.pop(rid, None)
        if r is not None:
            self._release(r)
        return r is not None

    def fits(self, prompt_tokens: int, max_tokens: int) -> bool:
        """Whether a request can ever run here (vLLM rejects prompts longer than the KV cache)."""
        return -(-(prompt_tokens + max_tokens) // BLOCK) <= self.cfg.num_blocks

    def abort_all(self) -> list[EngineRequest]:
        """The replica died: every request it had is lost."""
        out = [*self.running, *self.waiting]
        self._run = None
        for r in [*self.running, *self.kept.values()]:
            self._release(r)
        self.kept.clear()
        self.running.clear()
        self.waiting.clear()
        self.aborted += len(out)
        return out

    # ----------------------------------------------------------------- blocks

    def _offload(self, h: int) -> None:
        """A cached block leaves the GPU: the CPU tier keeps it (most recently used), if there is one."""
        if not self.cfg.cpu_tier_tokens:
            return
        cpu = self.cpu
        cpu[h] = None
        cpu.move_to_end(h)
        if len(cpu) > self.cfg.cpu_tier_tokens // BLOCK:
            cpu.popitem(last=False)

    def _take_block(self) -> bool:
        if self.free_blocks:
            self.free_blocks -= 1
        elif self.cached:
            h, _ = self.cached.popitem(last=False)  # evict the least recently used unreferenced block
            self._offload(h)
        else:
            return False
        self.used_blocks += 1
        return True

    def _available(self) -> int:
        return self.free_blocks + len(self.cached)

    def _release(self, r: EngineRequest) -> None:
        """Give back a sequence's blocks; full prompt blocks stay cached (evictable).

        ``used_blocks`` counts physical blocks: a block shared by several sequences
        is used until the last one lets go of it. Freed tail first, as vLLM frees them
        (``single_type_kv_cache_manager.free``: ``reversed``), so that eviction takes a
        context's tail before its head: a prefix is reused only from its first block.
        """
        refs, cached = self.refs, self.cached
        private = let_go = 0
        for h in reversed(r.held):
            if h is None:
                private += 1
            else:
                n = refs[h] - 1
                if n:
                    refs[h] = n
                else:
                    del refs[h]
                    cached[h] = 0  # never cached while in use (``refs``): a new key, the most recently used
                    let_go += 1
        self.free_blocks += private
        self.used_blocks -= private + let_go
        r.held = []

    def _admit(self, r: EngineRequest) -> bool:
        """Reserve the prompt's blocks, reusing cached ones. False if KV space is short."""
        full = r.prompt_tokens // BLOCK if self.cfg.prefix_caching else 0  # off: every block private
        # a block is in use (``refs``) or evictable (``cached``), never both: one walk counts the hit and which of
        # it comes back from the evictable ones (per block of every admission: the simulator's hottest loop)
        refs, cached = self.refs, self.cached
        hit = back = 0
        for h in islice(r.blocks, full):
            if h in refs:
                hit += 1
            elif h in cached:
                hit += 1
                back += 1
            else:
                break
        need_new = -(-r.prompt_tokens // BLOCK) - hit
        restore = 0
        if self.cpu and r.preemptions == 0 and not r.external:
            for h in r.blocks[hit:full]:
                if h not in self.cpu or h in self.refs:
                    break
                self.cpu.move_to_end(h)  # in use: the blocks the GPU evicts to admit it go down behind these
                restore += 1
        self.lookup_queries += r.prompt_tokens
        self.lookup_hits += min(hit * BLOCK, r.prompt_tokens - 1)
        if need_new > self._available() - back:
            return False
        held = list(islice(r.blocks, hit))
        for h in held:
            if h in cached:  # an evictable cached block comes back into use
                del cached[h]
                refs[h] = 1
                self.used_blocks += 1
            else:  # already in use by another sequence: shared, no new physical block
                refs[h] += 1
        for i in range(hit, hit + need_new):
            self._take_block()
            h = r.blocks[i] if i < full else None
            if h is None or h in self.refs:
                # partial block, or the same block being computed by another sequence: private copy
                held.append(None)
                continue
            if h in self.cached:  # an orphan of an evicted chain: the new block replaces it
                del self.cached[h]
                self.free_blocks += 1
            self.refs[h] = 1
            held.append(h)
        # vLLM always recomputes the last prompt token, so a fully cached prompt hits one block less
        cached_tokens = min(hit * BLOCK, r.prompt_tokens - 1)
        restored = min(restore * BLOCK, r.prompt_tokens - 1 - cached_tokens)
        if restored > 0:
            self._restore_s += restored * self.cfg.restore_s_per_token
            self.restored_tokens_total += restored
            self.restore_seconds_total += restored * self.cfg.restore_s_per_token
            r.restored_tokens, r.restore_s = restored, restored * self.cfg.restore_s_per_token
        # what a remote prefill computed is loaded into the new blocks instead of computed (vLLM's connector:
        # get_num_new_matched_tokens, beyond the local hit); a preempted request recomputes it
        external = max(0, min(r.external, r.prompt_tokens - 1) - cached_tokens) if r.preemptions == 0 else 0
        r.computed = cached_tokens + external + restored
        if r.preemptions == 0:
            self.prefix_queries += r.prompt_tokens
            self.prefix_hits += cached_tokens
            # vLLM's usage counts the loaded tokens as cached (a connector's, an offloaded tier's)
            r.cached_tokens = cached_tokens + external + restored
            r.external_tokens = external + restored
        r.held = held
        return True

    def _grow(self, r: EngineRequest, tokens: int) -> bool:
        """Blocks for ``tokens`` more tokens of context beyond what is held."""
        need = -(-(r.context + tokens) // BLOCK) - len(r.held)
        while need > 0:
            if not self._take_block():
                return False
            r.held.append(None)
            need -= 1
        return True

    def _preempt_newest(self) -> None:
        victim = self.running.pop()
        self._release(victim)
        victim.computed = 0
        victim.generated = 0
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(victim)

    # ------------------------------------------------------------------- step

    def _admit_queue(self, now: float, budget: int, prefilling: list) -> tuple[int, int]:
        """Admission in queue order while there is room (KV, sequences, token budget); never a request that
        arrives after this step starts (a mock whose engine clock is behind the wall clock catches up before it
        admits what came later). With LoRA, as vLLM v1's scheduler does it: a request whose adapter would make one
        adapter too many in the batch is skipped (it keeps its place) and the next one is tried; an adapter not
        in a slot takes a free one, or the least recently used slot no running request needs.
        Returns the budget left and the adapters loaded."""
        cfg = self.cfg
        in_batch = {r.lora for r in self.running if r.lora is not None} if cfg.max_loras else set()
        loads = 0
        skipped: list[EngineRequest] = []
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs and \
                self.waiting[0].arrival <= now + 1e-9:
            r = self.waiting[0]
            lora = r.lora if cfg.max_loras else None
            if lora is not None and lora not in in_batch and len(in_batch) >= cfg.max_loras:
                skipped.append(self.waiting.popleft())
                continue
            if not self._admit(r):
                break
            self.waiting.popleft()
            if lora is not None:
                if r.lora in self.lora_slots:
                    self.lora_slots.move_to_end(r.lora)
                else:
                    if len(self.lora_slots) >= cfg.max_loras:
                        idle = next(a for a in self.lora_slots if a not in in_batch)
                        del self.lora_slots[idle]
                    self.lora_slots[r.lora] = None
                    self.lora_loads += 1
                    loads += 1
                in_batch.add(r.lora)
            self.running.append(r)
            if r.scheduled_at is None:
                r.scheduled_at = now
            chunk = min(r.prompt_tokens - r.computed, budget)  # >= 1: the last token is always computed
            prefilling.append((r, chunk))
            budget -= chunk
        self.waiting.extendleft(reversed(skipped))
        return budget, loads

    @property
    def lora_running(self) -> list[str]:
        return sorted({r.lora for r in self.running if r.lora is not None})

    @property
    def lora_waiting(self) -> list[str]:
        return sorted({r.lora for r in self.waiting if r.lora is not None})

    def cut_run(self, now: float) -> float | None:
        """A request arrived during a run of repeated decode steps (``step``'s horizon): vLLM admits it at the
        next step boundary, so the run ends there. Returns the run's new end, or None if it is not cut."""
        run, self._run = self._run, None
        if run is None:
            return None
        start, dur, repeat, decoding = run
        done_steps = max(1, math.ceil((now - start) / dur - 1e-9))
        if done_steps >= repeat:
            return None
        for r in decoding:  # no one finishes or takes a block inside a run, so taking tokens back is exact
            r.generated -= repeat - done_steps
        undone = repeat - done_steps
        self.steps -= undone
        self.true_decode_tokens -= undone * len(decoding)
        self.true_decode_seconds -= undone * dur * len(decoding)
        return start + done_steps * dur

    def step(self, now: float, horizon: float = 0.0) -> tuple[float, list[EngineRequest], list[EngineRequest]]:
        """Run one scheduler step starting at ``now``.

        Returns (duration, requests that got their first token, requests that finished).
        With ``horizon`` > 0, a pure-decode step is repeated as many times as
        nothing else can change (no prefill, no admission, no finish, no new
        block, up to ``horizon`` seconds): the simulator's fast path.
        """
        cfg = self.cfg
        budget = cfg.max_num_batched_tokens
        # decodes first (1 token each), as vLLM v1 schedules running requests first; a decode
        # that cannot get a block preempts the newest running sequence (possibly itself)
        decoding = [r for r in self.running if r.computed >= r.prompt_tokens]
        for r in decoding:
            while r in self.running and not self._grow(r, 1):
                self._preempt_newest()
        alive = set(map(id, self.running))
        decoding = [r for r in decoding if id(r) in alive]
        budget -= len(decoding)
        prefill_tokens = 0
        prefilling = []
        for r in self.running:
            if r.computed < r.prompt_tokens and budget > 0:
                chunk = min(r.prompt_tokens - r.computed, budget)
                prefilling.append((r, chunk))
                budget -= chunk
        budget, loads = self._admit_queue(now, budget, prefilling)
        for _, chunk in prefilling:
            prefill_tokens += chunk

        kv_read = sum(r.context for r in decoding)
        n = len(decoding) + len(prefilling)
        if n == 0:
            return 0.0, [], []
        dur = cfg.step_base_s + cfg.step_per_seq_s * n + cfg.prefill_s_per_token * prefill_tokens + \
            cfg.kv_read_s_per_ktoken * kv_read / 1000
        dur += loads * cfg.lora_load_s
        dur += self._restore_s  # what the admitted requests restored from the CPU tier
        self._restore_s = 0.0

        repeat = 1
        self._run = None
        if horizon > 0 and not prefilling and not self.waiting and decoding:
            # every decode gets one token per step; stop before anyone finishes or needs a block
            left = min(r.max_tokens - r.generated for r in decoding)
            to_block = min(len(r.held) * BLOCK - r.context for r in decoding)
            repeat = max(1, min(left - 1, to_block, int(horizon / dur)))
        if repeat > 1:
            self._run = (now, dur, repeat, decoding)
            dur *= repeat

        first, done = [], []
        end = now + dur
        self.steps += repeat
        if prefilling:
            self.prefill_steps += 1
        for r in decoding:
            r.generated += repeat
        self.true_decode_tokens += repeat * len(decoding)
        self.true_decode_seconds += dur * len(decoding)
        for r, chunk in prefilling:
            r.computed += chunk
            if r.computed >= r.prompt_tokens:
                # the step that finishes prefill also samples the first output token
                self._grow(r, 1)
                r.generated += 1
                if r.first_token_at is None:
                    prefill_s = end - (r.scheduled_at if r.scheduled_at is not None else now)
                    self.prompt_tokens_total += r.prompt_tokens
                    self.prompt_requests_total += 1
                    self.prefill_seconds_total += prefill_s
                    self.true_prefill_tokens += r.prompt_tokens - r.cached_tokens
                    self.true_prefill_seconds += prefill_s
                r.first_token_at = end
                first.append(r)
        for r in list(self.running):
            if r.generated >= r.max_tokens:
                r.finished_at = end
                self.running.remove(r)
                if r.keep:
                    self.kept[r.rid] = r
                else:
                    self._release(r)
                self.finished += 1
                self.generation_tokens_total += r.generated
                self.decode_seconds_total += end - r.first_token_at
                done.append(r)
        return dur, first, done
