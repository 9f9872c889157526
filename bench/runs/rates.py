"""``make bench-rates``: the speeds the brain learns from a replica's counters, against the engine's true speeds,
while load ramps up and down, for each engine dialect the mock speaks.

A mock replica (``--metrics vllm|vllm-old|sglang``) moves its counters when that engine's code moves them:
vLLM observes prefill and decode seconds when a request finishes, but counts prompt tokens at the first token
and generation tokens every step. Its engine also counts the truth as it happens (``mock:engine_truth``:
computed prompt tokens and their prefill seconds at each first token; decode tokens and their seconds at
each step). Every 0.5 s this bench reads the mock's /metrics with the brain's own parser and feeds two
learners: the brain's (``Rates``: each rate from counters of the same requests) and the window pairing the
brain used before (tokens of this window over seconds of this window). Each learned value is compared with
the truth over the trailing ``--truth-window-s``.

The load is open-loop Poisson, its rate rising linearly from ``--low`` to ``--high`` requests/s of workload
time over ``--ramp-s`` wall seconds and falling back as long: prompts of 2-16 K characters behind one of four
shared 8 K system prompts, 256-1024 tokens generated.

``--real``: the same on one real vLLM 0.32 replica (``make engines``; the tiny model, real time, the machine's
cores to itself), whose truth is its own histograms over the trailing window: computed prefill tokens
(``request_prefill_kv_computed_tokens``) over prefill seconds (``request_prefill_time_seconds``), decode seconds
(``request_decode_time_seconds``) over the tokens generated after each first token. The load is scaled to the
tiny model (prompts of 0.5-4 K characters behind one of four 3 K system prompts, 16-128 tokens generated) and to
what two cores carry; the learner starts from the config's default values, as a brain does.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from aiohttp import ClientSession, ClientTimeout

from extproc.tools.workload.generate import MOCK_MODEL
from bench.harness import histogram_sums
from extproc.brain.scraper import SGLANG, VLLM, parse_metrics
from extproc.core.load import _MIN_PREFILL_S, Rates
from extproc.tools.stack import real_vllm
from extproc.tools.stack.local import Proc, _cli, mock_argv, wait_for

DIALECT_OF = {"vllm": VLLM, "vllm-old": VLLM, "sglang": SGLANG}
PREFILL_REF, DECODE_REF = 5000.0, 0.03  # the config's defaults (warm.prefill_tokens_per_s, decode_s_per_token)


def _truth(text: str) -> dict[str, float]:
    if "mock:engine_truth{" not in text:
        return histogram_sums(text)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("mock:engine_truth{"):
            lab, value = line[len("mock:engine_truth{"):].split("} ")
            q = lab.split('quantity="')[1].split('"')[0]
            out[q] = out.get(q, 0.0) + float(value)
    return out


class Learners:
    def __init__(self, speedup: float):
        # the mock's seconds are wall seconds of a compressed engine: its speeds are speedup x the real ones
        # and its prefill seconds accumulate as much slower: a sample takes the same workload time as at 1x
        kw = {"min_prefill_s": _MIN_PREFILL_S / speedup}
        self.paired = Rates(PREFILL_REF * speedup, DECODE_REF / speedup, 256.0, paired=True, **kw)
        self.one = Rates(PREFILL_REF * speedup, DECODE_REF / speedup, 256.0, paired=True, batch=False, **kw)
        self.window = Rates(PREFILL_REF * speedup, DECODE_REF / speedup, 256.0, paired=False, **kw)


def _words(rng: random.Random, chars: int) -> str:
    """Text a BPE tokenizer reads as words (~3-4 characters a token), not as one token per character."""
    out, n = [], 0
    while n < chars:
        w = f"w{rng.randrange(20_000)}"
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


async def _load(url: str, args, stop: asyncio.Event, sent: list[int]) -> None:
    rng = random.Random(args.seed)
    if args.real:
        systems = [_words(rng, 3072) for _ in range(4)]
    else:
        systems = ["".join(rng.choice("abcdefghij ") for _ in range(8192)) for _ in range(4)]
    t0 = time.monotonic()
    tasks: set[asyncio.Task] = set()
    async with ClientSession(timeout=ClientTimeout(total=600)) as session:

        async def one(prompt: str, max_tokens: int) -> None:
            body = {"model": args.model, "prompt": prompt, "max_tokens": max_tokens}
            if args.real:
                body.update(ignore_eos=True, temperature=0)  # the tiny model's noise may end early: count max_tokens
            try:
                async with session.post(url + "/v1/completions", json=body) as resp:
                    await resp.read()
            except Exception:
                pass

        while not stop.is_set():
            t = time.monotonic() - t0
            if t > 2 * args.ramp_s:
                break
            x = t / args.ramp_s if t < args.ramp_s else 2 - t / args.ramp_s
            rate = (args.low + (args.high - args.low) * x) * args.speedup
            await asyncio.sleep(rng.expovariate(rate))
            if args.real:
                prompt, out = rng.choice(systems) + " " + _words(rng, rng.randint(512, 4096)), rng.randint(16, 128)
            else:
                prompt = rng.choice(systems) + "".join(rng.choice("klmnopqrst ") for _ in range(rng.randint(2048,
                                                                                                            16384)))
                out = rng.randint(256, 1024)
            task = asyncio.create_task(one(prompt, out))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            sent[0] += 1
        for task in list(tasks):
            task.cancel()


async def _watch(url: str, dialect: str, args, stop: asyncio.Event, rows: list) -> None:
    learners = Learners(args.speedup)
    history: list[tuple[float, dict]] = []
    t0 = time.monotonic()
    async with ClientSession(timeout=ClientTimeout(total=5)) as session:
        while not stop.is_set():
            await asyncio.sleep(0.5)
            now = time.monotonic() - t0
            try:
                async with session.get(url + "/metrics") as resp:
                    text = await resp.text()
            except Exception:
                continue
            r = parse_metrics(text, DIALECT_OF.get(dialect, VLLM))
            if not r.ok:
                continue
            for x in (learners.paired, learners.one, learners.window):
                x.update(r.sample, now)
            truth = _truth(text)
            history.append((now, truth, r.sample.running))
            i = next((k for k, (t, _, _) in enumerate(history) if t >= now - args.truth_window_s), None)
            if i is None or now < args.truth_window_s:
                continue
            d = {k: truth[k] - history[i][1].get(k, 0.0) for k in truth}
            if d.get("prefill_seconds", 0) <= 0 or d.get("decode_tokens", 0) <= 0:
                continue
            # each learner's rates at the batch the engine ran over the window (the mean of its running requests
            # as scraped: what the brain's fit is learned against)
            batch = statistics.mean(b for _, _, b in history[i:])
            (bp, bd), (op, od) = learners.paired.at_batch(batch), learners.one.at_batch(batch)
            rows.append((now, d["prefill_tokens"] / d["prefill_seconds"], d["decode_seconds"] / d["decode_tokens"],
                         bp, bd, learners.window.prefill_tokens_per_s, learners.window.decode_s_per_token,
                         learners.paired.prefill_at > float("-inf"), learners.window.prefill_at > float("-inf"),
                         learners.paired.decode_at > float("-inf"), learners.window.decode_at > float("-inf"),
                         op, od, learners.one.prefill_at > float("-inf"), learners.one.decode_at > float("-inf")))


def _errors(rows: list, truth_i: int, learned_i: int, learned_flag: int) -> tuple[str, str, str]:
    errs = [abs(r[learned_i] - r[truth_i]) / r[truth_i] for r in rows if r[learned_flag]]
    if not errs:
        return "not learned", "", ""
    errs.sort()
    p90 = errs[int(0.9 * (len(errs) - 1))]
    within = sum(e <= 0.15 for e in errs) / len(errs)
    return f"{100 * statistics.median(errs):.1f}%", f"{100 * p90:.1f}%", f"{100 * within:.0f}%"


async def run_real(args, workdir: Path) -> dict:
    proc, port = real_vllm.start_vllm("vllm-0.32", workdir, real_vllm.VllmOptions(lora=()))
    try:
        url = f"http://127.0.0.1:{port}"
        stop = asyncio.Event()
        rows: list = []
        sent = [0]
        watcher = asyncio.create_task(_watch(url, "vllm 0.32 (real)", args, stop, rows))
        await _load(url, args, stop, sent)
        stop.set()
        await watcher
    finally:
        proc.stop()
    return {"dialect": "vllm 0.32 (real)", "rows": rows, "sent": sent[0],
            "prefill": (_errors(rows, 1, 3, 7), _errors(rows, 1, 11, 13), _errors(rows, 1, 5, 8)),
            "decode": (_errors(rows, 2, 4, 9), _errors(rows, 2, 12, 14), _errors(rows, 2, 6, 10))}


async def run_dialect(dialect: str, args, workdir: Path) -> dict:
    proc = Proc(f"mock-{dialect}", _cli(*mock_argv(dialect, 0), "--speedup", str(args.speedup), "--metrics", dialect,
                                        "--seed", str(args.seed)), workdir)
    try:
        def port():
            for line in proc.log_tail(4000).splitlines():
                if line.startswith("mock-vllm listening on http"):
                    return int(line.rsplit(":", 1)[1])
            return None

        url = f"http://127.0.0.1:{wait_for(port, 20, 'the mock to listen', proc)}"
        stop = asyncio.Event()
        rows: list = []
        sent = [0]
        watcher = asyncio.create_task(_watch(url, dialect, args, stop, rows))
        await _load(url, args, stop, sent)
        stop.set()
        await watcher
    finally:
        proc.stop()
    return {"dialect": dialect, "rows": rows, "sent": sent[0],
            "prefill": (_errors(rows, 1, 3, 7), _errors(rows, 1, 11, 13), _errors(rows, 1, 5, 8)),
            "decode": (_errors(rows, 2, 4, 9), _errors(rows, 2, 12, 14), _errors(rows, 2, 6, 10))}


def report(results: list[dict], args) -> str:
    out = [f"Learned rates against the engine's true rates (trailing {args.truth_window_s:g} s), load ramping "
           f"{args.low:g} -> {args.high:g} -> {args.low:g} req/s over {2 * args.ramp_s:g} s wall at "
           f"{args.speedup:g}x, seed {args.seed}.",
           "Error: |learned - true| / true over every 0.5 s sample after the first window (median, p90, share "
           "within 15%).", "",
           "| dialect | requests | rate | brain: a line in the batch, median / p90 / within 15% | one rate "
           "(same samples, no slope) | window pairing (the lagging way) |", "|---|---|---|---|---|---|"]
    for r in results:
        for rate in ("prefill", "decode"):
            new, one, old = r[rate]
            out.append(f"| {r['dialect']} | {r['sent']} | {rate} | {' / '.join(x for x in new if x)} | "
                       f"{' / '.join(x for x in one if x)} | {' / '.join(x for x in old if x)} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dialects", nargs="+", default=["vllm", "vllm-old", "sglang"])
    ap.add_argument("--speedup", type=float, default=10.0)
    ap.add_argument("--ramp-s", type=float, default=60.0, help="wall seconds up, and as many down")
    ap.add_argument("--low", type=float, default=0.1, help="requests/s of workload time at the ends of the ramp")
    ap.add_argument("--high", type=float, default=1.2, help="requests/s of workload time at its top")
    ap.add_argument("--truth-window-s", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--real", action="store_true", help="one real vLLM 0.32 replica (make engines), real time, "
                    "its own histograms as the truth; defaults: --ramp-s 90 --low 0.1 --high 1.5 --truth-window-s 20")
    args = ap.parse_args(argv)
    args.model = MOCK_MODEL
    with tempfile.TemporaryDirectory(prefix="bench-rates-") as d:
        if args.real:
            why = real_vllm.available()
            if why:
                raise SystemExit(f"bench-rates --real: {why}")
            args.model = real_vllm.model_info()["served_name"]
            args.speedup = 1.0
            for k, v in (("ramp_s", 90.0), ("low", 0.1), ("high", 1.5), ("truth_window_s", 20.0)):
                if f"--{k.replace('_', '-')}" not in (argv or sys.argv[1:]):
                    setattr(args, k, v)
            results = [asyncio.run(run_real(args, Path(d)))]
        else:
            results = [asyncio.run(run_dialect(x, args, Path(d))) for x in args.dialects]
    print(report(results, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
