"""``python -m bench sim-results``: the simulator's result documents run again on the code of this commit.

Every fenced block of ``docs/sim-results.md`` that starts with ``$ warmroute sim ...`` is that command's whole
output: each command is run again (from the repository's root: ``--peers-cache`` files and ``--png`` paths are
relative to it) and its block rewritten, the document saved after each so an interrupted run keeps what it did.
``docs/benchmarks.md`` quotes the median tables of some of them (a block under a line naming the command in
backticks): those are rewritten from the same outputs. The simulator is deterministic, so a block that comes out
different is a change of behaviour, which ``git diff`` shows.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"```\n\$ (warmroute sim [^\n]*)\n(.*?)```", re.S)
# a quoted table: "`warmroute sim ...` (...):" then a fenced block holding the output from "median over seeds" on
QUOTED = re.compile(r"`(warmroute sim [^`]*)`[^\n]*:\n\n```\n(median over seeds.*?)```", re.S)


def run(command: str) -> str:
    argv = shlex.split(command)[1:]  # "warmroute" -> python -m extproc.cli, the code of this tree
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "extproc.cli", *argv], cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"`{command}` failed ({p.returncode}): {p.stderr[-2000:]}")
    out = p.stdout
    return out.rstrip("\n") + f"\n({time.monotonic() - t0:.0f} s wall)\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--doc", default=str(ROOT / "docs" / "sim-results.md"))
    ap.add_argument("--quoting", default=str(ROOT / "docs" / "benchmarks.md"),
                    help="a document that quotes median tables of those outputs ('' for none)")
    ap.add_argument("--only", default="", help="run only the commands containing this text")
    args = ap.parse_args(argv)
    doc = Path(args.doc)
    outputs: dict[str, str] = {}
    for command in [m.group(1) for m in BLOCK.finditer(doc.read_text())]:
        if args.only and args.only not in command:
            continue
        print(f"$ {command}", flush=True)
        out = run(command)
        outputs[command] = out
        text = doc.read_text()
        text = BLOCK.sub(lambda m, out=out, command=command: f"```\n$ {m.group(1)}\n{out}```" if m.group(1) == command
                         else m.group(0), text)
        doc.write_text(text)
        print(out.rstrip().rsplit("\n", 1)[-1], flush=True)
    if args.quoting:
        quoting = Path(args.quoting)

        def quote(m: re.Match) -> str:
            key = next((c for c in outputs if c == m.group(1) or c.startswith(m.group(1) + " ")), None)
            if key is None or "median over seeds" not in outputs[key]:
                return m.group(0)
            median = "median over seeds" + outputs[key].split("median over seeds", 1)[1]
            median = re.sub(r"\n\(\d+ s wall\)\n?$", "\n", median)
            median = re.sub(r"\n*wrote [^\n]*\n?$", "\n", median)  # a file the command wrote, not a table row
            return m.group(0).replace(m.group(2), median)

        quoting.write_text(QUOTED.sub(quote, quoting.read_text()))
    print(f"rewrote {doc} ({len(outputs)} commands){' and ' + args.quoting if args.quoting else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
