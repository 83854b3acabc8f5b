"""What a maintainer reads first (issue 41, item 6): the unexpected results open the Markdown job
summary and become GitHub ``::error`` annotations; the header names the versions that tell CI legs
apart. Built from synthetic records (tests/promise_records.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from keras_dtensor_conformance.report.annotations import annotation_lines, unexpected
from keras_dtensor_conformance.report.compare import compare_reports
from keras_dtensor_conformance.report.markdown import markdown
from keras_dtensor_conformance.report.results import build_report

from tests.promise_records import record

BANNER = {"keras_version": "3.16", "torch_version": "2.13.0+cpu", "python_version": "3.11.7",
          "numpy_version": "2.4.6", "jax_version": "0.10.2", "nproc": 2, "backend": "gloo"}


def expected(rec, verdict):
    rec.expected = verdict
    return rec


def reports():
    before = build_report([record("was-passing", "pass", "passed"), record("absorbed", "pass", "passed"),
                           record("fine", "pass", "passed")], BANNER, 1.0)
    after = build_report([
        record("was-passing", "numerics", "failed", "rank 0: step_losses: max abs difference 0.1\nmore"),
        record("absorbed", "crash", "xfailed", "rank 1 died"),  # expected now, but it passed last time
        record("fine", "pass", "passed"),
        record("fixed, strictly", "pass", "failed"),
        expected(record("other-way", "error", "failed", "boom: a, b"), "numerics"),
    ], BANNER, 1.0)
    after["compare"] = compare_reports(before, after)
    return after


def test_the_unexpected_results_are_each_listed_once():
    found = [(u["id"], u["kind"], u["verdict"]) for u in unexpected(reports())]
    assert found == [("was-passing", "new failure", "numerics"), ("fixed, strictly", "strict pass", "pass"),
                     ("other-way", "expected numerics", "error"), ("absorbed", "regression", "crash")]


def test_a_cell_without_a_verdict_is_unexpected_too():
    """A cell the session interrupted, and one a merge's slices never reached (``not_run``), failed the
    run as a failure does: the summary must say so, not only the merge's log."""
    cut = record("cut", None, "interrupted", "interrupted (KeyboardInterrupt)")
    report = build_report([record("fine", "pass", "passed"), cut], BANNER, 1.0)
    report["not_run"] = ["conformance/test_fit.py::test_fit[sgd-arrays-jit-dataparallel]"]
    assert [(u["id"], u["kind"], u["message"]) for u in unexpected(report)] == [
        ("cut", "interrupted", "interrupted (KeyboardInterrupt)"),
        ("test_fit[sgd-arrays-jit-dataparallel]", "not run", "its slice ended before this cell ran")]


def test_the_markdown_opens_with_them_and_the_versions():
    text = markdown(reports())
    assert "Python 3.11.7, numpy 2.4.6, JAX 0.10.2" in text
    first = text.index("### ")
    assert text[first:].startswith("### Unexpected results (4)")
    assert "| `absorbed` | regression | crash | pass in the previous run |" in text
    assert "### Unexpected results" not in markdown(build_report([record("fine", "pass", "passed")], BANNER, 1.0))


def test_annotations_are_github_error_commands_escaped(tmp_path):
    lines = annotation_lines(reports())
    assert lines[0] == "::error title=new failure%3A was-passing::numerics: rank 0: step_losses: max abs difference 0.1"
    assert lines[1] == "::error title=strict pass%3A fixed%2C strictly::pass: "
    path = tmp_path / "report.json"
    path.write_text(json.dumps(reports()))
    proc = subprocess.run([sys.executable, "-m", "keras_dtensor_conformance.report.annotations", str(path)],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.splitlines() == lines
