"""Every dotted name a document, a docstring or a printed header gives for something of ours imports: a function,
class or constant named with the module path it lived at before a move (``sim.measure.window_numbers`` after it
went to ``tools/workload/measure.py``) is caught here."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILE_ENDINGS = {"yaml", "yml", "json", "md", "py", "txt", "toml", "lua", "bin", "log"}
REF = re.compile(r"`{1,2}([a-z_][a-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?:\(\))?`{1,2}")


def _modules() -> dict[str, ast.Module]:
    out = {}
    for base in ("extproc", "bench"):
        for p in (ROOT / base).rglob("*.py"):
            rel = p.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
            out[".".join(parts)] = ast.parse(p.read_text())
    return out


def _defined(mods: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Each top-level function, class and constant -> the modules that define or import it."""
    names: dict[str, set[str]] = {}
    for path, tree in mods.items():
        for node in tree.body:
            found: list[str] = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found = [node.name]
            elif isinstance(node, ast.Assign):  # constants: a variable's name is too often a config key's
                found = [t.id for t in node.targets if isinstance(t, ast.Name) and t.id.isupper()]
            for n in found:
                names.setdefault(n, set()).add(path)
    for path, tree in mods.items():
        for node in tree.body:  # what a module imports it also offers
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if (a.asname or a.name) in names:
                        names[a.asname or a.name].add(path)
    return names


def _config_sections() -> set[str]:
    """The config file's section and key names (``shared_state.brain_id`` is a setting, not a module)."""
    import dataclasses

    from extproc.config import AppConfig

    out: set[str] = set()
    todo = [AppConfig]
    while todo:
        cls = todo.pop()
        for f in dataclasses.fields(cls):
            out.add(f.name)
            t = f.default_factory if f.default_factory is not dataclasses.MISSING else None  # type: ignore[misc]
            if t is not None and dataclasses.is_dataclass(t):
                todo.append(t)  # type: ignore[arg-type]
    return out


def _texts():
    for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        yield p, p.read_text()
    for base in ("extproc", "bench"):
        for p in sorted((ROOT / base).rglob("*.py")):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    yield p, node.value


def _ours(first: str, mods: dict[str, ast.Module]) -> bool:
    if any(m == first or m.endswith("." + first) or m.startswith(first + ".") for m in mods):
        return True
    try:
        return importlib.util.find_spec(first) is None  # not a library: a name of ours, or of nothing
    except (ImportError, ValueError):
        return True


def stale_names() -> list[str]:
    mods = _modules()
    defined = _defined(mods)
    sections = _config_sections()
    bad = set()
    for where, text in _texts():
        for ref in REF.findall(text):
            parts = ref.split(".")
            if parts[-1] in FILE_ENDINGS:
                continue
            name, module = parts[-1], ".".join(parts[:-1])
            if name not in defined or not _ours(parts[0], mods) or parts[0] in sections:
                continue  # not a top-level name of ours (a config key, a method, a library's)
            if not any(m == module or m.endswith("." + module) for m in defined[name]):
                bad.add(f"{where.relative_to(ROOT)}: {ref}")
    return sorted(bad)


def test_every_dotted_name_of_ours_in_a_document_docstring_or_header_imports():
    assert stale_names() == []


def test_a_name_given_with_a_module_it_no_longer_lives_in_is_caught(monkeypatch):
    import sys

    mod = sys.modules[__name__]
    monkeypatch.setattr(mod, "_texts", lambda: iter([(ROOT / "README.md", "see ``sim.measure.window_numbers``")]))
    assert stale_names() == ["README.md: sim.measure.window_numbers"]
    monkeypatch.setattr(mod, "_texts", lambda: iter([(ROOT / "README.md", "see ``measure.window_numbers``")]))
    assert stale_names() == []
