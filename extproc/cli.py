"""The ``warmroute`` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="warmroute", description="LLM-aware routing brain for Envoy")
    sub = ap.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="replay a scripted burst of agent traffic through the routing core")
    d.add_argument("--seed", type=int, default=7)

    c = sub.add_parser("check-config", help="validate a config file; prints one line naming a bad field")
    c.add_argument("config")

    args = ap.parse_args(argv)
    if args.cmd == "demo":
        from .demo_core import run

        router = run(sys.stdout, seed=args.seed)
        print(f"  open reservations at the end: {router.open_reservations}")
        return 0
    if args.cmd == "check-config":
        from .config import ConfigError, load_config

        try:
            cfg = load_config(args.config)
        except ConfigError as e:
            print(f"warmroute: config error: {e}", file=sys.stderr)
            return 2
        print(f"{cfg.source}: ok, {len(cfg.replicas)} replicas")
        return 0
    return 2  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
