"""A verdict is one entry of ``verdicts.REGISTRY``: every view of verdicts reads it, and this file fails
while a view a reader sees (the grid and its legend, the HTML page, the expectations parser, README's
and docs' tables, README's line of grid symbols, the package's names) lacks an entry. The check is
proved to fail on a made-up verdict no view knows."""

from __future__ import annotations

import pathlib
import re

import keras_dtensor_conformance
import pytest
from keras_dtensor_conformance import verdicts
from keras_dtensor_conformance.report import expectations_file, grid, html

ROOT = pathlib.Path(__file__).resolve().parent.parent


def table_names(path: pathlib.Path) -> set[str]:
    """The verdict names in the first cell of the rows of ``path``'s tables headed ``| verdict |``."""
    names: set[str] = set()
    in_table = False
    for line in path.read_text().splitlines():
        if line.startswith("| verdict |"):
            in_table = True
        elif in_table and line.startswith("|"):
            names.update(re.findall(r"`([a-z#.-]+)`", line.split("|")[1]))
        else:
            in_table = False
    return names


def grid_symbols_line() -> str:
    text = (ROOT / "README.md").read_text()
    return text[text.index("Grid symbols:"):].split("\n\n")[0]


def missing_views(verdict: verdicts.Verdict) -> list[str]:
    """The views that lack ``verdict``."""
    missing = []
    if grid.SYMBOLS.get(verdict.name) != verdict.symbol:
        missing.append("report/grid.SYMBOLS")
    if f"{verdict.symbol}={verdict.name}" not in grid.LEGEND.split():
        missing.append("report/grid.LEGEND")
    if f'"{verdict.name}": "{verdict.symbol}"' not in html.html_page({"cells": []}):
        missing.append("report/html's symbols")
    if verdict.name not in table_names(ROOT / "README.md"):
        missing.append("README.md's verdicts table")
    if f"`{verdict.symbol}` {verdict.name}," not in grid_symbols_line().replace("\n", " "):
        missing.append("README.md's grid symbols")
    if verdict.failure and verdict.name not in table_names(ROOT / "docs" / "verdicts-and-expectations.md"):
        missing.append("docs/verdicts-and-expectations.md's verdicts table")
    if verdict.failure:
        try:
            expectations_file.parse_line("expected.txt", 1, f"test_fit[x]  {verdict.name}  why")
        except Exception:  # noqa: BLE001 - the parser's refusal is what this finds
            missing.append("report/expectations_file.parse_line")
    if verdict.name not in {getattr(keras_dtensor_conformance, name, None) for name in keras_dtensor_conformance.__all__}:
        missing.append("keras_dtensor_conformance.__all__")
    return missing


@pytest.mark.parametrize("verdict", verdicts.REGISTRY, ids=lambda v: v.name)
def test_every_view_shows_the_verdict(verdict):
    assert missing_views(verdict) == []


def test_a_verdict_only_the_registry_knows_is_missing_from_every_view():
    made_up = verdicts.Verdict("made-up", "Z", verdicts.JUDGED, "a verdict no view knows")
    assert missing_views(made_up) == [
        "report/grid.SYMBOLS", "report/grid.LEGEND", "report/html's symbols", "README.md's verdicts table",
        "README.md's grid symbols", "docs/verdicts-and-expectations.md's verdicts table",
        "report/expectations_file.parse_line", "keras_dtensor_conformance.__all__"]


def test_names_and_symbols_are_unique_and_every_source_is_a_kind():
    assert len({v.name for v in verdicts.REGISTRY}) == len(verdicts.REGISTRY)
    assert len({v.symbol for v in verdicts.REGISTRY} | {"-", grid.INTERRUPTED, grid.LIMITED}) == len(verdicts.REGISTRY) + 3
    sources = (verdicts.PASSED, verdicts.RAISED, verdicts.JUDGED, verdicts.RAISED_OR_JUDGED)
    assert {v.source for v in verdicts.REGISTRY} <= set(sources)
    assert [v.name for v in verdicts.REGISTRY if not v.failure] == [verdicts.PASS]


def test_the_tuples_are_the_registrys():
    assert verdicts.VERDICTS == tuple(v.name for v in verdicts.REGISTRY)
    every_failure = {v.name for v in verdicts.REGISTRY if v.failure}
    both = {v.name for v in verdicts.REGISTRY if v.source == verdicts.RAISED_OR_JUDGED}
    assert set(verdicts.RAISED_VERDICTS) | set(verdicts.JUDGED_VERDICTS) | both == every_failure
    assert not set(verdicts.RAISED_VERDICTS) & set(verdicts.JUDGED_VERDICTS)
    # What scripts reproduce: every failure but a slow compile and the cells no script family has.
    assert set(verdicts.SCRIPTED_VERDICTS) == every_failure - {verdicts.COMPILE_TIMEOUT, verdicts.DATA_NOT_SHARDED}
