"""``--conformance-slice K/N`` (issue 42, item 2): every collected cell in exactly one slice, the
same plan in every slice's session, slices balanced by the recorded durations, a new cell placed by
its family's mean; bad input one line."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from keras_dtensor_conformance.slicing import durations, estimate

from tests.slice_dump import collected

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_plan_is_a_partition_longest_first():
    estimated = {"a": 5.0, "b": 4.0, "c": 3.0, "d": 3.0, "e": 1.0}
    slices = estimate.plan(estimated, 2)
    assert slices == [["a", "d"], ["b", "c", "e"]]  # 5+3 and 4+3+1, each in the order given
    assert sorted(c for s in slices for c in s) == sorted(estimated)
    assert estimate.plan(estimated, 2) == slices and estimate.plan(estimated, 9)[5:] == [[], [], [], []]


def test_a_new_cell_takes_its_familys_mean():
    cells = [("fit-jit-1", "fit|jit"), ("fit-jit-2", "fit|jit"), ("fit-jit-new", "fit|jit"), ("op-1", "op|eager"),
             ("other-new", "scenario|"), ("mesh-2x2", estimate.SKIPPED), ("fit-grain", "fit|jit")]
    recorded = {"fit-jit-1": 20.0, "fit-jit-2": 30.0, "op-1": 0.1, "gone": 99.0, "mesh-2x2": 5.0, "fit-grain": 0.0}
    assert estimate.estimates(cells, recorded) == {"fit-jit-1": 20.0, "fit-jit-2": 30.0, "fit-jit-new": 25.0,
                                                   "op-1": 0.1, "other-new": (20 + 30 + 0.1 + 99 + 5) / 5,
                                                   "mesh-2x2": 0.0,  # marked to skip here: no time
                                                   "fit-grain": 0.0}  # recorded as skipped, out of the means


def test_a_refresh_records_what_ran_and_what_skipped(tmp_path):
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"cells": [
        {"nodeid": "a", "outcome": "passed", "duration": 1.23456}, {"nodeid": "b", "outcome": "skipped", "duration": 0.01},
        {"nodeid": "c", "outcome": "interrupted", "duration": 0.5}, {"nodeid": "d", "outcome": "xfailed", "duration": 2}]}))
    output = tmp_path / "durations.json"
    output.write_text(json.dumps({"cells": {"c": 7.0, "b": 3.0}}))
    assert durations.refresh([str(report)], str(output)) == (4, [(str(report), 1.0, 0)])  # nothing shared to scale by
    assert estimate.read_durations(str(output)) == {"a": 1.235, "b": 0.0, "c": 7.0, "d": 2.0}


def test_a_refresh_records_a_slower_run_in_the_files_seconds(tmp_path):
    """A slice run on a loaded machine (1.5 times slower here) adds its new cells in the file's
    seconds, measured on the cells both have; its shared cells keep their figures. Below MIN_SHARED
    cells, or with --no-scale, the seconds are recorded as they ran."""
    shared = {f"old-{i}": 1.0 + i / 10 for i in range(durations.MIN_SHARED)}
    output = tmp_path / "durations.json"
    output.write_text(json.dumps({"cells": {**shared, "zero": 0.0}}))
    ran = [{"nodeid": n, "outcome": "xfailed" if i % 3 else "passed", "duration": 1.5 * s}
           for i, (n, s) in enumerate(shared.items())]
    ran += [{"nodeid": "new", "outcome": "failed", "duration": 30.0}, {"nodeid": "zero", "outcome": "passed", "duration": 9.0}]
    report = tmp_path / "slice.json"
    report.write_text(json.dumps({"cells": ran}))
    count, [(_, factor, common)] = durations.refresh([str(report)], str(output))
    assert (count, round(factor, 6), common) == (durations.MIN_SHARED + 2, 1.5, durations.MIN_SHARED)
    written = estimate.read_durations(str(output))
    assert written["new"] == 20.0 and written["zero"] == 6.0
    assert all(written[n] == pytest.approx(s, abs=1e-3) for n, s in shared.items())

    output.write_text(json.dumps({"cells": {**shared}}))
    proc = subprocess.run([sys.executable, "-m", "keras_dtensor_conformance.slicing", str(report), "--output",
                           str(output), "--no-scale"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and "recorded as it ran (--no-scale)" in proc.stdout, proc.stdout + proc.stderr
    assert estimate.read_durations(str(output))["new"] == 30.0

    output.write_text(json.dumps({"cells": dict(list(shared.items())[1:])}))  # one cell short of measuring a speed
    assert durations.refresh([str(report)], str(output))[1][0][1:] == (1.0, durations.MIN_SHARED - 1)
    assert estimate.read_durations(str(output))["new"] == 30.0


@pytest.mark.parametrize("spec", ["0/3", "4/3", "1/0", "two/3", "1-3"])
def test_a_bad_slice_is_one_line(spec):
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
                           f"--conformance-slice={spec}", "conformance/test_setup.py"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 4
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert errors == [f"ERROR: --conformance-slice {spec}: expected K/N with 1 <= K <= N (e.g. 2/8)"], proc.stderr


def test_slices_of_a_selection_are_its_cells_each_once(tmp_path):
    """Sessions' own collections: the three slices of a -k selection together are the selection."""
    selection = ["conformance/test_ops.py", "conformance/test_fit.py", "-k", "add or multiply or sgd-arrays"]
    whole = [c for c, _ in collected(tmp_path, *selection)]
    parts = [[c for c, _ in collected(tmp_path, *selection, f"--conformance-slice={k}/3")] for k in (1, 2, 3)]
    assert len(whole) >= 60 and all(parts)
    assert sorted(c for part in parts for c in part) == sorted(whole)
    assert all(part == [c for c in whole if c in part] for part in parts)  # collection order kept


def test_full_in_eight_slices_balanced_by_the_recorded_durations(tmp_path):
    """Every cell of --full in exactly one of 8 slices, their estimated times within 15 % of each
    other, from the durations file in the repository."""
    cells = [tuple(c) for c in collected(tmp_path, "--full", "conformance")]
    assert len(cells) > 5000
    # The 2x2-mesh cells, which skip at --nproc 2, are planned as taking no time.
    mesh = {c for c, family in cells if family == estimate.SKIPPED}
    assert mesh and all("batchxmodel" in c or "2x2" in c or "mesh" in c for c in mesh), sorted(mesh)[:5]
    recorded = estimate.read_durations(str(ROOT / estimate.DEFAULT_DURATIONS))
    estimated = estimate.estimates(cells, recorded)
    slices = estimate.plan(estimated, 8)
    assert sorted(c for s in slices for c in s) == sorted(estimated)
    totals = [sum(estimated[c] for c in s) for s in slices]
    assert max(totals) <= 1.15 * min(totals), totals
