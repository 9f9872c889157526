"""``python -m bench NAME [ARGS...]``: run the scenario ``bench/scenarios/NAME.yaml``, as ``vllm bench NAME`` does.

A scenario names its runner (a module under ``bench/`` with ``main(argv)``) and the runner's arguments; ARGS
after the name are passed on after them (the last of a repeated option wins). ``python -m bench`` lists them.
A new measurement of a kind a runner already makes is a new file, not code.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

SCENARIOS = Path(__file__).resolve().parent / "scenarios"
FIELDS = {"describe", "runner", "args", "make"}


class ScenarioError(ValueError):
    pass


@dataclass(frozen=True)
class Scenario:
    name: str
    describe: str
    runner: str  # module under bench/, e.g. runs.live
    args: tuple[str, ...]
    make: str | None = None  # the make target that runs it

    def run(self, extra: list[str]) -> int:
        module = importlib.import_module(f"bench.{self.runner}")
        # the runner's usage and its result files name the scenario
        sys.argv[:] = [f"python -m bench {self.name}", *extra]
        return int(module.main([*self.args, *extra]) or 0)


def argv_of(args: dict) -> list[str]:
    """A scenario's ``args`` mapping as a command line: ``true`` a flag, ``false``/``null`` left out, a list the
    option's values."""
    out: list[str] = []
    for key, value in args.items():
        opt = "--" + str(key).replace("_", "-")
        if value is True:
            out.append(opt)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            out += [opt, *(str(v) for v in value)]
        else:
            out += [opt, str(value)]
    return out


def load(name: str) -> Scenario:
    path = SCENARIOS / f"{name}.yaml"
    if not path.is_file():
        raise ScenarioError(f"no scenario {name!r}: one of {', '.join(names())}")
    doc = yaml.safe_load(path.read_text()) or {}
    if not isinstance(doc, dict):
        raise ScenarioError(f"{path.name}: a mapping of {', '.join(sorted(FIELDS))}")
    unknown = set(doc) - FIELDS
    if unknown:
        raise ScenarioError(f"{path.name}: unknown field {sorted(unknown)[0]!r} (fields: {', '.join(sorted(FIELDS))})")
    if not isinstance(doc.get("runner"), str) or not isinstance(doc.get("describe"), str):
        raise ScenarioError(f"{path.name}: 'runner' and 'describe' are required strings")
    args = doc.get("args") or {}
    if not isinstance(args, dict):
        raise ScenarioError(f"{path.name}: 'args' is a mapping of option to value")
    return Scenario(name, doc["describe"].strip(), doc["runner"], tuple(argv_of(args)), doc.get("make"))


def names() -> list[str]:
    return sorted(p.stem for p in SCENARIOS.glob("*.yaml"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print(__doc__.split("\n\n")[0].strip() + "\n")
        for n in names():
            s = load(n)
            print(f"  {n:<16} {s.describe}")
        return 0
    try:
        scenario = load(argv[0])
    except ScenarioError as e:
        print(f"python -m bench: {e}", file=sys.stderr)
        return 2
    return scenario.run(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
