"""--conformance-expect / --update-expectations: expected failures as data, like array-api-tests."""

from __future__ import annotations

import re

CELLS = """
import pytest
from keras_dtensor_conformance.verdicts import CellFailure

@pytest.mark.parametrize("cell", ["mixed", "fallback", "good", "changed"])
def test_cell(cell):
    if cell == "mixed":
        raise CellFailure("mixed-tensor", "aten.sub.Tensor got mixed torch.Tensor and DTensor")
    if cell == "fallback":
        raise CellFailure("compile-fallback", "dynamo compiled no graph")
    if cell == "changed":
        raise CellFailure("numerics", "max abs difference 0.5")
"""

EXPECT = """# comment lines and blank lines are ignored

test_cell[mixed]     mixed-tensor      the optimizer mixes a plain lr tensor into _foreach
test_cell[good]      numerics          fixed since
test_cell[changed]   sharding-lost     the kernel stays a Parameter
test_cell[gone]      error             a cell that no longer exists
"""


def test_expected_failures_are_xfail_and_the_rest_is_reported(inner):
    inner.pytester.makepyfile(CELLS)
    inner.pytester.path.joinpath("expect.txt").write_text(EXPECT)
    result = inner.run("--conformance-expect", "expect.txt", "-rxXf")
    out = result.stdout
    assert result.returncode == 1, out
    assert "[mixed-tensor] the optimizer mixes a plain lr tensor" in out  # xfail with the file's reason
    assert "XPASS" in out and "expected numerics: fixed since" in out
    assert "expected sharding-lost (the kernel stays a Parameter), got numerics" in out
    assert re.search(r"FAILED \S+::test_cell\[fallback\]", out)  # no expectation: a plain failure
    assert "1 expectation entries match no collected cell" in out and "test_cell[gone]" in out
    assert "2 failed, 1 xfailed, 1 xpassed" in out


def test_strict_makes_an_unexpected_pass_fail(inner):
    inner.pytester.makepyfile(CELLS)
    inner.pytester.path.joinpath("expect.txt").write_text(EXPECT)
    result = inner.run("--conformance-expect", "expect.txt", "--conformance-strict", "-k", "good")
    assert result.returncode == 1
    assert "[XPASS(strict)] expected numerics: fixed since" in result.stdout


def test_update_writes_this_runs_verdicts_and_keeps_hand_written_reasons(inner):
    inner.pytester.makepyfile(CELLS)
    path = inner.pytester.path.joinpath("expect.txt")
    path.write_text(EXPECT)
    result = inner.run("--conformance-expect", "expect.txt", "--update-expectations", "expect.txt")
    assert "expectations written to expect.txt" in result.stdout
    lines = {line.split()[0]: line.split(None, 2)[1:] for line in path.read_text().splitlines()
             if line and not line.startswith("#")}
    assert lines["test_cell[mixed]"] == ["mixed-tensor", "the optimizer mixes a plain lr tensor into _foreach"]
    assert lines["test_cell[fallback]"] == ["compile-fallback", "dynamo compiled no graph"]
    assert lines["test_cell[changed]"] == ["numerics", "max abs difference 0.5"]
    assert "test_cell[good]" not in lines  # it passes now
    assert lines["test_cell[gone]"][0] == "error"  # not run here: kept
    rerun = inner.run("--conformance-expect", "expect.txt", "-k", "not gone")
    assert rerun.returncode == 0, rerun.stdout
    assert "1 passed, 3 xfailed" in rerun.stdout


def test_malformed_expectations_file_is_a_usage_error(inner):
    inner.pytester.makepyfile(CELLS)
    inner.pytester.path.joinpath("expect.txt").write_text("test_cell[mixed] not-a-verdict why\n")
    result = inner.run("--conformance-expect", "expect.txt")
    assert result.returncode == 4
    assert "expect.txt:1: expected 'cell-id verdict [/regex/] reason'" in result.stdout + result.stderr


# ------------------------------------------------------------ globs, patterns, precedence
CAUSES = """
import pytest
from keras_dtensor_conformance.verdicts import CellFailure

REFUSED = "jit_compile=True but dynamo compiled no graph (`jit_compile=True` is not supported with `ModelParallel`)"
FAILURES = {
    "sgd-jit-colshard": ("compile-fallback", REFUSED),
    "adam-jit-colshard": ("compile-fallback", REFUSED),
    "adam-jit-rowshard": ("compile-fallback", "jit_compile=True but dynamo compiled no graph (a graph break)"),
    "adam-nojit-rowshard": ("numerics", "losses differ from single-process by 0.06"),
}

@pytest.mark.parametrize("cell", [*FAILURES, "adam-jit-dataparallel"])
def test_fit(cell):
    if cell in FAILURES:
        raise CellFailure(*FAILURES[cell])
"""

GLOBS = """# jit under ModelParallel: one cause, one line
test_fit[*-jit-*]  compile-fallback  /not supported with `ModelParallel`/  jit under ModelParallel runs eager
test_fit[*-rowshard]           error             /IndexError/  row-sharded Embedding
test_fit[adam-nojit-rowshard]  numerics          row-sharded attention differs by 0.06
test_gone[*]                   hang              a family that no longer exists
"""


def test_globs_patterns_and_precedence(inner):
    """A glob xfails all its cells (brackets literal); the first glob beats a later one, an
    exact id beats both; a failure whose text misses the pattern fails as changed."""
    inner.pytester.makepyfile(CAUSES)
    inner.pytester.path.joinpath("expect.txt").write_text(GLOBS)
    result = inner.run("--conformance-expect", "expect.txt", "-rxXf")
    out = result.stdout
    assert result.returncode == 1, out
    for cell in ("sgd-jit-colshard", "adam-jit-colshard"):
        assert f"::test_fit[{cell}] - [compile-fallback] jit under ModelParallel runs eager" in out, out
    assert ("expected compile-fallback matching /not supported with `ModelParallel`/ (jit under ModelParallel "
            "runs eager), got compile-fallback: jit_compile=True but dynamo compiled no graph (a graph break)") in out
    assert re.search(r"FAILED \S+::test_fit\[adam-jit-rowshard\]", out), out
    assert "::test_fit[adam-nojit-rowshard] - [numerics] row-sharded attention" in out  # exact, not the error glob
    # the glob matches it, but it passes: a glob with a pattern claims only the cells that fail its way
    assert not re.search(r"XPASS \S+::test_fit\[adam-jit-dataparallel\]", out), out
    assert "1 expectation entries match no collected cell" in out and "test_gone[*]" in out
    assert "1 failed, 1 passed, 3 xfailed" in out


def test_update_keeps_globs_and_patterns(inner):
    """Globs stay one line each, with their patterns and comments; only the cell no entry
    covers (the new cause) gets an exact entry, which then overrides its glob."""
    inner.pytester.makepyfile(CAUSES)
    path = inner.pytester.path.joinpath("expect.txt")
    path.write_text(GLOBS)
    result = inner.run("--conformance-expect", "expect.txt", "--update-expectations", "expect.txt")
    assert "expectations written to expect.txt: 5 entries" in result.stdout, result.stdout
    text = path.read_text()
    entries = [line.split(None, 2) for line in text.splitlines() if line and not line.startswith("#")]
    assert [e[0] for e in entries] == [
        "test_fit[*-jit-*]", "test_fit[*-rowshard]", "test_gone[*]",  # globs first, in their order
        "test_fit[adam-jit-rowshard]", "test_fit[adam-nojit-rowshard]",
    ]
    assert "# jit under ModelParallel: one cause, one line\ntest_fit[*-jit-*]" in text
    assert entries[0][2] == "/not supported with `ModelParallel`/  jit under ModelParallel runs eager"
    assert entries[3][1:] == ["compile-fallback", "jit_compile=True but dynamo compiled no graph (a graph break)"]
    rerun = inner.run("--conformance-expect", "expect.txt", "--conformance-strict")
    assert rerun.returncode == 0, rerun.stdout
    assert "1 passed, 4 xfailed" in rerun.stdout  # adam-jit-dataparallel passes beside the glob's cells


# ------------------------------------------------------------ a glob with a pattern and passing cells
OPS = """
import pytest
from keras_dtensor_conformance.verdicts import CellFailure

@pytest.mark.parametrize("op", ["abs", "add", "exp", "shape"])
def test_op(op):
    if op != "shape" and not (FIXED == "all" or op in FIXED.split(",")):
        raise CellFailure("compile-fallback", f"rank 0: {op}: dynamo compiled 0 graph(s), fewer than the 2")
"""

ONE_LINE = "test_op[*]  compile-fallback  /compiled 0 graph\\(s\\), fewer than the [1-9]/  dynamo stops\n"


def ops(inner, fixed: str = "") -> None:
    inner.pytester.makepyfile(OPS.replace("import pytest", f"import pytest\nFIXED = {fixed!r}"))
    inner.pytester.path.joinpath("expect.txt").write_text(ONE_LINE)


def test_a_glob_with_a_pattern_leaves_a_passing_cell_a_pass_even_when_strict(inner):
    """One cause, one line: ``shape`` passes beside the cells that fail the glob's way, and is a plain
    pass (not XPASS), so the glob needs no line per failing op."""
    ops(inner)
    result = inner.run("--conformance-expect", "expect.txt", "--conformance-strict", "-rxX")
    assert result.returncode == 0, result.stdout
    assert "1 passed, 3 xfailed" in result.stdout and "XPASS" not in result.stdout
    assert "no longer appl" not in result.stdout


def test_a_glob_with_a_pattern_that_no_cell_fails_any_more_is_reported(inner):
    """The cause fixed in every cell the glob decides: no cell is XPASS, so the session says it, and
    --conformance-strict fails it (one op of three fixed is a plain pass: tests/test_expectations_file.py)."""
    ops(inner, "all")
    result = inner.run("--conformance-expect", "expect.txt", "--conformance-strict")
    assert result.returncode == 1, result.stdout
    assert ("1 expectation entry no longer applies: each cell it decides ran and none failed as it expects "
            "(test_op[*]) and --conformance-strict: failing the session") in result.stdout
    assert "4 passed" in result.stdout
    relaxed = inner.run("--conformance-expect", "expect.txt")
    assert relaxed.returncode == 0 and "1 expectation entry no longer applies" in relaxed.stdout, relaxed.stdout


def test_update_writes_one_line_for_one_cause(inner):
    """Recorded from scratch: the three ops' one cause is one glob with a pattern, which the next
    strict run keeps green with ``shape`` passing beside it."""
    ops(inner)
    path = inner.pytester.path.joinpath("recorded.txt")
    result = inner.run("--update-expectations", "recorded.txt")
    assert "expectations written to recorded.txt: 1 entries" in result.stdout, result.stdout
    (line,) = [line for line in path.read_text().splitlines() if not line.startswith("#")]
    assert line.startswith(
        "test_op[*]  compile-fallback  /rank 0: .+?: dynamo compiled 0 graph\\(s\\), fewer than the 2/")
    rerun = inner.run("--conformance-expect", "recorded.txt", "--conformance-strict")
    assert rerun.returncode == 0 and "1 passed, 3 xfailed" in rerun.stdout, rerun.stdout
