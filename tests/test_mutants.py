"""Proof that the suite catches real bugs: each mutant build gets exactly the verdicts it must.

Every mutant (tests/mutants.py) is the default build with one bug put back in, run through the
suite with --keras-path on a small tier of cells. The cells the bug reaches must get the named
verdict and every other cell of the tier must still pass: no collateral noise. The unmutated
build passes the same tier, but for its own bugs that a correct rewrite's tier holds
(``mutants.UNMUTATED_FAILS``). ``--mutants-tier default`` runs each mutant on the whole default tier
instead, and reports how many verdicts changed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests import mutants

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAUGHT: dict[str, bool] = {}


def run_suite(keras_path: str, cells, out, rank_timeout: int = 300) -> dict[str, str]:
    """Run ``cells`` against the build at ``keras_path``; return verdict per cell name."""
    report = str(out / "report.json")
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--keras-path", keras_path,
           "--rank-timeout", str(rank_timeout), "--conformance-json", report, *cells]
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert os.path.exists(report), proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(report) as f:
        return {c["id"]: c["verdict"] or "skipped" for c in json.load(f)["cells"]}


def tier(request, case: mutants.Case):
    if request.config.getoption("mutants_tier") == "default":
        return ["conformance"]
    return list(case.tier)


def test_unmutated_build_passes_the_mutant_tier(keras_nightly_tree, tmp_path):
    tier = mutants.unmutated_tier()
    verdicts = run_suite(keras_nightly_tree, tier, tmp_path)
    assert len(verdicts) == len(tier)
    assert {c: v for c, v in verdicts.items() if v != "pass"} == mutants.UNMUTATED_FAILS


@pytest.mark.parametrize("case", mutants.CASES, ids=[c.mutant.name for c in mutants.CASES])
def test_mutant_gets_exactly_its_verdicts(case, keras_nightly_tree, tmp_path, request):
    build = mutants.write_mutant(keras_nightly_tree, str(tmp_path / case.mutant.name), case.mutant)
    verdicts = run_suite(build, tier(request, case), tmp_path, case.rank_timeout)
    if case.expected:  # a correct rewrite (nothing expected to change) is no mutant to catch
        CAUGHT[case.mutant.name] = all(verdicts.get(cell) == v for cell, v in case.expected.items())
    for cell, want in case.expected.items():
        assert verdicts.get(cell) == want, f"{case.mutant.name} ({case.mutant.imitates}): {cell}"
    if request.config.getoption("mutants_tier") != "default":
        collateral = {c: v for c, v in verdicts.items() if c not in case.expected and v != "pass"}
        assert collateral == {}, f"{case.mutant.name} changed cells it should not reach"
        assert len(verdicts) == len(case.tier)
    else:
        changed = sum(v != "pass" for v in verdicts.values())
        print(f"{case.mutant.name}: {changed} of {len(verdicts)} default-tier cells do not pass")


def mutation_score() -> str | None:
    if not CAUGHT:
        return None
    return f"mutation score: {sum(CAUGHT.values())}/{len(CAUGHT)} mutants caught with the right verdict"


def test_a_mutant_tree_runs_its_patch_not_the_source_trees_bytecode(tmp_path):
    """write_mutant hard-links the source tree's bytecode (so no process compiles all of Keras
    again) and drops the patched module's, whose stale bytecode would otherwise run the original:
    with PYTHONDONTWRITEBYTECODE set, nothing rewrites it."""
    import compileall

    source = tmp_path / "source"
    (source / "pkg").mkdir(parents=True)
    (source / "pkg" / "__init__.py").write_text("")
    (source / "pkg" / "mod.py").write_text("VALUE = 'original'\n")
    (source / "pkg" / "other.py").write_text("VALUE = 'untouched'\n")
    compileall.compile_dir(str(source), quiet=2)
    mutant = mutants.Mutant(name="m", imitates="a test",
                            patches=(mutants.Patch("pkg/mod.py", "'original'", "'patched!'"),))
    dest = mutants.write_mutant(str(source), str(tmp_path / "dest"), mutant)
    # The same size and mtime as the source: a stale .pyc would pass Python's own check and run.
    stat = os.stat(source / "pkg" / "mod.py")
    os.utime(os.path.join(dest, "pkg", "mod.py"), ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.path.exists(os.path.join(dest, "pkg", "__pycache__")) and not any(
        name.startswith("mod.") for name in os.listdir(os.path.join(dest, "pkg", "__pycache__")))
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": dest}
    out = subprocess.run([sys.executable, "-c", "import pkg.mod, pkg.other; print(pkg.mod.VALUE, pkg.other.VALUE)"],
                         env=env, capture_output=True, text=True, cwd=tmp_path).stdout.split()
    assert out == ["patched!", "untouched"]
    assert open(source / "pkg" / "mod.py").read() == "VALUE = 'original'\n"  # the hard link was broken
