"""The documents cannot drift from the code: what they name exists, what the brain exports is documented,
the configuration reference is regenerated from the dataclasses, and every command's help shows an example."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from extproc.cli import COMMANDS, build_parser
from bench import docs

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_name_only_what_exists_and_document_every_metric():
    assert docs.check_docs(build_parser(), ROOT) == []


def test_the_configuration_reference_is_regenerated_from_the_dataclasses():
    # `make docs` writes it; a field added, renamed or re-commented without it fails here
    assert (ROOT / docs.CONFIG_DOC).read_text() == docs.config_reference()


def test_every_config_field_has_a_meaning():
    thin = [(k, m) for k, _, _, m in docs.config_fields() if len(m.split()) < 4]
    assert thin == [], "give these fields a comment beside them in the dataclass"


def _check(text):
    from extproc.cli import build_parser as bp

    return docs.check_text(text, "planted.md", targets=docs.make_targets(ROOT), flags=docs._flags_of(bp()),
                           keys=docs.config_keys(), metrics=docs.exported_metrics(), root=ROOT, base=ROOT / "docs")


@pytest.mark.parametrize("planted, said", [
    ("set `warm.cache_tokenz: 5` to", "no config key warm.cache_tokenz"),
    ("run `make benchmark` first", "no make target 'benchmark'"),
    ("try `warmroute sim --versus 1`", "warmroute sim has no flag --versus"),
    ("or `warmroute serve --config x`", "no warmroute subcommand 'serve'"),
    ("watch warmroute_decisions_made_total", "metric warmroute_decisions_made_total is not exported"),
    ("see [the guide](guide2.md)", "link guide2.md does not resolve"),
])
def test_a_planted_stale_name_is_caught(planted, said):
    problems = _check(f"Some text. {planted}.")
    assert any(said in p for p in problems), problems


def test_names_that_exist_pass():
    text = ("`warm.cache_tokens: 5`, `make bench-quick`, `warmroute sim --versus-peers 1 --seeds 1-3`, "
            "warmroute_decisions_total, warmroute_decision_duration_seconds_bucket, [guide](guide.md#engines)")
    assert _check(text) == []


def test_an_exported_metric_no_document_names_is_caught():
    problems = docs.check_docs(build_parser(), ROOT, metrics=docs.exported_metrics() | {"warmroute_brand_new_gauge"})
    assert problems == ["metric warmroute_brand_new_gauge is exported by the brain but no document names it"]


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200
    first_screen = "\n".join(lines[:60])
    assert "make demo" in first_screen and "make test" in first_screen
    assert "Why not ring hash" in first_screen  # the headline comparison
    assert "docs/guide.md" in first_screen  # the deploy steps


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_command_says_what_it_does_and_shows_an_example_that_parses(name, capsys):
    what, example = COMMANDS[name]
    with pytest.raises(SystemExit):
        build_parser().parse_args([name, "--help"])
    out = capsys.readouterr().out
    assert what[1:] in out.replace("\n", " ").replace("  ", " ") or what[1:40] in out
    assert "example:" in out and example in out
    argv = shlex.split(example.split(">")[0])
    assert argv[0] == "warmroute"
    build_parser().parse_args(argv[1:])  # the example is a valid command line


def test_the_config_reference_s_long_defaults_are_yaml_a_user_can_paste():
    """Issue 60: a long default (a whole section's) is shown as YAML that reads back as the default itself, not as the
    dataclass's Python repr."""
    import dataclasses
    import re

    import yaml

    from extproc.config.schema import AppConfig

    text = (ROOT / "docs" / "configuration.md").read_text()
    blocks = dict(re.findall(r"^`([a-z_.]+)`:\n\n```yaml\n(.*?)\n```", text, re.M | re.S))
    assert {"flow_control", "exact_cache"} <= set(blocks)
    for f in dataclasses.fields(AppConfig):
        if f.name in blocks and dataclasses.is_dataclass(default := f.default_factory()):  # type: ignore[misc]
            want = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(default).items()}
            assert yaml.safe_load(blocks[f.name]) == want, f.name
