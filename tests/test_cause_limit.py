"""``--conformance-maxfail-per-cause N`` (``report/cause_limit.py``): once N cells of a family failed
with one cause, a later cell of that family made only of coordinates they had is not run, and every
view counts it as ``not run``; a cell with a value none of them had still runs; the default runs all."""

from __future__ import annotations

import json

import pytest
from keras_dtensor_conformance.report.cause_limit import would_repeat

# Cells judged in the controller (no rank needed): ops a and b fail with one cause on every mode,
# op c passes, op d fails with another; the family "g" fails with the first cause too.
CELLS = """
import pytest

from keras_dtensor_conformance import CellFailure

CELLS = [(family, op, mode) for family in ("f", "g") for op in ("a", "b", "c", "d") for mode in ("x", "y")]


@pytest.mark.parametrize("family,op,mode", [
    pytest.param(family, op, mode, id=f"{family}-{op}-{mode}",
                 marks=pytest.mark.cell(family=family, row=op, column=mode, op=op, mode=mode))
    for family, op, mode in CELLS])
def test_cell(family, op, mode):
    if op in ("a", "b"):
        raise CellFailure("error", "ValueError: the same broken thing")
    if op == "d":
        raise CellFailure("error", "KeyError: another broken thing")
"""


def run(inner, *args) -> tuple[dict[str, dict], dict, str]:
    inner.pytester.makepyfile(test_cells=CELLS)
    result = inner.run("-p", "no:randomly", "--conformance-json", "r.json", *args)
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads((inner.pytester.path / "r.json").read_text())
    return {c["id"].removeprefix("test_cell[").removesuffix("]"): c for c in report["cells"]}, report, result.stdout


def test_cells_that_would_only_repeat_a_cause_are_not_run_and_counted_apart(inner):
    cells, report, out = run(inner, "--conformance-maxfail-per-cause", "2")
    not_run = sorted(i for i, c in cells.items() if c["limited"])
    # f-a-x and f-a-y fail: 2 cells, op a, modes x and y; f-b-x has an op none had: it runs (and fails);
    # f-b-y is a combination of what failed. Family g counts its own cells: the same again.
    assert not_run == ["f-b-y", "g-b-y"]
    cause = "error | ValueError: the same broken thing | "
    assert {cells[i]["limited"] for i in not_run} == {cause}
    for i in not_run:
        assert (cells[i]["verdict"], cells[i]["outcome"], cells[i]["expected"]) == (None, "skipped", None)
        assert "not run: --conformance-maxfail-per-cause 2" in cells[i]["message"]
    # Another cause, and cells that pass, run whatever the first cause did.
    assert all(cells[f"{f}-{op}-{m}"]["verdict"] for f in "fg" for op in "cd" for m in "xy")
    assert report["summary"]["verdicts"] == {"error": 10, "not run": 2, "pass": 4}
    cluster = next(c for c in report["clusters"] if c["key"] == cause)
    assert (cluster["cells"], cluster["not_run"]) == (6, 2)
    assert "per-cause limit: 2 failed cells per cause and family" in out  # the header
    assert "2 more not run (per-cause limit)" in out  # the cause's line
    assert "2 not run" in out  # the counts
    assert "~=not run (per-cause limit)" in " ".join(out.split())  # the grids' legend (wrapped)


def test_by_default_every_cell_runs(inner):
    cells, report, out = run(inner)
    assert not any(c["limited"] for c in cells.values())
    assert report["summary"]["verdicts"] == {"error": 12, "pass": 4}
    assert "per-cause limit" not in out


@pytest.mark.parametrize("cell,repeats", [
    ({"family": "f", "op": "a", "mode": "y"}, True),
    ({"family": "f", "op": "b", "mode": "x"}, True),  # a new combination of values that failed
    ({"family": "f", "op": "c", "mode": "x"}, False),  # an op none of them had
    ({"family": "g", "op": "a", "mode": "x"}, False),  # another family
])
def test_a_cell_repeats_a_cause_only_with_values_its_failed_cells_had(cell, repeats):
    members = [{"family": "f", "axes": {"op": "a", "mode": "x"}}, {"family": "f", "axes": {"op": "b", "mode": "y"}}]
    assert would_repeat(members, cell) is repeats


def test_members_of_several_families_predict_nothing():
    members = [{"family": "f", "axes": {"op": "a"}}, {"family": "g", "axes": {"op": "a"}}]
    assert not would_repeat(members, {"family": "f", "op": "a"})
