"""``python -m bench NAME``: every scenario file names a runner that accepts its arguments, and a broken file is
named in one line (issue 44)."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

import bench.__main__ as bench_main

ROOT = Path(__file__).resolve().parents[2]


class Parsed(Exception):
    pass


@pytest.mark.parametrize("name", bench_main.names())
def test_each_scenario_s_runner_accepts_its_arguments(name, monkeypatch):
    s = bench_main.load(name)
    module = __import__(f"bench.{s.runner}", fromlist=["main"])
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):  # the runner's own parser, then nothing runs
        raise Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    out = io.StringIO()
    with contextlib.redirect_stderr(out), pytest.raises(Parsed):  # an unknown option or a bad value: SystemExit
        module.main(list(s.args))


def test_each_make_target_a_scenario_names_runs_it():
    make = (ROOT / "Makefile").read_text()
    for name in bench_main.names():
        s = bench_main.load(name)
        if s.make:
            recipe = re.search(rf"^{re.escape(s.make)}:.*\n((?:\t.*\n)+)", make, re.M)
            assert recipe and f"-m bench {name}" in recipe.group(1), (name, s.make)


def test_a_scenario_s_arguments_become_a_command_line():
    assert bench_main.argv_of({"flood": 2000, "probes": True, "skip": False, "none": None, "contenders": ["a", "b"],
                               "mixed_minutes": 5}) == ["--flood", "2000", "--probes", "--contenders", "a", "b",
                                                        "--mixed-minutes", "5"]


def test_a_broken_scenario_file_is_named_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_main, "SCENARIOS", tmp_path)
    (tmp_path / "typo.yaml").write_text("describe: x\nrunner: runs.core\nargz: {}\n")
    (tmp_path / "bare.yaml").write_text("runner: runs.core\n")
    with pytest.raises(bench_main.ScenarioError, match="typo.yaml: unknown field 'argz'"):
        bench_main.load("typo")
    with pytest.raises(bench_main.ScenarioError, match="bare.yaml: 'runner' and 'describe' are required"):
        bench_main.load("bare")
    with pytest.raises(bench_main.ScenarioError, match="no scenario 'nope': one of bare, typo"):
        bench_main.load("nope")


def test_python_m_bench_lists_the_scenarios_and_refuses_an_unknown_one():
    p = subprocess.run([sys.executable, "-m", "bench"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and all(n in p.stdout for n in bench_main.names()), p.stdout
    p = subprocess.run([sys.executable, "-m", "bench", "nope"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "no scenario 'nope'" in p.stderr and p.stderr.count("\n") == 1, p.stderr
