"""An expectations file's ``# torch:`` line: the torch its verdicts were recorded on, checked and written."""

from __future__ import annotations

import importlib.metadata
import pathlib

import pytest
from keras_dtensor_conformance.report.expectations import Expectations
from keras_dtensor_conformance.report.expectations_file import read, read_torch, torch_matches
from keras_dtensor_conformance.torch_internals import CHECKED_ON, TORCH_FLOOR

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENTRIES = """# keras-dtensor-conformance expectations: Keras 3.16.0.dev2026102704, torch 2.13.0+cpu, gloo, nproc 2
# cell-id or glob  verdict  [/regex/]  reason (see README, 'Expected failures')
{directive}
# the promotion mode stops dynamo
test_op[*-compiled]  compile-fallback  /compiled 0 graph/  promotion dispatch mode stops dynamo
test_fit[adam-arrays-nojit-rowshard]  numerics  row-sharded attention differs
"""


def expectations_file(tmp_path, directive: str) -> str:
    path = tmp_path / "expect.txt"
    path.write_text(ENTRIES.format(directive=directive))
    return str(path)


@pytest.mark.parametrize("directive, version", [
    ("# torch: 2.13", "2.13.0+cpu"),
    ("# torch: 2.13", "2.13.1+cu128"),
    ("# torch: 2.13", "2.13.0.dev20260301"),
    ("# torch: 2.13.0", "2.13.0+cpu"),
    ("# torch: 2.13.*", "2.13.2"),
    ("# torch: 2.13, 2.15.0", "2.15.0+cu130"),
    ("#torch:2.15", "2.15.0"),
])
def test_a_file_for_the_running_torch_is_read(tmp_path, directive, version):
    expectations = Expectations(expectations_file(tmp_path, directive), None, False, torch_version=version)
    assert [e.cell for e in expectations.book.entries] == ["test_op[*-compiled]", "test_fit[adam-arrays-nojit-rowshard]"]
    assert expectations.book.entries[0].comments == ("# the promotion mode stops dynamo",)  # not the directive


@pytest.mark.parametrize("directive, version", [
    ("# torch: 2.13", "2.15.0+cpu"),
    ("# torch: 2.13", "2.12.1"),
    ("# torch: 2.13.0", "2.13.1"),
    ("# torch: 2.13, 2.14", "2.15.0"),
])
def test_a_file_for_another_torch_is_one_usage_error_naming_both(tmp_path, directive, version):
    path = expectations_file(tmp_path, directive)
    with pytest.raises(pytest.UsageError) as raised:
        Expectations(path, None, False, torch_version=version)
    recorded = directive.split(":", 1)[1].strip()
    assert str(raised.value) == (
        f"{path}:3: its verdicts were recorded on torch {recorded} and this is torch {version}; verdicts can "
        f"differ by torch: run on torch {recorded}, or record this torch's with --update-expectations FILE "
        "(without --conformance-expect)")


def test_the_running_torch_is_the_installed_ones_by_default(tmp_path, monkeypatch):
    """The session need not say which torch runs: the installed torch's metadata does (no import)."""
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.15.0+cpu")
    with pytest.raises(pytest.UsageError, match=r"recorded on torch 2\.13 and this is torch 2\.15\.0\+cpu"):
        Expectations(expectations_file(tmp_path, "# torch: 2.13"), None, False)


@pytest.mark.parametrize("version", ["2.13.0+cpu", "2.15.0", None])
def test_a_file_without_the_line_is_accepted_on_any_torch(tmp_path, version):
    expectations = Expectations(expectations_file(tmp_path, ""), None, False, torch_version=version)
    assert len(expectations.book.entries) == 2


@pytest.mark.parametrize("directive, problem", [
    ("# torch: 2.13.x", "expected '# torch: RELEASE"),
    ("# torch:", "expected '# torch: RELEASE"),
    ("# torch: 2.13\n# torch: 2.15", "a second '# torch:' line"),
])
def test_a_bad_torch_line_is_a_usage_error(tmp_path, directive, problem):
    with pytest.raises(pytest.UsageError, match=problem):
        Expectations(expectations_file(tmp_path, directive), None, False, torch_version="2.13.0")


def test_update_writes_the_running_torch_and_reads_back(tmp_path):
    """``--update-expectations`` on torch 2.15 re-records a 2.13 file: its line says 2.15 (once), the
    entries and their comments are kept, and the file is then refused on 2.13 and read on 2.15."""
    path = expectations_file(tmp_path, "# torch: 2.13")
    before = read(path)
    updater = Expectations(None, path, False, torch_version="2.15.0+cpu")
    updater.check_collected({"test_op[add-tensor-shard0-compiled]", "test_fit[adam-arrays-nojit-rowshard]"})
    written = updater.write_update({"test_op[add-tensor-shard0-compiled]": ("compile-fallback", "compiled 0 graph(s)"),
                                    "test_fit[adam-arrays-nojit-rowshard]": ("numerics", "row-sharded attention")},
                                   "Keras 3.16.0.dev2026102704, torch 2.15.0+cpu, gloo, nproc 2")
    text = pathlib.Path(path).read_text()
    assert written == 2 and text.splitlines()[2] == "# torch: 2.15" and text.count("# torch:") == 1
    assert read_torch(path) == (("2.15",), 3)
    assert [(e.cell, e.verdict, e.pattern, e.reason, e.comments) for e in read(path)] == \
        [(e.cell, e.verdict, e.pattern, e.reason, e.comments) for e in before]
    assert len(Expectations(path, None, False, torch_version="2.15.1").book.entries) == 2
    with pytest.raises(pytest.UsageError, match="recorded on torch 2.15 and this is torch 2.13.0"):
        Expectations(path, None, False, torch_version="2.13.0")


def test_update_with_an_unknown_torch_writes_no_line(tmp_path):
    path = tmp_path / "new.txt"
    updater = Expectations(None, str(path), False, torch_version=None)
    updater.torch_version = None  # no torch metadata here
    updater.write_update({"test_op[x]": ("error", "boom")}, "banner")
    assert read_torch(str(path)) is None and [e.cell for e in read(str(path))] == ["test_op[x]"]


def test_release_numbers_alone_decide():
    assert torch_matches(("2.13",), "2.13.0a0+git1234abc") and torch_matches(("2",), "2.15.0")
    assert not torch_matches(("2.13",), "2.1.3") and not torch_matches(("2.13",), "something")


def test_the_projects_expectations_name_the_torch_they_were_recorded_on():
    """expectations/ were recorded on torch 2.13.0 (their banner), the floor, which was checked."""
    for path in (ROOT / "expectations").glob("*.txt"):
        releases, _ = read_torch(str(path))
        assert releases == (TORCH_FLOOR,), path
        assert all(torch_matches(releases, version) for version in CHECKED_ON)


CELLS = """
import pytest
from keras_dtensor_conformance.verdicts import CellFailure

def test_cell():
    raise CellFailure("numerics", "max abs difference 0.5")
"""


def test_a_session_on_another_torch_is_one_error_line_and_update_rewrites_it(inner):
    """In a session: the file for torch 2.12 is refused with one ``ERROR:`` line (exit 4, no cell
    run); ``--update-expectations`` alone re-records it with this torch's line (read back on this
    torch: ``test_update_writes_the_running_torch_and_reads_back``)."""
    from keras_dtensor_conformance.report.expectations_file import torch_release
    from keras_dtensor_conformance.torch_internals import installed_torch

    inner.pytester.makepyfile(CELLS)
    path = inner.pytester.path / "expect.txt"
    path.write_text("# torch: 2.12\ntest_cell  numerics  max abs difference\n")
    refused = inner.run("--conformance-expect", "expect.txt")
    errors = [line for line in (refused.stdout + refused.stderr).splitlines() if line.startswith("ERROR:")]
    assert refused.returncode == 4 and errors == [
        f"ERROR: expect.txt:1: its verdicts were recorded on torch 2.12 and this is torch {installed_torch()}; "
        "verdicts can differ by torch: run on torch 2.12, or record this torch's with --update-expectations FILE "
        "(without --conformance-expect)"], refused.stdout + refused.stderr
    updated = inner.run("--update-expectations", "expect.txt")
    assert updated.returncode == 1, updated.stdout  # the cell fails: no expectation read
    assert f"# torch: {torch_release(installed_torch())}" in path.read_text().splitlines()
    assert [(e.cell, e.verdict, e.reason) for e in read(str(path))] == [("test_cell", "numerics", "max abs difference")]
