"""The upstream kit (``upstream/``): what a Keras maintainer adds to keras-team/keras, held to its
sources (README's caller, the recorded run against Keras master, the plugin's writer and parser) and
to the checks Keras runs on its workflows (actionlint; zizmor, as Keras' zizmor.yml runs it)."""

from __future__ import annotations

import difflib
import pathlib
import shutil
import subprocess
import sys

import pytest

from tests.test_workflows import actionlint, tool, zizmor_findings

ROOT = pathlib.Path(__file__).resolve().parents[1]
UPSTREAM = ROOT / "upstream"
sys.path.insert(0, str(ROOT / "scripts"))
import kit_record
import upstream_kit

CALLER = UPSTREAM / upstream_kit.CALLER_PATH
EXPECTATIONS = UPSTREAM / upstream_kit.EXPECTATIONS_PATH
KERAS_MASTER = "3422977a5e38fb2f7709aaa9a08e47f0c43d0f60"


@pytest.fixture(scope="module")
def record() -> dict:
    return kit_record.load_record(upstream_kit.recorded_run(UPSTREAM))


def kit_script(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "upstream_kit.py"), *args],
                          capture_output=True, text=True, cwd=cwd, check=False)


def test_the_committed_kit_is_what_the_generator_writes_from_the_recorded_run():
    result = kit_script("--check")
    assert result.returncode == 0, result.stdout + result.stderr


def test_check_says_in_one_line_what_differs(tmp_path):
    """``--check`` can fail: an edited expectations file and a stray record are each named."""
    copy = tmp_path / "upstream"
    shutil.copytree(UPSTREAM, copy)
    edited = copy / upstream_kit.EXPECTATIONS_PATH
    edited.write_text(edited.read_text() + "test_fit[nothing]  numerics  made up\n")
    (copy / "run-0000000.json").write_text("{}")
    result = kit_script("--check", "--upstream", str(copy), "--from-run", str(upstream_kit.recorded_run(UPSTREAM)))
    assert result.returncode == 1, result.stdout + result.stderr
    (line,) = result.stdout.splitlines()
    assert upstream_kit.EXPECTATIONS_PATH in line and "run-0000000.json" in line and "-1 lines" in line, line


def test_the_record_is_the_run_against_keras_master(record):
    assert record["keras"] == {"repository": "keras-team/keras", "commit": KERAS_MASTER, "version": "3.16.0"}
    assert upstream_kit.recorded_run(UPSTREAM).name == f"run-{KERAS_MASTER[:7]}.json"
    assert record["torch"].startswith("2.13.") and record["jax"] and record["python"]
    assert record["command"].startswith("pytest ") and "--keras-path" in record["command"]
    assert record["wall_s"] > 0 and record["nproc"] == 2
    assert upstream_kit.recorded_run(UPSTREAM).stat().st_size < 300_000
    verdicts = {v[0] for v in record["cells"].values()}
    assert "pass" in verdicts and verdicts - {"pass", "skipped"}, verdicts


def test_the_caller_is_readmes_block_with_the_kits_expectations():
    """One source: README's caller, changed on its expectations: line and nowhere else."""
    from tests.workflows import load, readme_caller_text

    readme, caller = readme_caller_text(), CALLER.read_text()
    changed = [d for d in difflib.ndiff(readme.splitlines(), caller.splitlines()) if d[:1] in "+-"]
    assert all("expectations:" in d for d in changed), changed
    expected = load(readme)
    for job in expected["jobs"].values():
        if "expectations" in (job.get("with") or {}):
            job["with"]["expectations"] = upstream_kit.EXPECTATIONS_PATH
    assert load(caller) == expected
    assert upstream_kit.caller_input(caller, "expectations") == upstream_kit.EXPECTATIONS_PATH


def test_the_caller_passes_the_workflow_schema_and_actionlint():
    schema = subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", str(CALLER)],
                            capture_output=True, text=True, check=False)
    assert schema.returncode == 0, schema.stdout + schema.stderr
    lint = actionlint(str(CALLER))
    assert lint.returncode == 0 and lint.stdout == "", lint.stdout + lint.stderr


def test_zizmor_finds_nothing_of_high_severity_in_the_kit():
    assert [f for f in zizmor_findings(UPSTREAM / ".github") if " (High): " in f] == []


def test_keras_zizmor_job_stays_green_on_the_kit():
    """Keras' job fails on a finding of any severity (zizmor's exit code), not only a high one."""
    assert zizmor_findings(UPSTREAM / ".github") == []


def test_the_expectations_parse_and_name_torch_2_13():
    from keras_dtensor_conformance.report.expectations_file import read, read_torch, torch_matches

    entries = read(str(EXPECTATIONS))
    assert entries
    releases, _ = read_torch(str(EXPECTATIONS))
    assert releases == ("2.13",) and torch_matches(releases, "2.13.0+cpu")


def test_every_expectation_fits_a_cell_of_the_recorded_run(record):
    from keras_dtensor_conformance.report.expectations_file import read

    _, verdicts = upstream_kit.writer_inputs(record)
    unmatched = [e.cell for e in read(str(EXPECTATIONS))
                 if not any(e.matches_cell(c) and e.fits(*vt) for c, vt in verdicts.items())]
    assert unmatched == []


def test_every_failing_cell_of_the_recorded_run_is_expected(record):
    """The gate starts green on the commit the file was recorded on: each failure has an entry it fits."""
    from keras_dtensor_conformance.report.expectations import Book
    from keras_dtensor_conformance.report.expectations_file import read

    book = Book(read(str(EXPECTATIONS)))
    _, verdicts = upstream_kit.writer_inputs(record)
    unexpected = [c for c, (v, text) in verdicts.items()
                  if v != "pass" and not ((e := book.lookup(c)) is not None and e.fits(v, text))]
    assert unexpected == []


def test_the_caller_runs_on_the_torch_and_nproc_the_expectations_were_recorded_on(record):
    """The session refuses an expectations file whose ``# torch:`` line does not name the running
    torch: a caller that installs another torch (``torch-version: ""`` is the newest) is red on every run."""
    from keras_dtensor_conformance.report.expectations_file import read_torch, torch_matches

    from tests.workflows import reusable_defaults

    caller = CALLER.read_text()
    torch = upstream_kit.caller_input(caller, "torch-version")
    torch = reusable_defaults()["torch-version"] if torch is None else str(torch)
    releases, _ = read_torch(str(EXPECTATIONS))
    said = f"the caller installs torch {torch or 'newest'}, the file is for torch {', '.join(releases)}"
    assert torch and torch_matches(releases, torch), said
    nproc = upstream_kit.caller_input(caller, "nproc")
    assert (nproc if nproc is not None else reusable_defaults()["nproc"]) == record["nproc"]


def test_the_pr_note_says_how_to_update_the_file_with_the_pinned_suite():
    note = (UPSTREAM / upstream_kit.PR_PATH).read_text()
    ref = upstream_kit.suite_ref(CALLER.read_text())
    assert f"checkout {ref}" in note
    assert f"--update-expectations ../keras/{upstream_kit.EXPECTATIONS_PATH}" in note
    assert "report-only" in note


def test_the_record_keeps_the_writers_inputs_from_a_report():
    """A report's cell becomes its verdict and the first line of its text (as it was: pids too); a skipped
    cell its state; the writer then gives the entry it gives in a session."""
    report = {
        "schema": kit_record.REPORT_SCHEMA, "created": "x", "duration": 1.0, "clusters": [],
        "collected": ["a[1]", "a[2]", "a[3]", "b[1]"],
        "build": {"keras_version": "3.16.0", "git_commit": "f" * 40, "torch_version": "2.13.0+cpu",
                  "backend": "gloo", "nproc": 2, "capabilities": {}},
        "cells": [
            {"id": "a[1]", "verdict": "pass", "outcome": "passed", "message": "", "text": ""},
            {"id": "a[2]", "verdict": "numerics", "outcome": "failed", "message": "m",
             "text": "\nrank 1 (pid 42): step_losses differ\nstory"},
            {"id": "a[3]", "verdict": None, "outcome": "skipped", "message": "needs --nproc 4"},
        ],
    }
    with pytest.raises(kit_record.KitError, match="no suite commit"):
        kit_record.record_from_report(report, commit=None, command="pytest x", wall_s=2.0, env={})
    record = kit_record.record_from_report(report, commit=None, command="pytest x", wall_s=2.0,
                                             env={"python": "3.11.7", "jax": "0.10.2", "machine": "m"},
                                             suite_commit="e" * 40)
    assert record["suite_commit"] == "e" * 40
    assert record["cells"] == {"a[1]": ["pass"], "a[2]": ["numerics", "rank 1 (pid 42): step_losses differ"],
                               "a[3]": ["skipped", "needs --nproc 4"]}
    assert record["not_run"] == ["b[1]"]
    reread = kit_record.load_record_text(kit_record.dump_record(record))
    assert reread == record
    text = upstream_kit.expectations_text(record)
    assert text.splitlines()[2] == "# torch: 2.13"
    assert [(e.cell, e.verdict, e.reason) for e in upstream_kit.expectation_entries(text)] == [
        ("a[2]", "numerics", "rank 1: step_losses differ")]


def test_the_caller_pins_the_suite_commit_the_run_was_recorded_with(record):
    """A ``uses:`` pinned to a SHA that is no commit of the suite fails on GitHub before any job starts
    (and zizmor's online impostor-commit audit, which Keras' job runs, names it); pinned to another
    commit than the recorded run's, the gate would judge Keras with a suite its expectations were not
    recorded with. The commit must be on main (an ancestor of this checkout's HEAD)."""
    ref = upstream_kit.suite_ref(CALLER.read_text())
    assert len(ref) == 40 and all(c in "0123456789abcdef" for c in ref), f"{ref} is not a commit SHA"
    assert ref == record["suite_commit"], "README's caller pins another suite commit than the kit's record"
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], capture_output=True, text=True,
                             cwd=ROOT, check=False)
    if shallow.returncode != 0 or shallow.stdout.strip() == "true":
        pytest.skip("not a full git clone: the suite's history is not here to look the commit up in")
    found = subprocess.run(["git", "cat-file", "-e", f"{ref}^{{commit}}"], capture_output=True, text=True,
                           cwd=ROOT, check=False)
    assert found.returncode == 0, f"{ref} is no commit of this repository"
    on_main = subprocess.run(["git", "merge-base", "--is-ancestor", ref, "HEAD"], cwd=ROOT, check=False)
    assert on_main.returncode == 0, f"{ref} is not on this checkout's history"


def test_the_pr_note_names_the_required_check_and_the_expectations_how_to_record_them_again(record):
    """A maintainer who adopts the kit must know which check to require (GitHub names it after the
    calling job and the called one), and one who finds the file stale, the one command that records it."""
    caller = CALLER.read_text()
    assert upstream_kit.gating_check(caller) == "dtensor-conformance / merge"
    assert upstream_kit.gating_check(caller.replace("slices: 4", "slices: 1")) == "dtensor-conformance / conformance"
    assert "requires `dtensor-conformance / merge`" in (UPSTREAM / "PR.md").read_text()
    header = (UPSTREAM / upstream_kit.EXPECTATIONS_PATH).read_text().split("\ntest_")[0]
    assert record["suite_commit"][:12] in header
    assert f"pytest --keras-path ../keras --update-expectations ../keras/{upstream_kit.EXPECTATIONS_PATH}" in header
