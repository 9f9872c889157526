"""The ``warmroute`` command."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path


def _config_or_exit(path: str | None):
    from .config import AppConfig, ConfigError, load_config

    if path is None:
        return AppConfig()
    try:
        return load_config(path)
    except ConfigError as e:
        print(f"warmroute: config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


# (name, what it does in one line, an example): `warmroute --help` lists them, `warmroute NAME --help` shows both
COMMANDS = {
    "up": ("start Envoy + brain + 4 mock vLLM replicas on loopback, send agent load, show the table, serve",
           "warmroute up --replicas 4 --port 8080"),
    "brain": ("run the brain: the ext_proc and access-log gRPC services, scraper and admin API",
              "warmroute brain --config warmroute.yaml"),
    "health": ("ask a brain's gRPC health (liveness, readiness): exit 0 when SERVING; the image's health check",
               "warmroute health --target 127.0.0.1:9002 --service readiness"),
    "envoy-config": ("print the Envoy bootstrap for a config (or --snippets to paste into your own Envoy)",
                     "warmroute envoy-config --config warmroute.yaml > envoy.yaml"),
    "check-config": ("validate a config file; a bad one is one line naming the field",
                     "warmroute check-config warmroute.yaml"),
    "top": ("live terminal view of the brain and Envoy: states, load, pins, traffic share",
            "warmroute top --config warmroute.yaml"),
    "mock-vllm": ("serve an OpenAI-compatible stand-in for one vLLM replica (engine model, vLLM's /metrics)",
                  "warmroute mock-vllm --port 8000 --speedup 10"),
    "sim": ("virtual-time simulator: the real core against modelled peers on a simulated fleet",
            "warmroute sim --compare --load 0.5 --seeds 1-5 --jobs 2"),
    "demo-core": ("replay a scripted burst of agent traffic through the routing core alone, no Envoy",
                  "warmroute demo-core --policy warm"),
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="warmroute", description="warmroute: an LLM-aware load balancer for vLLM replicas, the routing brain "
        "of Envoy.", epilog="example:\n  warmroute up    # the whole stack on loopback (what `make demo` runs)",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def command(name: str) -> argparse.ArgumentParser:
        what, example = COMMANDS[name]
        return sub.add_parser(name, help=what, description=what[0].upper() + what[1:] + ".",
                              epilog=f"example:\n  {example}", formatter_class=argparse.RawDescriptionHelpFormatter)

    u = command("up")
    u.add_argument("--replicas", type=int, default=None, help="how many (default: 4 mocks, or 2 real vLLMs)")
    u.add_argument("--engine", choices=("mock", "vllm"), default="mock",
                   help="vllm: real vLLM 0.32 engines on the CPU with the tiny model (make engines; ~2 GB and ~20 s "
                   "each)")
    u.add_argument("--minutes", type=float, default=2.0, help="workload minutes of demo load (about 30 s of wall time)")
    u.add_argument("--sessions-per-min", type=float, default=6.0)
    u.add_argument("--no-serve", action="store_true", help="stop after the load instead of serving until Ctrl-C")
    u.add_argument("--brains", type=int, default=1,
                   help="several brains sharing state through a local Redis (redis-server): K Envoy + brain pairs, the "
                        "load alternating over the Envoys (mock replicas)")
    u.add_argument("--shape", choices=("pairs", "picker", "processes"), default="pairs",
                   help="with --brains: pairs; the brains as endpoint pickers behind one Envoy; or several ext_proc "
                        "brain processes behind one Envoy (one host's cores)")
    u.add_argument("--port", type=int, default=0,
                   help="Envoy's listen port on 127.0.0.1, for a stable URL (default: any free)")
    u.add_argument("--pd", action="store_true",
                   help="a disaggregated fleet: r0 of role prefill, the rest of role decode, "
                   "their KV handed over by a connector (mocks: NIXL's exchange; vllm: the file-based "
                   "ExampleConnector)")

    d = command("demo-core")
    d.add_argument("--seed", type=int, default=7)
    d.add_argument("--policy", default=None, help="routing.policy to run (default: the config's default)")

    b = command("brain")
    b.add_argument("--config", required=True)
    b.add_argument("--host", default=None, help="address to bind the gRPC port (default: brain.host)")
    b.add_argument("--grpc-port", type=int, default=None, help="overrides brain.grpc_port (0: the OS picks)")
    b.add_argument("--admin-port", type=int, default=None, help="overrides brain.admin_port (loopback only)")
    b.add_argument("--ready-file", default=None, help="write the bound ports here as JSON once serving")
    b.add_argument("--metrics-port", type=int, default=None, help="overrides brain.metrics_port (0: the OS picks)")
    b.add_argument("--log-format", choices=["json", "text"], default="json",
                   help="state changes, rebinds, drains and reloads as JSON lines (default) or text")

    h = command("health")
    h.add_argument("--target", default="127.0.0.1:9002", help="the brain's gRPC address, host:port")
    h.add_argument("--service", default="readiness", help="liveness, readiness, or the ext_proc service's name")
    h.add_argument("--timeout", type=float, default=2.0)
    h.add_argument("--tls-ca", default=None, help="CA of the brain's certificate (a brain with brain.tls_cert_file)")
    h.add_argument("--tls-cert", default=None, help="client certificate, for a brain that asks for one")
    h.add_argument("--tls-key", default=None)
    h.add_argument("--tls-name", default=None, help="the name to check in the brain's certificate")

    m = command("mock-vllm")
    from .tools.mock.options import add_arguments

    add_arguments(m)

    e = command("envoy-config")
    e.add_argument("--config", required=True)
    e.add_argument("--snippets", action="store_true", help="print the pieces for an existing Envoy instead")
    e.add_argument("--out", default=None, help="write it to this file (an init container's shared volume) instead of "
                   "printing it")
    e.add_argument("--mode", choices=("envoy", "endpoint-picker"), default=None,
                   help="envoy: the default shape; endpoint-picker: a Gateway API Inference Extension gateway's "
                   "shape, for a brain with brain.protocol: endpoint-picker (default: the config's brain.protocol)")

    sm = command("sim")
    from .tools.sim.cli import add_arguments as sim_arguments

    sim_arguments(sm)

    tp = command("top")
    from .tools.stack.top import add_arguments as top_arguments

    top_arguments(tp)

    c = command("check-config")
    c.add_argument("config")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.cmd == "demo-core":
        from .tools.demo_core import run

        router = run(sys.stdout, seed=args.seed, policy=args.policy)
        print(f"  open reservations at the end: {router.open_reservations}")
        return 0
    if args.cmd == "check-config":
        cfg = _config_or_exit(args.config)
        print(f"{cfg.source}: ok, {len(cfg.replicas)} replicas")
        return 0
    if args.cmd == "envoy-config":
        from .envoy_config import bootstrap, dump, snippets

        from .config import ConfigError, check_brain_access

        cfg = _config_or_exit(args.config)
        try:
            text = dump(snippets(cfg) if args.snippets else bootstrap(cfg, args.mode))
        except ConfigError as e:
            print(f"warmroute: config error: {e}", file=sys.stderr)
            return 2
        if args.out is None:
            sys.stdout.write(text)
        else:
            Path(args.out).write_text(text)
        return 0
    if args.cmd == "health":
        from .brain.healthcheck import check

        ok, line = check(args.target, args.service, args.timeout, args.tls_ca, args.tls_cert, args.tls_key,
                         args.tls_name)
        print(line)
        return 0 if ok else 1
    if args.cmd == "mock-vllm":
        from .tools.mock.vllm import serve

        try:
            asyncio.run(serve(args))
        except KeyboardInterrupt:
            pass
        return 0
    if args.cmd == "brain":
        import dataclasses

        from .brain.logs import setup_logging
        from .brain.server import run_brain
        from .config import ConfigError, check_brain_access

        cfg = _config_or_exit(args.config)
        setup_logging(args.log_format)
        # The CLI's overrides go into the config, and only there: everything downstream reads cfg.brain.
        overrides = {"host": args.host, "grpc_port": args.grpc_port, "admin_port": args.admin_port,
                     "metrics_port": args.metrics_port}
        cfg = dataclasses.replace(cfg, brain=dataclasses.replace(
            cfg.brain, **{k: v for k, v in overrides.items() if v is not None}))
        try:
            # a flag passes the same checks as the file: --host 0.0.0.0 is no way around brain.host's rule
            check_brain_access(cfg.brain, cfg.envoy)
        except ConfigError as e:
            print(f"warmroute: config error: {e} (with the command-line flags applied)", file=sys.stderr)
            return 2
        try:
            asyncio.run(run_brain(cfg, args.ready_file, args.config))
        except KeyboardInterrupt:
            pass
        except ConfigError as e:
            print(f"warmroute: config error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.cmd == "top":
        from .tools.stack.top import run as top_run

        return top_run(args)
    if args.cmd == "sim":
        from .tools.sim.cli import run as sim_run

        return sim_run(args)
    if args.cmd == "up":
        from .tools.stack.up import up

        return up(args)
    return 2  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
