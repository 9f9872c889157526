"""What ``pip install warmroute`` and the image carry: the product and what a user runs, nothing only the repository
runs (issue 44). Built offline from a copy of the sources, as a fresh clone builds it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# what only the repository runs: benchmarks, chaos, soak, hostile probes, fixture capture, the peers' launchers
NEVER = ("bench", "chaos", "soak", "probe", "hostile", "capture", "contenders", "harness", "sglang", "vllm_router")


def test_the_wheel_carries_the_product_and_what_users_run_and_no_benchmark(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for tree in ("extproc", "bench"):  # bench/ beside the package, as in the repository: it must stay out
        shutil.copytree(ROOT / tree, src / tree, ignore=ignore)
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                        "--disable-pip-version-check", "--wheel-dir", str(tmp_path / "out"), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    [wheel] = (tmp_path / "out").glob("warmroute-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    modules = [n for n in names if n.endswith(".py")]
    assert all(n.startswith("extproc/") for n in modules), [n for n in modules if not n.startswith("extproc/")]
    assert not [n for n in modules if any(w in n for w in NEVER)], [n for n in modules if any(w in n for w in NEVER)]
    # the product, and each room a user runs (warmroute mock-vllm, sim, up, top, demo-core)
    for need in ("extproc/brain/brain.py", "extproc/core/router.py", "extproc/tools/mock/vllm.py",
                 "extproc/tools/sim/simulator.py", "extproc/tools/stack/up.py", "extproc/tools/stack/top.py",
                 "extproc/tools/engine/model.py", "extproc/tools/workload/generate.py", "extproc/tools/demo_core.py"):
        assert need in names, need
