"""The expectations file without a session: its syntax, lookup order and update rules."""

from __future__ import annotations

import types

import pytest
from keras_dtensor_conformance.report.expectations import Book, Expectations
from keras_dtensor_conformance.report.expectations_file import parse_line, read, write

REFUSED = "jit_compile=True but dynamo compiled no graph (`jit_compile=True` is not supported with `ModelParallel`)"


def entry(line: str):
    return parse_line("expect.txt", 1, line)


def test_old_lines_still_parse():
    e = entry("test_fit[adam-arrays-jit-colshard]  compile-fallback  jit_compile=True: runs eager / slowly")
    assert (e.cell, e.verdict, e.pattern, e.reason) == (
        "test_fit[adam-arrays-jit-colshard]", "compile-fallback", None, "jit_compile=True: runs eager / slowly")
    assert not e.is_glob


def test_pattern_field_with_an_escaped_slash():
    e = entry(r"test_op[*]  error  /a\/b (c)/  why")
    assert (e.pattern, e.reason) == (r"a\/b (c)", "why")
    assert e.fits("error", "x a/b c y") and not e.fits("error", "a/b") and not e.fits("numerics", "a/b c")


@pytest.mark.parametrize("line, problem", [
    ("test_op[*]  error  /IndexError  why", "has no closing /"),
    ("test_op[*]  error  /Index(Error/  why", "is not a regular expression"),
    ("test_op[*]  pass  why", "with a verdict among"),
])
def test_bad_lines_are_usage_errors(line, problem):
    with pytest.raises(pytest.UsageError, match=problem):
        entry(line)


def test_the_same_cell_twice_is_a_usage_error(tmp_path):
    path = tmp_path / "expect.txt"
    path.write_text("test_op[*]  error  a\ntest_op[*]  numerics  b\n")
    with pytest.raises(pytest.UsageError, match=r"expect.txt:2: test_op\[\*\] already has an entry on line 1"):
        read(str(path))


def test_only_star_is_a_wildcard():
    glob = entry("test_op[*-compiled]  compile-fallback  why")
    assert glob.matches_cell("test_op[add-tensor-shard0-compiled]")
    assert not glob.matches_cell("test_op[add-tensor-shard0-eager]")
    assert not glob.matches_cell("test_opx[a-compiled]") and not glob.matches_cell("test_op[a-compiled]x")
    literal = entry("test_op[a?b]  error  why")
    assert not literal.is_glob and not literal.matches_cell("test_op[axb]")


def test_exact_beats_glob_and_the_first_glob_wins():
    book = Book([entry("test_fit[*-jit-*]  compile-fallback  first"), entry("test_fit[*-rowshard]  error  second"),
                 entry("test_fit[a-jit-rowshard]  numerics  exact")])
    assert book.lookup("test_fit[a-jit-rowshard]").reason == "exact"
    assert book.lookup("test_fit[b-jit-rowshard]").reason == "first"
    assert book.lookup("test_fit[b-nojit-rowshard]").reason == "second"
    assert book.lookup("test_fit[b-nojit-colshard]") is None
    assert book.stale({"test_fit[a-jit-colshard]"}) == ["test_fit[*-rowshard]", "test_fit[a-jit-rowshard]"]


def test_a_reason_that_starts_with_a_slash_survives_a_round_trip(tmp_path):
    path = tmp_path / "expect.txt"
    written = [entry("test_a  error  x")]
    written[0].reason = "/tmp/k/keras/__init__.py: boom"
    write(str(path), written, "banner")
    (back,) = read(str(path))
    assert (back.pattern, back.reason) == (None, "/tmp/k/keras/__init__.py: boom")


def update(tmp_path, lines: str, collected: set[str], verdicts: dict) -> list[str]:
    path = tmp_path / "expect.txt"
    path.write_text(lines)
    expectations = Expectations(str(path), str(path), strict=False)
    expectations.collected = collected
    expectations.write_update(verdicts, "banner")
    return [line for line in path.read_text().splitlines() if line and not line.startswith("#")]


def test_update_drops_a_glob_only_when_every_cell_it_decides_ran_and_none_failed_as_expected(tmp_path):
    glob = "test_a[*]  compile-fallback  /ModelParallel/  jit refused\n"
    passing = {"test_a[1]": ("pass", ""), "test_a[2]": ("pass", "")}
    assert update(tmp_path, glob, set(passing), passing) == []
    kept = update(tmp_path, glob, {*passing, "test_a[3]"}, passing)  # test_a[3] did not run
    assert [line.split()[0] for line in kept] == ["test_a[*]"]
    one_still_fails = {**passing, "test_a[2]": ("compile-fallback", REFUSED)}
    assert [line.split()[0] for line in update(tmp_path, glob, set(passing), one_still_fails)] == ["test_a[*]"]


def test_update_replaces_an_exact_entry_whose_pattern_no_longer_matches(tmp_path):
    lines = "test_a[1]  error  /IndexError/  embedding lookup\ntest_a[2]  error  /IndexError/  embedding lookup\n"
    verdicts = {"test_a[1]": ("error", "IndexError: index 5"), "test_a[2]": ("error", "KeyError: 'x'\nmore")}
    kept = update(tmp_path, lines, set(verdicts), verdicts)
    assert [line.split(None, 2) for line in kept] == [
        ["test_a[1]", "error", "/IndexError/  embedding lookup"],
        ["test_a[2]", "error", "KeyError: 'x'"],
    ]


# ------------------------------------------------------------ a glob with a pattern claims only failures
DYNAMO = "rank 0: {}: torch._dynamo compiled 0 graph(s), fewer than the {} the same function compiles on plain tensors"
OP_GLOB = "test_op[*-compiled]  compile-fallback  /compiled 0 graph\\(s\\), fewer than the [1-9]/  dynamo stops\n"


def applied(tmp_path, lines: str, name: str, verdict: str, text: str = "", strict: bool = True):
    path = tmp_path / "expect.txt"
    path.write_text(lines)
    report = types.SimpleNamespace(outcome="passed", sections=[])
    expected = Expectations(str(path), None, strict=strict).apply(name, verdict, text, report)
    return expected, report


def test_a_passing_cell_under_a_glob_with_a_pattern_is_a_plain_pass(tmp_path):
    for strict in (True, False):
        expected, report = applied(tmp_path, OP_GLOB, "test_op[shape-shard0-compiled]", "pass", strict=strict)
        assert (expected, report.outcome, hasattr(report, "wasxfail")) == (None, "passed", False)
    expected, report = applied(tmp_path, OP_GLOB, "test_op[abs-shard0-compiled]", "compile-fallback",
                               DYNAMO.format("abs", 1))
    assert (expected, report.outcome) == ("compile-fallback", "skipped")
    assert report.wasxfail == "[compile-fallback] dynamo stops"


@pytest.mark.parametrize("line", [
    "test_op[abs-shard0-compiled]  compile-fallback  /compiled 0 graph/  exact, with a pattern",
    "test_op[abs-shard0-compiled]  compile-fallback  exact",
    "test_op[*-compiled]  compile-fallback  a glob without a pattern claims every cell it decides",
    "test_op[*-compiled]  compile-fallback  //  an empty pattern is no pattern",
])
def test_a_pass_under_an_exact_entry_or_a_glob_without_a_pattern_is_still_xpass(tmp_path, line):
    expected, report = applied(tmp_path, line + "\n", "test_op[abs-shard0-compiled]", "pass")
    assert (expected, report.outcome) == ("compile-fallback", "failed")
    assert report.longrepr.startswith("[XPASS(strict)] expected compile-fallback")
    expected, report = applied(tmp_path, line + "\n", "test_op[abs-shard0-compiled]", "pass", strict=False)
    assert report.outcome == "passed" and report.wasxfail.startswith("expected compile-fallback")


def no_longer_apply(tmp_path, lines: str, collected: set[str], verdicts: dict) -> list[str]:
    path = tmp_path / "expect.txt"
    path.write_text(lines)
    expectations = Expectations(str(path), None, strict=True)
    expectations.collected = collected
    return [e.cell for e in expectations.no_longer_apply(verdicts)]


def test_a_glob_with_a_pattern_none_of_whose_cells_fail_any_more_is_reported(tmp_path):
    cells = {f"test_op[{op}-shard0-compiled]" for op in ("abs", "add", "shape")}
    fixed = {c: ("pass", "") for c in cells}
    lines = OP_GLOB + "test_op[add-*]  compile-fallback  /x/  a later glob: the first decides\n"
    assert no_longer_apply(tmp_path, lines, cells, fixed) == ["test_op[*-compiled]"]
    one_fails = {**fixed, "test_op[add-shard0-compiled]": ("compile-fallback", DYNAMO.format("add", 2))}
    assert no_longer_apply(tmp_path, lines, cells, one_fails) == []  # abs fixed alone: a plain pass, not caught
    changed = {**fixed, "test_op[add-shard0-compiled]": ("error", "boom")}  # fails, but not its way
    assert no_longer_apply(tmp_path, lines, cells, changed) == ["test_op[*-compiled]"]
    not_run = {c: v for c, v in fixed.items() if "add" not in c}  # deselected or skipped: nothing says
    assert no_longer_apply(tmp_path, lines, cells, not_run) == []
    assert no_longer_apply(tmp_path, lines.replace("/compiled 0", "/this is no pattern/ /compiled 0", 0),
                           cells, fixed) == ["test_op[*-compiled]"]
    exact = "test_op[abs-shard0-compiled]  compile-fallback  /compiled 0/  exact: its pass is XPASS\n"
    assert no_longer_apply(tmp_path, exact, cells, fixed) == []


def recorded(tmp_path, verdicts: dict, collected: set[str] | None = None, lines: str = "") -> list[list[str]]:
    path = tmp_path / "recorded.txt"
    path.unlink(missing_ok=True)  # else its entries are kept as known ones
    if lines:
        path.write_text(lines)
    expectations = Expectations(None, str(path), strict=False, torch_version=None)
    expectations.collected = set(verdicts) if collected is None else collected
    written = expectations.write_update(verdicts, "banner")
    entries = [line.split(None, 2) for line in path.read_text().splitlines() if line and not line.startswith("#")]
    assert written == len(entries)
    return entries


OPS = ["abs", "add", "convert-to-numpy", "max-axis0", "where"]


def test_update_collapses_cells_of_one_cause_into_one_glob(tmp_path):
    verdicts = {f"test_op[{op}-{layout}-compiled]": ("compile-fallback", DYNAMO.format(op, n) + "\n(pid 4242) more")
                for n, op in enumerate(OPS, start=1) for layout in ("shard0", "replicate")}
    verdicts |= {f"test_op[shape-{layout}-compiled]": ("pass", "") for layout in ("shard0", "replicate")}
    verdicts["test_op[abs-shard0-eager]"] = ("numerics", "max abs difference 0.5")
    entries = recorded(tmp_path, verdicts)
    assert entries == [
        ["test_op[*-compiled]", "compile-fallback",
         ("/rank 0: .+?: torch\\._dynamo compiled 0 graph\\(s\\), fewer than the .+? the same function compiles on "
          "plain tensors/  rank 0: ...: torch._dynamo compiled 0 graph(s), fewer than the ... the same function "
          "compiles on plain tensors")],
        ["test_op[abs-shard0-eager]", "numerics", "max abs difference 0.5"],
    ]
    book = Book(read(str(tmp_path / "recorded.txt")))
    for cell, (verdict, text) in verdicts.items():
        entry = book.lookup(cell)
        assert entry.fits(verdict, text) if verdict != "pass" else entry is None or entry.claims_failures_only


def test_update_does_not_collapse_across_a_cell_that_fails_another_way(tmp_path):
    verdicts = {f"test_op[{op}-shard0-compiled]": ("compile-fallback", DYNAMO.format(op, 2)) for op in OPS}
    verdicts["test_op[dot-shard0-compiled]"] = ("compile-fallback", "a graph break in dot")  # between add and max
    entries = recorded(tmp_path, verdicts)
    cells = [e[0] for e in entries]
    assert cells == ["test_op[a*-shard0-compiled]", "test_op[convert-to-numpy-shard0-compiled]",
                     "test_op[dot-shard0-compiled]", "test_op[max-axis0-shard0-compiled]",
                     "test_op[where-shard0-compiled]"]
    assert not Book(read(str(tmp_path / "recorded.txt"))).lookup("test_op[dot-shard0-compiled]").is_glob
    # nor across a collected cell that did not run (it might fail another way), nor across test functions
    not_run = {c: v for c, v in verdicts.items() if "dot" not in c}
    assert len(recorded(tmp_path, not_run, set(verdicts))) == 4  # a*, then convert, max and where alone: dot parts them
    assert [e[0] for e in recorded(tmp_path, not_run, set(not_run))] == ["test_op[*-shard0-compiled]"]
    twins = {**not_run, "test_fit[abs-shard0-compiled]": ("compile-fallback", DYNAMO.format("abs", 2))}
    assert [e[0] for e in recorded(tmp_path, twins)] == ["test_op[*-shard0-compiled]", "test_fit[abs-shard0-compiled]"]


def test_update_keeps_entries_and_collapses_only_the_cells_they_leave(tmp_path):
    """A kept glob still decides its cells; the cells no entry decides share a new glob after it, and
    a cell its entry no longer fits gets an exact entry as before."""
    lines = "test_op[a*]  compile-fallback  /compiled 0 graph/  hand-written\n"
    verdicts = {f"test_op[{op}-shard0-compiled]": ("compile-fallback", DYNAMO.format(op, 2)) for op in OPS}
    verdicts["test_op[add-shard0-compiled]"] = ("error", "boom")
    assert [e[0] for e in recorded(tmp_path, verdicts, lines=lines)] == [
        "test_op[a*]", "test_op[*-shard0-compiled]", "test_op[add-shard0-compiled]"]
