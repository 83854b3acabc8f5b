"""The tree shows the roles, and the rank side keeps to itself.

As pytest-xdist keeps ``remote.py`` (what runs in a worker) free of the rest of xdist, the code
that runs in a rank process (``fixtures/rank/`` and the suite's ``conformance/ranks/``) imports
nothing from the controller side or the report: a rank needs only itself, torch and the build.
And the suite (``conformance/``) uses the plugin only through the names its package exports.
"""

from __future__ import annotations

import ast
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import keras_dtensor_conformance
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "keras_dtensor_conformance"
#: What a rank may not import: the pytest process's side of the ranks (pools, session, plugin), the
#: report, and the suite's fixtures that drive pools. The suite's judge is not among them: its checks
#: are pure functions of evidence, which the reproducer scripts run on their ranks too.
CONTROLLER_SIDE = (f"{PACKAGE}.controller", f"{PACKAGE}.report", f"{PACKAGE}.bench.plugin", f"{PACKAGE}.plugin",
                   f"{PACKAGE}.session", "conformance.conftest", "conformance.reference", "conformance.test_")


def imported_modules(path: pathlib.Path) -> list[tuple[int, str]]:
    """Every module an import statement of ``path`` names (anywhere in the file, lazy imports too),
    with ``from PKG import name`` counted as ``PKG.name`` (it may be a submodule)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def violations(files: list[pathlib.Path], forbidden: tuple[str, ...]) -> list[str]:
    return [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{line} imports {name}"
            for path in files for line, name in imported_modules(path)
            if any(name == f or name.startswith(f if f.endswith("_") else f + ".") for f in forbidden)]


def rank_side_files() -> list[pathlib.Path]:
    return sorted([*(ROOT / "fixtures" / "rank").glob("*.py"), *(ROOT / "conformance" / "ranks").glob("*.py")])


def test_the_rank_side_imports_nothing_from_the_controller_side():
    assert rank_side_files(), "no rank-side modules found: the layout changed"
    assert violations(rank_side_files(), CONTROLLER_SIDE) == []


def test_the_check_sees_a_forbidden_import(tmp_path):
    """The check itself can fail: a rank module with a lazy import of the pool is caught."""
    bad = tmp_path / "worker.py"
    bad.write_text("def f():\n    from keras_dtensor_conformance.controller.rank_pool import RankPool\n")
    assert violations([bad], CONTROLLER_SIDE) == [
        f"{bad}:2 imports {PACKAGE}.controller.rank_pool", f"{bad}:2 imports {PACKAGE}.controller.rank_pool.RankPool"]


@pytest.mark.parametrize("path", sorted((ROOT / "conformance").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_suite_uses_only_the_plugins_public_names(path):
    """``conformance/`` imports ``from keras_dtensor_conformance import NAME`` with NAME in ``__all__``:
    no submodule, no private name (the public contract between the plugin and the suite)."""
    bad = []
    for line, name in imported_modules(path):
        if not name.startswith(PACKAGE):
            continue
        leaf = name[len(PACKAGE) + 1:]
        if name != PACKAGE and leaf not in keras_dtensor_conformance.__all__:
            bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert bad == []


def judge_files() -> list[pathlib.Path]:
    """The judge (evidence -> verdict), the promises, and the cell data both sides share."""
    return sorted([*(ROOT / "conformance" / "judge").glob("*.py"), ROOT / "conformance" / "promises.py",
                   ROOT / "conformance" / "cell_data.py"])


def test_the_judge_imports_no_rank_code():
    """The judge reads evidence; what it shares with the rank side (the cell's data, the mesh
    geometry) lives in ``conformance/cell_data.py``, neither side's module."""
    assert violations(judge_files(), ("conformance.ranks",)) == []


def test_a_rank_reading_the_judges_constants_imports_neither_pytest_nor_every_check():
    """Rank code reads a few constants of the judge's modules (``slots.factored_shapes``,
    ``agreement.DECISION_PREFIX``): the package itself imports nothing, so a fresh rank's first
    fit does not import pytest and every check (0.1 to 0.14 s of it, in each rank of each start)."""
    code = ("import sys\nimport conformance.judge.slots, conformance.judge.agreement\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pytest', '_pytest')"
            " or m == 'conformance.judge.cells'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "KERAS_BACKEND": "torch"})
    assert proc.stdout.strip() == "[]"


#: The longest a module of the project may get: past it, a module holds more than one role.
MAX_MODULE_LINES = 450


def test_no_module_of_the_plugin_the_suite_the_scripts_or_the_tests_is_over_450_lines():
    files = [p for folder in ("fixtures", "conformance", "scripts", "tests") for p in (ROOT / folder).rglob("*.py")]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_the_wheel_installs_every_package_of_fixtures_and_nothing_else(tmp_path):
    """setup.py finds the plugin's packages in ``fixtures/``: a sub-package added there installs with
    no list to update (proven with one made here, in a copy of the tree), and the wheel holds the
    plugin only: no CI helper, no tests, no suite."""
    for name in ("pyproject.toml", "setup.py", "README.md"):
        (tmp_path / name).write_bytes((ROOT / name).read_bytes())
    shutil.copytree(ROOT / "fixtures", tmp_path / "fixtures", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "fixtures" / "added").mkdir()
    (tmp_path / "fixtures" / "added" / "__init__.py").write_text("")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                           str(tmp_path), "--wheel-dir", str(tmp_path / "dist")], capture_output=True, text=True,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    with zipfile.ZipFile(next((tmp_path / "dist").glob("*.whl"))) as wheel:
        files = {name for name in wheel.namelist() if ".dist-info/" not in name}
    expected = {f"{PACKAGE}/{path.relative_to(tmp_path / 'fixtures').as_posix()}"
                for path in (tmp_path / "fixtures").rglob("*") if path.suffix in (".py", ".html")}
    assert f"{PACKAGE}/added/__init__.py" in expected
    assert files == expected
