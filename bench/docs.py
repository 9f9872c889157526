"""``make docs``: docs/configuration.md generated from the config dataclasses, and the docs checker.

The reference is made from the code, so it cannot drift: every field's YAML path, type and default come from
the dataclasses, its meaning from the comment written beside (or just above) the field. ``check_docs`` is what
``tests/repo/test_docs.py`` runs: every ``make`` target, ``warmroute`` flag, config key and metric name the docs
mention exists, every metric the brain exports is documented, and every relative link resolves.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import io
import re
import tokenize
import types
import typing
from pathlib import Path

from extproc.config import AppConfig, BrainConfig, DiscoveryConfig, EnvoyConfig, ReplicaSpec, SharedStateConfig
from extproc.core.config import DisaggregationConfig, HealthConfig, PinConfig, ProfileConfig, RouterConfig, WarmConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DOC = "docs/configuration.md"
# the YAML sections in the order a reader meets them; "routing" is RouterConfig's own scalar fields
SECTIONS: tuple[tuple[str, type, str], ...] = (
    ("replicas[]", ReplicaSpec, "One entry per replica: where it is and which engine's metrics it exports."),
    ("routing", RouterConfig, "Which policy chooses, and what the fleet does around it."),
    ("health", HealthConfig, "The health machine of every replica (SPEC A1, A2, B)."),
    ("warm", WarmConfig, "The cost-based policy, `routing.policy: warm` (SPEC C)."),
    ("disaggregation", DisaggregationConfig, "Prefill/decode disaggregation: where replicas of role prefill take "
     "prefill legs (docs/routing.md \"Prefill/decode disaggregation\")."),
    ("pins", PinConfig, "Session and prefix pins (SPEC A3; `warm` uses `session_ttl_s` only)."),
    ("profile", ProfileConfig, "What the brain reads of a request: keys, tenant, size, block chain."),
    ("brain", BrainConfig, "Where the brain listens."),
    ("envoy", EnvoyConfig, "What the rendered Envoy bootstrap needs beyond the replica list."),
    ("discovery", DiscoveryConfig, "Where the replica set comes from: the file, DNS, or Kubernetes (kubernetes.md)."),
    ("shared_state", SharedStateConfig, "Several brains sharing routing state through Redis (README \"Running several "
     "brains\"); off unless redis_url is set."),
    ("", AppConfig, "Top-level fields."),
)
_NESTED = {"health", "pins", "profile", "warm", "disaggregation", "router", "replicas", "brain", "envoy", "discovery",
           "shared_state", "source",
           "aliases"}
MODELS_SECTION = [
    "## `models`",
    "",
    "Which model a request goes to. A request goes only to replicas serving its body's `model` (what their",
    "`/v1/models` lists, or `replicas[].models`); a name none serves is answered 404 as vLLM answers it. An alias",
    "maps a client's name to served names, weighted: each session keeps the target its key hashes to, the body's",
    "`model` is rewritten to it, and `GET /v1/models` lists the alias beside the fleet's models.",
    "",
    "```yaml",
    "models:",
    "  aliases:",
    "    coder: qwen3-coder-30b                    # one target",
    "    chat:                                     # a canary: 10% of sessions",
    "      - {model: llama-3.3-70b, weight: 90}",
    "      - {model: llama-3.3-70b-ft, weight: 10}",
    "```",
    "",
]
_FIELD_RE = re.compile(r"^\s+([a-z_][a-z0-9_]*)\s*:\s*[^=]")


def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment: the one on its line, else the comment lines just above it."""
    src = inspect.getsource(cls)
    by_line: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            by_line[tok.start[0]] = tok.string.lstrip("#").strip()
    names = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, str] = {}
    above: list[str] = []
    for n, line in enumerate(src.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(by_line.get(n, ""))
            continue
        m = _FIELD_RE.match(line)
        if m and m.group(1) in names:
            out[m.group(1)] = by_line.get(n) or " ".join(above)
        above = []
    return out


def _type_name(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        return _type_name(inner) + " or null"
    if origin is tuple:
        # a tuple of pairs is read from a mapping (replicas[].kv_events: {endpoint, replay_endpoint, ...})
        return "mapping" if typing.get_origin(args[0]) is tuple else "list of strings"
    return {int: "whole number", float: "number", str: "string", bool: "true / false"}.get(tp, getattr(tp, "__name__",
                                                                                                       str(tp)))


def _yaml(value) -> str:
    if dataclasses.is_dataclass(value):  # a section's default: YAML a user can paste, not the dataclass's repr
        return "{" + ", ".join(f"{f.name}: {_yaml(getattr(value, f.name))}" for f in dataclasses.fields(value)) + "}"
    if isinstance(value,
                  str) and (not value or any(c in value for c in ":{}[],#&*!|>'\"%@`") or value != value.strip()):
        return "'" + value.replace("'", "''") + "'"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return _yaml(f.default)
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return _yaml(f.default_factory())  # type: ignore[misc]
    return "(required)"


def config_fields() -> list[tuple[str, str, str, str]]:
    """(YAML key, type, default, meaning) of every field a config file may set."""
    rows = []
    for section, cls, _ in SECTIONS:
        hints = typing.get_type_hints(cls)
        notes = field_comments(cls)
        for f in dataclasses.fields(cls):
            if f.name in _NESTED and cls in (RouterConfig, AppConfig):
                continue
            key = f"{section}.{f.name}" if section else f.name
            default = "null" if _type_name(hints[f.name]) == "mapping" else _default(f)
            rows.append((key, _type_name(hints[f.name]), default, notes.get(f.name, "")))
    return rows


def config_keys() -> set[str]:
    return {k for k, *_ in config_fields()}


def config_reference() -> str:
    out = [
        "# Configuration reference",
        "",
        "<!-- generated by `make docs` from the config dataclasses (extproc/config/schema.py, extproc/core/config.py);",
        "     edit the comments there, not this file: `make test` fails when it is stale -->",
        "",
        "One YAML file (`warmroute brain --config FILE`, `warmroute check-config FILE`). Every field is optional",
        "and defaults to the number below (SPEC.md's, where SPEC has one). A bad file is refused with one line",
        "naming the field, e.g. `warmroute: config error: pins.session_ttl_s: expected a number >= 0, got 'soon'`.",
        "Times are seconds (`_s`), sizes bytes (`_bytes`).",
        "",
        "```yaml",
        "replicas:",
        '  - {name: r0, url: "http://10.0.0.5:8000"}                  # engine: vllm (the default)',
        '  - {name: s0, url: "http://10.0.0.6:30000", engine: sglang}',
        "routing: {policy: warm}",
        "warm:    {cache_tokens: 300000}",
        "```",
        "",
    ]
    rows = config_fields()
    for section, _cls, blurb in SECTIONS:
        out += [f"## `{section}`" if section else "## Top level", "", blurb, "", "| key | type | default | meaning |",
                "|---|---|---|---|"]
        prefix = f"{section}." if section else ""
        for key, tp, default, meaning in rows:
            if (prefix and key.startswith(prefix)) or (not prefix and "." not in key):
                cell = default if len(default) <= 40 else default[:37] + "..." + default[-1] * (default[-1] in "]}")
                out.append(f"| `{key}` | {tp} | `{cell}` | {meaning.replace('|', '/')} |")
        out.append("")
    out += MODELS_SECTION
    long = [(k, d) for k, _, d, _ in rows if len(d) > 40]
    if long:
        out += ["## Long defaults", ""]
        for key, default in long:
            out += [f"`{key}`:", "", "```yaml", default, "```", ""]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ the chart

CHART = "deploy/helm/warmroute"
VALUES_SCHEMA = f"{CHART}/values.schema.json"
K8S_DOC = "docs/kubernetes.md"
VALUES_BEGIN = "<!-- values: generated by `make docs` from deploy/helm/warmroute/values.schema.json and values.yaml -->"
VALUES_END = "<!-- /values -->"


def values_schema(root: Path = ROOT) -> str:
    """The chart's values.schema.json with ``config`` = the config file's own schema (so ``helm install`` refuses
    a bad key of the brain's config, naming it, as ``warmroute check-config`` would)."""
    import json

    from extproc.config.json_schema import config_schema

    doc = json.loads((root / VALUES_SCHEMA).read_text())
    doc["properties"]["config"] = config_schema()
    return json.dumps(doc, indent=2) + "\n"


def values_table(root: Path = ROOT) -> str:
    """docs/kubernetes.md's table of the chart's values: each value's path, default and meaning, from the schema's
    descriptions and values.yaml's defaults."""
    import json

    import yaml

    schema = json.loads((root / VALUES_SCHEMA).read_text())
    defaults = yaml.safe_load((root / CHART / "values.yaml").read_text())
    rows = ["| value | default | meaning |", "|---|---|---|"]

    def walk(node: dict, path: str, default) -> None:
        props = node.get("properties")
        if props and node.get("type") == "object" and path != "config":
            for k, sub in props.items():
                if k == "global":
                    continue
                walk(sub, f"{path}.{k}" if path else k, (default or {}).get(k) if isinstance(default, dict) else None)
            return
        shown = json.dumps(default, separators=(", ", ": ")) if default not in (None,
                                                                                "") else ('""' if default == "" else "")
        desc = node.get("description", "") if path != "config" else ("the brain's config file, as in "
                                                                        "[configuration.md](configuration.md); the "
                                                                        "shape's ports, TLS files, discovery and "
                                                                        "shared state are filled in beneath it")
        rows.append(f"| `{path}` | `{shown}` | {desc.replace('|', '/')} |" if shown else f"| `{path}` | | {desc} |")

    walk(schema, "", defaults)
    return "\n".join([VALUES_BEGIN, *rows, VALUES_END])


def chart_values(root: Path = ROOT) -> set[str]:
    """The chart's value paths (``brain.replicas``): named in the docs beside config keys of the same sections."""
    return {line.split("`")[1] for line in values_table(root).splitlines() if line.startswith("| `")}


def _with_values_table(text: str, table: str) -> str:
    head, _, rest = text.partition(VALUES_BEGIN)
    _, _, tail = rest.partition(VALUES_END)
    return head + table + tail


# ------------------------------------------------------------------------------------------------ checker

_CODE = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_METRIC = re.compile(r"\bwarmroute_[a-z0-9_]+")
_CONFIG_KEY = re.compile(r"(routing|health|warm|pins|profile|brain|envoy|discovery|shared_state)\.([a-z_]+)(?::.*)?")
# names that look like config keys and are not: the endpoint-picker protocol's metadata namespaces
NOT_CONFIG_KEYS = {"envoy.lb"}


def _not_metrics() -> set[str]:
    """Names that look like metrics but are not: the simulator's policy rows, the live and real benchmarks'
    contenders and Envoy's own clusters."""
    from bench.contenders import WARMROUTE
    from bench.runs.real import WARMROUTE_ROWS
    from extproc.contract import BRAIN_CLUSTER, FALLBACK_CLUSTER, PICKER_CLUSTER
    from extproc.core.policy import POLICIES
    from extproc.tools.sim.policies import POLICIES as SIMULATED

    return ({f"warmroute_{p}" for p in POLICIES} | set(WARMROUTE) | set(WARMROUTE_ROWS) | set(SIMULATED)
            | {BRAIN_CLUSTER, FALLBACK_CLUSTER, PICKER_CLUSTER})


NOT_METRICS = _not_metrics()


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def make_targets(root: Path = ROOT) -> set[str]:
    text = (root / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([a-z][a-z0-9-]*):", text, re.M)}


def exported_metrics() -> set[str]:
    """Every metric family name the brain exports (counters as Prometheus names them, without _total)."""
    from extproc.brain.metrics import metric_names

    return metric_names()


def alert_names(root: Path = ROOT) -> list[str]:
    import yaml

    doc = yaml.safe_load((root / "extproc" / "ops" / "alerts.yaml").read_text())
    return [r["alert"] for g in doc["groups"] for r in g["rules"] if "alert" in r]


def _flags_of(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {"": {s for a in parser._actions for s in a.option_strings}}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[name] = {s for a in sub._actions for s in a.option_strings}
    return out


def check_text(text: str, where: str, *, targets: set[str], flags: dict[str, set[str]], keys: set[str],
               metrics: set[str], root: Path | None = None, base: Path | None = None) -> list[str]:
    """Problems with one document: names it mentions that do not exist, links that do not resolve."""
    bad = []
    for span in _CODE.findall(text):
        words = span.split()
        if len(words) >= 2 and words[0] == "make" and re.fullmatch(r"[a-z][a-z0-9-]*", words[1]) \
                and words[1] not in targets:
            bad.append(f"{where}: `{span}`: no make target {words[1]!r}")
        if words and words[0] == "warmroute" and len(words) >= 2 and not words[1].startswith("-"):
            sub = words[1]
            if sub not in flags:
                bad.append(f"{where}: `{span}`: no warmroute subcommand {sub!r}")
                continue
            for w in words[2:]:
                flag = w.split("=")[0]
                if flag.startswith("--") and flag not in flags[sub]:
                    bad.append(f"{where}: `{span}`: warmroute {sub} has no flag {flag}")
        m = _CONFIG_KEY.fullmatch(words[0]) if words else None
        if m and f"{m.group(1)}.{m.group(2)}" not in keys and words[0] not in NOT_CONFIG_KEYS:
            bad.append(f"{where}: `{span}`: no config key {m.group(1)}.{m.group(2)}")
    for name in set(_METRIC.findall(text)):
        if name in NOT_METRICS:
            continue
        family = re.sub(r"_(total|bucket|count|sum)$", "", name)
        if name not in metrics and family not in metrics:
            bad.append(f"{where}: metric {name} is not exported by the brain")
    if root is not None and base is not None:
        for link in _LINK.findall(text):
            if re.match(r"[a-z]+:", link) or link.startswith("#"):
                continue
            target = (base / link.split("#")[0]).resolve()
            if not target.exists():
                bad.append(f"{where}: link {link} does not resolve")
    return bad


def check_docs(parser: argparse.ArgumentParser, root: Path = ROOT, metrics: set[str] | None = None) -> list[str]:
    """Every problem with the documents under ``root`` (none: they match the code); ``parser`` is the
    ``warmroute`` command's (passed in: this instrument does not import the command that imports it)."""
    targets, flags, keys = make_targets(root), _flags_of(parser), config_keys() | chart_values(root)
    metrics = exported_metrics() if metrics is None else metrics
    bad: list[str] = []
    documented: set[str] = set()
    for path in doc_files(root):
        text = path.read_text()
        documented |= {re.sub(r"_(total|bucket|count|sum)$", "", m) for m in _METRIC.findall(text)}
        bad += check_text(text, str(path.relative_to(root)), targets=targets, flags=flags, keys=keys, metrics=metrics,
                          root=root, base=path.parent)
    for name in sorted(metrics - documented):
        bad.append(f"metric {name} is exported by the brain but no document names it")
    ops = (root / "docs" / "operations.md").read_text()
    for alert in alert_names(root):
        if f"### {alert}" not in ops:
            bad.append(f"alert {alert} has no runbook (### {alert}) in docs/operations.md")
    cfg = root / CONFIG_DOC
    if not cfg.exists() or cfg.read_text() != config_reference():
        bad.append(f"{CONFIG_DOC} is stale: run `make docs`")
    if (root / VALUES_SCHEMA).read_text() != values_schema(root):
        bad.append(f"{VALUES_SCHEMA} is stale: run `make docs`")
    k8s = (root / K8S_DOC).read_text()
    if VALUES_BEGIN not in k8s or _with_values_table(k8s, values_table(root)) != k8s:
        bad.append(f"{K8S_DOC}'s values table is stale: run `make docs`")
    return bad


def main(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make docs",
                                 description="write docs/configuration.md, then check every document")
    ap.add_argument("--check", action="store_true", help="only check; write nothing")
    args = ap.parse_args(argv)
    if not args.check:
        (ROOT / CONFIG_DOC).write_text(config_reference())
        (ROOT / VALUES_SCHEMA).write_text(values_schema())
        k8s = ROOT / K8S_DOC
        if VALUES_BEGIN in k8s.read_text():
            k8s.write_text(_with_values_table(k8s.read_text(), values_table()))
        print(f"wrote {CONFIG_DOC}, {VALUES_SCHEMA}, {K8S_DOC}'s values table")
    bad = check_docs(parser)
    for line in bad:
        print(line)
    return 1 if bad else 0


# run by `make docs`: python -c "from extproc.cli import build_parser; ..." (see the Makefile)
