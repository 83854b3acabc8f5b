"""The expectations file without a session: its syntax, lookup order and update rules."""

from __future__ import annotations

import pytest
from keras_dtensor_conformance.report.expectations import Book, Expectations, parse_line, read, write

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
