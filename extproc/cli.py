"""The ``warmroute`` command."""

from __future__ import annotations

import argparse
import asyncio
import sys


def _config_or_exit(path: str | None):
    from .config import AppConfig, ConfigError, load_config

    if path is None:
        return AppConfig()
    try:
        return load_config(path)
    except ConfigError as e:
        print(f"warmroute: config error: {e}", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="warmroute", description="LLM-aware routing brain for Envoy")
    sub = ap.add_subparsers(dest="cmd", required=True)

    u = sub.add_parser("up", help="start Envoy + brain + 4 mock vLLM replicas, send agent load, show the table")
    u.add_argument("--replicas", type=int, default=4)
    u.add_argument("--minutes", type=float, default=2.0, help="workload minutes of demo load (about 30 s of wall time)")
    u.add_argument("--sessions-per-min", type=float, default=6.0)
    u.add_argument("--no-serve", action="store_true", help="stop after the load instead of serving until Ctrl-C")
    u.add_argument("--port", type=int, default=0, help="Envoy's listen port on 127.0.0.1, for a stable URL (default: any free)")

    d = sub.add_parser("demo-core", help="replay a scripted burst of agent traffic through the routing core alone")
    d.add_argument("--seed", type=int, default=7)
    d.add_argument("--policy", default=None, help="routing.policy to run (default: the config's default)")

    b = sub.add_parser("brain", help="run the ext_proc / access-log gRPC service (the brain)")
    b.add_argument("--config", required=True)
    b.add_argument("--host", default=None, help="address to bind the gRPC port (default: brain.host)")
    b.add_argument("--grpc-port", type=int, default=None, help="overrides brain.grpc_port (0: the OS picks)")
    b.add_argument("--admin-port", type=int, default=None, help="overrides brain.admin_port (loopback only)")
    b.add_argument("--ready-file", default=None, help="write the bound ports here as JSON once serving")
    b.add_argument("--metrics-port", type=int, default=None, help="overrides brain.metrics_port (0: the OS picks)")
    b.add_argument("--log-format", choices=["json", "text"], default="json",
                   help="state changes, rebinds, drains and reloads as JSON lines (default) or text")

    m = sub.add_parser("mock-vllm", help="an OpenAI-compatible stand-in for one vLLM replica")
    from .tools.mock_vllm import add_arguments

    add_arguments(m)

    e = sub.add_parser("envoy-config", help="render the Envoy bootstrap (or the paste-in snippets) from the config")
    e.add_argument("--config", required=True)
    e.add_argument("--snippets", action="store_true", help="print the pieces for an existing Envoy instead")

    sm = sub.add_parser("sim", help="virtual-time simulator: one policy, or --compare them all")
    from .tools.sim.cli import add_arguments as sim_arguments

    sim_arguments(sm)

    tp = sub.add_parser("top", help="live terminal view of the brain and Envoy")
    from .tools.top import add_arguments as top_arguments

    top_arguments(tp)

    c = sub.add_parser("check-config", help="validate a config file; prints one line naming a bad field")
    c.add_argument("config")

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

        cfg = _config_or_exit(args.config)
        sys.stdout.write(dump(snippets(cfg) if args.snippets else bootstrap(cfg)))
        return 0
    if args.cmd == "mock-vllm":
        from .tools.mock_vllm import serve

        try:
            asyncio.run(serve(args))
        except KeyboardInterrupt:
            pass
        return 0
    if args.cmd == "brain":
        import dataclasses

        from .brain.logs import setup_logging
        from .brain.server import run_brain
        from .config import ConfigError

        cfg = _config_or_exit(args.config)
        setup_logging(args.log_format)
        # The CLI's overrides go into the config, and only there: everything downstream reads cfg.brain.
        overrides = {"host": args.host, "grpc_port": args.grpc_port, "admin_port": args.admin_port,
                     "metrics_port": args.metrics_port}
        cfg = dataclasses.replace(cfg, brain=dataclasses.replace(
            cfg.brain, **{k: v for k, v in overrides.items() if v is not None}))
        try:
            asyncio.run(run_brain(cfg, args.ready_file, args.config))
        except KeyboardInterrupt:
            pass
        except ConfigError as e:
            print(f"warmroute: config error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.cmd == "top":
        from .tools.top import run as top_run

        return top_run(args)
    if args.cmd == "sim":
        from .tools.sim.cli import run as sim_run

        return sim_run(args)
    if args.cmd == "up":
        from .tools.up import up

        return up(args)
    return 2  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
