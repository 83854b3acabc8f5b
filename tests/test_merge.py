"""Merging slices' reports (issue 42, item 3): the merge recomputes what a run computes over all its
cells, and refuses, in one line, reports that are not the N slices of one selection, build and set
of options. The equality with a real whole run is ``test_fresh_verdicts.
test_three_slices_merge_into_the_whole_runs_report``; these build the slices' reports with the
report's own code from cell records, in milliseconds."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from keras_dtensor_conformance.hookspec import Promise
from keras_dtensor_conformance.report import merge, results
from keras_dtensor_conformance.report.expectations import Expectations
from keras_dtensor_conformance.report.plugin import run_options
from keras_dtensor_conformance.report.recorder import CellRecord

#: id: (verdict, outcome, expected, text)
CELLS = {
    "test_op[add-eager]": ("pass", "passed", None, ""),
    "test_op[sub-eager]": ("pass", "passed", None, ""),
    "test_op[add-compiled]": ("compile-fallback", "xfailed", "compile-fallback", "dynamo compiled 0 graphs"),
    "test_op[sub-compiled]": ("compile-fallback", "xfailed", "compile-fallback", "dynamo compiled 0 graphs"),
    "test_fit[sgd-colshard]": ("mixed-tensor", "failed", None, "got mixed torch.Tensor and DTensor"),
    "test_fit[adam-colshard]": ("pass", "passed", None, ""),
    "test_setup[mesh]": (None, "skipped", None, ""),
}
EXPECTATIONS = """\
# one cause for every compiled op
test_op[*-compiled]  compile-fallback  /compiled 0 graphs/  the promotion mode stops dynamo
test_op[*-eager]  mixed-tensor  /mixed/  fixed since: every eager op passes
"""
PROMISES = [
    Promise("ops", "numpy-style ops accept DTensors", tests=lambda c: c["family"] == "op",
            breaks=("mixed-tensor",)),
    Promise("compile", "compiled code runs on DTensors", tests=lambda c: "compiled" in c["id"],
            breaks=("compile-fallback",)),
    Promise("optimizers", "optimizers update sharded weights", tests=lambda c: c["family"] == "fit",
            breaks=("mixed-tensor",)),
]
BUILD = {"keras_path": "/k", "keras_version": "3.16.0", "git_commit": None, "torch_version": "2.13.0+cpu",
         "python_version": "3.11.7", "backend": "gloo", "nproc": 2}


class Options:
    full, conformance_seed, conformance_strict, require_distribution, rerun_crashes = False, 0, True, False, 1
    rank_start, isolation, rank_timeout, reference_keras_path, dist_backend = "fork", "checked", 60.0, None, "auto"


def report_of(ids: list[str], tmp_path, slice_=None, build=BUILD) -> dict:
    """The report a session that ran ``ids`` would write, by the report's own code."""
    expect = tmp_path / "expect.txt"
    expect.write_text(EXPECTATIONS)
    expectations = Expectations(str(expect), None, strict=True, torch_version="2.13.0")
    expectations.check_collected(set(CELLS))
    records, verdicts = [], {}
    for cell in ids:
        verdict, outcome, expected, text = CELLS[cell]
        family = cell.split("[")[0].removeprefix("test_")
        records.append(CellRecord(cell, f"conformance/x.py::{cell}", family, "row", "col", {}, verdict, outcome,
                                  expected, text, text, duration=1.0))
        if verdict is not None:
            verdicts[cell] = (verdict, text)
    report = results.build_report(records, dict(build), 10.0, promises=PROMISES)
    report.update(collected=sorted(CELLS), run=run_options(Options), slice=slice_,
                  expectations=expectations.record("expect.txt", verdicts),
                  isolation={"mode": "checked", "starts": 1, "by cause": {"first start": 1}, "examples": {}})
    return report


def sliced(tmp_path, n=3) -> list[tuple[str, dict]]:
    selection = [f"conformance/x.py::{c}" for c in CELLS]
    ids = list(CELLS)
    return [(f"slice-{k}.json", report_of(ids[k - 1::n], tmp_path, {"k": k, "n": n, "selection": selection}))
            for k in range(1, n + 1)]


def judged(report: dict) -> dict:
    return {"cells": [(c["id"], c["verdict"], c["outcome"], c["expected"], c["promises"]) for c in report["cells"]],
            **{key: report[key] for key in ("summary", "promises", "unclaimed_failures", "clusters", "not_judged",
                                           "collected", "run", "expectations")}}


def test_the_merge_is_the_whole_runs_report(tmp_path):
    whole = report_of(list(CELLS), tmp_path)
    parts = sliced(tmp_path)
    # The eager glob decides cells of two slices: only the whole run sees that none fails its way.
    assert whole["expectations"]["no_longer_apply"] == ["test_op[*-eager]"]
    assert all(p["expectations"]["no_longer_apply"] == [] for _, p in parts)
    merged = merge.merge(list(reversed(parts)))  # in any order
    assert judged(merged) == judged(whole)
    assert [s["k"] for s in merged["slices"]] == [1, 2, 3] and merged["isolation"]["starts"] == 3
    assert merge.failing_because(merged, False) == [
        "1 cell failed or did not finish: test_fit[sgd-colshard]",
        "1 expectation entry no longer applies: each cell it decides ran and none failed as it expects "
        "(test_op[*-eager]) and --conformance-strict"]


def _set(path: str, value):
    def change(report: dict) -> None:
        *keys, last = path.split(".")
        target = report
        for key in keys:
            target = target[key]
        target[last] = value
    return change


@pytest.mark.parametrize("change, says", [
    (_set("build.torch_version", "2.12.0"), "slice 2/3 (slice-2.json) is of another build than slice 1/3 "
                                           "(slice-1.json): torch_version '2.12.0', not '2.13.0+cpu'"),
    (_set("run.rank_timeout", 5.0), "is of another set of options than slice 1/3 (slice-1.json): rank_timeout 5.0"),
    (_set("slice.selection", ["conformance/x.py::test_op[add-eager]"]), "is of another selection"),
    (_set("expectations.entries", []), "is of another expectations file"),
    (_set("slice.k", 1), "slice 1/3 is given 2 times (slice-1.json, slice-2.json)"),
    (_set("slice.n", 4), "is of another number of slices"),
    (_set("slice.plan", "0123456789abcdef"), "is of another slice plan (another durations file)"),
    (_set("slice", None), "slice-2.json: not a slice's report (its run had no --conformance-slice K/N)"),
    (_set("schema", "other"), "slice-2.json: not a keras-dtensor-conformance JSON report"),
], ids=["torch", "options", "selection", "expectations", "twice", "other-n", "other-plan", "not-a-slice",
        "not-a-report"])
def test_reports_that_are_not_one_runs_slices_are_refused(tmp_path, change, says):
    parts = sliced(tmp_path)
    change(parts[1][1])
    with pytest.raises(merge.MergeError) as refused:
        merge.merge(parts)
    assert says in str(refused.value)


def test_a_refusal_names_the_first_difference_not_both_whole(tmp_path):
    """An expectations record that differs in one entry's comment (a slice written by an older plugin)
    is refused in one short line naming that entry, not with both files' entries in full."""
    parts = sliced(tmp_path)
    parts[1][1]["expectations"]["entries"][0].append("# a comment the other slice's record lacks")
    with pytest.raises(merge.MergeError) as refused:
        merge.merge(parts)
    said = str(refused.value)
    assert said.endswith("another expectations file than slice 1/3 (slice-1.json): entries item 1 has 6 items, "
                         "not 5 (item 6: \"# a comment the other slice's record lacks\")"), said
    assert len(said) < 400 and "\n" not in said, said


def test_a_missing_slice_or_a_cell_run_twice_is_refused(tmp_path):
    parts = sliced(tmp_path)
    with pytest.raises(merge.MergeError, match="slice 3 of 3 missing"):
        merge.merge(parts[:2])
    parts[1][1]["cells"].append(parts[0][1]["cells"][0])
    with pytest.raises(merge.MergeError, match=r"test_op\[add-eager\] ran in two slices \(slice-1.json, slice-2.json\)"):
        merge.merge(parts)


def test_the_trees_place_and_pythons_patch_level_may_differ(tmp_path):
    """Slices of one build on other runners: another checkout path, another Python patch release."""
    parts = sliced(tmp_path)
    for k, (_, report) in enumerate(parts):
        report["build"]["keras_path"] = f"/runner{k}/keras"
        report["build"]["python_version"] = f"3.11.{k + 7}"
    assert merge.merge(parts)["summary"]["cells"] == len(CELLS)
    parts[2][1]["build"]["python_version"] = "3.12.1"
    with pytest.raises(merge.MergeError, match="python_version '3.12', not '3.11'"):
        merge.merge(parts)


def run_merge(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "keras_dtensor_conformance.report.merge", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_the_command_writes_the_reports_and_exits_as_the_run_would(tmp_path):
    for path, report in sliced(tmp_path):
        (tmp_path / path).write_text(json.dumps(report))
    previous = report_of(list(CELLS), tmp_path)
    previous["cells"][0]["verdict"] = "error"  # now a pass: a fix, not a regression
    (tmp_path / "previous.json").write_text(json.dumps(previous))
    proc = run_merge("slice-1.json", "slice-2.json", "slice-3.json", "--json", "m.json", "--md", "m.md",
                     "--html", "m.html", "--compare", "previous.json", "--fail-on-regression", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "keras-dtensor-conformance: 1 cell failed or did not finish: test_fit[sgd-colshard]: failing the " \
           "merged run" in proc.stdout
    merged = json.loads((tmp_path / "m.json").read_text())
    assert merged["compare"]["fixes"] == [{"id": "test_op[add-eager]", "old": "error", "new": "pass"}]
    assert "### Unexpected results (1)" in (tmp_path / "m.md").read_text()
    assert "<html" in (tmp_path / "m.html").read_text()


def test_the_command_fails_on_a_regression_only_when_asked(tmp_path):
    cells = dict(CELLS)
    cells["test_fit[sgd-colshard]"] = ("pass", "passed", None, "")
    cells["test_op[sub-eager]"] = ("mixed-tensor", "xfailed", "mixed-tensor", "got mixed")
    original = copy.deepcopy(CELLS)
    CELLS.update(cells)
    try:
        for path, report in sliced(tmp_path):
            (tmp_path / path).write_text(json.dumps(report))
    finally:
        CELLS.update(original)
    (tmp_path / "previous.json").write_text(json.dumps(report_of(list(CELLS), tmp_path)))
    slices = ("slice-1.json", "slice-2.json", "slice-3.json", "--compare", "previous.json")
    assert run_merge(*slices, cwd=tmp_path).returncode == 0
    failed = run_merge(*slices, "--fail-on-regression", cwd=tmp_path)
    assert failed.returncode == 1
    assert "1 regression against the compared report: test_op[sub-eager]" in failed.stdout


def test_cells_no_slice_reached_fail_the_merged_run(tmp_path):
    """A slice killed between two cells (its job's time limit) interrupted none of them: the cells it
    never reached are in no report, and the merge fails, naming them, as the whole run would have."""
    slices = sliced(tmp_path)
    whole = merge.merge(slices)
    assert whole["not_run"] == [] and not any("ran in no slice" in why for why in merge.failing_because(whole, False))
    last = slices[1][1]["cells"].pop()
    merged = merge.merge(slices)
    assert merged["not_run"] == [last["nodeid"]] and last["id"] not in [c["id"] for c in merged["cells"]]
    assert f"1 cell of the selection ran in no slice (a slice ended before them): {last['nodeid']}" in \
        merge.failing_because(merged, False)


def test_bad_input_is_one_line(tmp_path):
    (tmp_path / "broken.json").write_text("{")
    for args in (["broken.json"], ["absent.json"]):
        proc = run_merge(*args, cwd=tmp_path)
        assert proc.returncode == 2 and proc.stdout == ""
        assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(f"error: {args[0]}: cannot read")


def test_the_merged_run_writes_the_expectations_one_run_would(tmp_path):
    """``--update-expectations`` on the merge: the glob no cell fails any more is dropped (only the
    whole run knows), the new failure gets an entry, the entry that still fits stays."""
    from keras_dtensor_conformance.report.expectations_file import read

    merged = merge.merge(sliced(tmp_path))
    assert merge.update_expectations(merged, str(tmp_path / "new.txt")) == 2
    entries = {(e.cell, e.verdict, e.comments) for e in read(str(tmp_path / "new.txt"))}
    assert entries == {("test_op[*-compiled]", "compile-fallback", ("# one cause for every compiled op",)),
                       ("test_fit[sgd-colshard]", "mixed-tensor", ())}  # comments kept, as one run keeps them
