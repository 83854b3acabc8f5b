"""``--keras-coverage``/``--keras-coverage-diff``: which lines of the build the matrix ran, and
which changed lines it did not, on a git checkout with a known change."""

from __future__ import annotations

import json
import shutil
import subprocess

from tests.mutants import Patch
from tests.test_mutants import run_suite

RUN = Patch("keras/src/backend/torch/trainer.py",
            "            # Update weights\n            with torch.no_grad():\n",
            "            # Update weights\n            kdc_changed_and_run = 1  # noqa: F841\n            with torch.no_grad():\n")
NEVER_CALLED = "\n\ndef kdc_changed_never_called():\n    return 'no cell calls this'\n"
LIB = "keras/src/backend/torch/distribution_lib.py"
CELL = "conformance/test_fit.py::test_fit[sgd-arrays-nojit-colshard]"


def git(tree, *args) -> str:
    return subprocess.run(["git", "-C", str(tree), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True, text=True).stdout


def test_changed_lines_that_ran_and_that_did_not(keras_nightly_tree, tmp_path):
    tree = tmp_path / "keras-checkout"
    shutil.copytree(keras_nightly_tree, tree)
    git(tree, "init", "-q")
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "-m", "the build as released")
    trainer = tree / RUN.path
    trainer.write_text(trainer.read_text().replace(RUN.old, RUN.new, 1))
    lib = tree / LIB
    lib.write_text(lib.read_text() + NEVER_CALLED)
    never_run = len(lib.read_text().splitlines())  # the `return` line, last of the file
    changed_run = next(i for i, line in enumerate(trainer.read_text().splitlines(), 1) if "kdc_changed_and_run" in line)

    out = tmp_path / "cov"
    verdicts = run_suite(str(tree), ["--keras-coverage", str(out), "--keras-coverage-diff", "HEAD", CELL], tmp_path)
    assert verdicts == {"test_fit[sgd-arrays-nojit-colshard]": "pass"}
    report = json.loads((tmp_path / "report.json").read_text())
    diff = report["keras_diff_coverage"]
    # Changed statements: the trainer's line (ran), the new function's def (ran at import), its return (not).
    assert (diff["changed_statements"], diff["covered"]) == (3, 2), diff
    assert diff["uncovered"] == {LIB: [never_run]}
    assert changed_run not in diff["uncovered"].get(RUN.path, [])
    summary = report["keras_coverage"]
    assert summary["files"][RUN.path]["covered"] > 0
    assert (out / "html" / "index.html").is_file() and (out / "coverage.json").is_file()
    assert not list(out.glob(".coverage.*"))  # combined into one data file


def test_nothing_measured_is_said_not_raised(tmp_path):
    """A session whose ranks measured nothing (every cell skipped, or ranks under torchrun):
    coverage has no report to write, and the run says why instead of failing at its end."""
    from keras_dtensor_conformance.report import coverage as keras_coverage

    (tmp_path / "keras" / "src").mkdir(parents=True)
    summary = keras_coverage.combine_and_report(str(tmp_path / "cov"), str(tmp_path), ["keras/src"])
    assert (summary["statements"], summary["files"]) == (0, {})
    assert keras_coverage.summary_lines(summary, None, verbose=False) == [
        "keras coverage: nothing measured: no spawned rank or reference of this session imported keras/src "
        "(ranks under torchrun are not measured)"]
