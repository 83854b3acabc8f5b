"""The conformance report: terminal grid, JSON, Markdown, HTML (checked in a real headless
Chromium), junitxml properties, and the comparison of two runs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET

import pytest

CELLS = """
import os
import pytest
from keras_dtensor_conformance.verdicts import CellFailure

BROKEN = set(os.environ.get("BROKEN_CELLS", "").split(","))
VERDICT = {"adam": "mixed-tensor", "sgd": "compile-fallback", "lion": "numerics"}

CELLS = [
    pytest.param(opt, data, id=f"{data}-{opt}", marks=pytest.mark.cell(
        family="fit colshard", row=opt, column=data + "/nojit", optimizer=opt, data=data))
    for data in ["arrays", "dataloader"] for opt in ["adam", "sgd", "lion"]
]

@pytest.mark.parametrize("opt, data", CELLS)
def test_fit(opt, data):
    if f"{opt}-{data}" in BROKEN:
        raise CellFailure(VERDICT[opt], f"{opt} broke on {data}")
"""


def run(inner, *args, broken=""):
    inner.pytester.makepyfile(test_cells=CELLS)
    env = inner.env()
    env["BROKEN_CELLS"] = broken
    return subprocess.run(inner.command(*args), cwd=inner.pytester.path, env=env, capture_output=True, text=True)


def test_grid_counts_and_files(inner):
    result = run(inner, "--conformance-json", "r.json", "--conformance-md", "r.md", "--conformance-html", "r.html",
                 "--junitxml", "j.xml", broken="adam-dataloader,sgd-arrays")
    out = result.stdout
    assert result.returncode == 1, out
    assert "keras-dtensor-conformance report" in out and "M=mixed-tensor" in out
    section = out[out.index("keras-dtensor-conformance report"):]
    causes = section[section.index("failures by cause, largest first:"):section.index("\nfit colshard\n")]
    assert causes.splitlines()[1:5] == [  # before the grids: one cluster per cause, largest first
        "1 cells, 1 unexpected: compile-fallback: sgd broke on arrays",
        "    shared: family fit colshard, optimizer sgd, data arrays; e.g. test_fit[arrays-sgd]",
        "1 cells, 1 unexpected: mixed-tensor: adam broke on dataloader",
        "    shared: family fit colshard, optimizer adam, data dataloader; e.g. test_fit[dataloader-adam]",
    ]
    grid = section[section.index("\nfit colshard\n") + 1:].splitlines()
    assert grid[1].split() == ["arrays", "dataloader"]
    assert grid[3].split() == ["adam", ".", "M"]
    assert grid[4].split() == ["sgd", "F", "."]
    assert "6 cells: 1 compile-fallback, 1 mixed-tensor, 4 pass (2 failed, 4 passed)" in out

    report = json.loads((inner.pytester.path / "r.json").read_text())
    assert report["schema"] == "keras-dtensor-conformance/report" and report["version"] == 1
    assert report["build"]["nproc"] == 2 and report["build"]["keras_version"]
    cell = next(c for c in report["cells"] if c["id"] == "test_fit[dataloader-adam]")
    assert cell["axes"] == {"optimizer": "adam", "data": "dataloader"}
    assert (cell["verdict"], cell["outcome"], cell["message"]) == ("mixed-tensor", "failed", "adam broke on dataloader")
    # what the expectations were applied to, and every collected name: an expectations file can be written from these
    assert cell["text"].splitlines()[0] == "adam broke on dataloader"
    assert {c["id"] for c in report["cells"]} <= set(report["collected"])
    assert report["summary"]["verdicts"] == {"compile-fallback": 1, "mixed-tensor": 1, "pass": 4}

    md = (inner.pytester.path / "r.md").read_text()
    assert "### fit colshard" in md and "adam" in md and "| `test_fit[dataloader-adam]` | new failure | mixed-tensor |" in md

    junit = ET.parse(inner.pytester.path / "j.xml")
    assert_valid_xunit2(junit)
    suite = junit.getroot().find("testsuite")
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    cell = {k.split(" ", 1)[1]: v for k, v in props.items() if k.startswith("test_cells.py::test_fit[dataloader-adam] ")}
    assert cell == {"family": "fit colshard", "row": "adam", "column": "dataloader/nojit", "optimizer": "adam",
                    "data": "dataloader", "verdict": "mixed-tensor", "outcome": "failed"}, props


#: junit-10.xsd (the xunit2 family pytest writes by default): what a <testcase> may hold.
XUNIT2_TESTCASE_CHILDREN = {"skipped", "error", "failure", "system-out", "system-err"}


def assert_valid_xunit2(junit: ET.ElementTree) -> None:
    """The rules of junit-10.xsd a cell's properties could break: a <testcase> holds only its
    outcome and output, <properties> sit under <testsuite> only, each <property> has a name and a value."""
    root = junit.getroot()
    assert root.tag == "testsuites" and [c.tag for c in root] == ["testsuite"]
    for case in root.iter("testcase"):
        assert {c.tag for c in case} <= XUNIT2_TESTCASE_CHILDREN, (case.get("name"), [c.tag for c in case])
    for properties in root.iter("properties"):
        assert properties in list(root.find("testsuite"))
        assert all(p.tag == "property" and set(p.keys()) == {"name", "value"} for p in properties)


def test_junit_properties_follow_the_family():
    """xunit1 and legacy allow <properties> in a <testcase>: the cell's go there; xunit2 does not:
    they go to the suite, named by the cell's node id."""
    import types

    from keras_dtensor_conformance.report import recorder
    from keras_dtensor_conformance.report.recorder import CellRecord, junit_properties

    record = CellRecord("t[a]", "m.py::t[a]", "fit colshard", "adam", "arrays", {"optimizer": "adam"},
                        verdict="pass", outcome="passed", spec={"model": "mlp"})
    expected = [("family", "fit colshard"), ("row", "adam"), ("column", "arrays"), ("optimizer", "adam"),
                ("verdict", "pass"), ("outcome", "passed")]
    assert recorder.cell_properties(record) == expected  # no nested data: the spec is the JSON's
    for family in ("xunit1", "xunit2"):
        suite = []
        xml = types.SimpleNamespace(family=family, add_global_property=lambda k, v: suite.append((k, v)))
        config = types.SimpleNamespace(stash={__import__("_pytest.junitxml").junitxml.xml_key: xml})
        report = types.SimpleNamespace(user_properties=[("spec", {"model": "mlp"})])
        junit_properties(config, record, report)
        if family == "xunit1":
            assert (report.user_properties, suite) == (expected, [])
        else:
            assert (report.user_properties, suite) == ([], [(f"m.py::t[a] {k}", v) for k, v in expected])


def test_quiet_keeps_the_causes_and_counts_not_the_grids(inner):
    out = run(inner, "-q", broken="lion-arrays").stdout
    section = out[out.index("keras-dtensor-conformance report"):]
    assert section.index("failures by cause") < section.index("6 cells: 1 numerics, 5 pass"), section
    assert "\nfit colshard\n" not in section and "slowest cells" not in section  # no grid


def test_compare_reports_regressions_fixes_and_changes(inner):
    run(inner, "--conformance-json", "old.json", broken="adam-arrays,sgd-arrays")
    inner.pytester.path.joinpath("expect.txt").write_text(
        "test_fit[dataloader-lion]  numerics  known\ntest_fit[arrays-sgd]  compile-fallback  known\n"
    )
    args = ("--conformance-compare", "old.json", "--conformance-json", "new.json", "--conformance-expect", "expect.txt")
    # adam-arrays fixed, lion-dataloader regresses (but is expected, so the session still passes)
    result = run(inner, *args, broken="sgd-arrays,lion-dataloader")
    assert result.returncode == 0, result.stdout
    assert "1 regressions, 1 fixes, 0 changed verdicts" in result.stdout
    assert "REGRESSION test_fit[dataloader-lion]: pass -> numerics" in result.stdout
    assert "FIXED test_fit[arrays-adam]: mixed-tensor -> pass" in result.stdout
    compare = json.loads(inner.pytester.path.joinpath("new.json").read_text())["compare"]
    assert [e["id"] for e in compare["regressions"]] == ["test_fit[dataloader-lion]"]
    strict = run(inner, *args, "--conformance-fail-on-regression", broken="sgd-arrays,lion-dataloader")
    assert strict.returncode == 1
    # The last lines say why a session whose cells all passed or xfailed exits 1.
    assert ("keras-dtensor-conformance: 1 regression against old.json (test_fit[dataloader-lion]) and "
            "--conformance-fail-on-regression: failing the session") in strict.stdout.splitlines()[-3:], strict.stdout


#: Headless-capable browsers, in order: Debian's chromium (what .ci/run installs), then the names
#: other systems use. Ubuntu's ``chromium``/``chromium-browser`` are stubs asking for the snap,
#: which GitHub's runners do not have; those runners ship Google Chrome instead.
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


def working_browser(candidates=BROWSERS) -> tuple[str | None, list[str]]:
    """(the first candidate that really runs, what was wrong with each one tried before it)."""
    tried = []
    for name in candidates:
        path = shutil.which(name)
        if path is None:
            continue
        try:
            proc = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            tried.append(f"{path}: {exc}")
            continue
        if proc.returncode == 0 and re.search(r"(Chromium|Chrome) \d+", proc.stdout):
            return path, tried
        said = (proc.stdout + proc.stderr).strip().splitlines()
        tried.append(f"{path}: exit {proc.returncode}, {said[0] if said else 'no output'}")
    return None, tried


def chromium() -> str:
    found, tried = working_browser()
    if found is None:
        reason = "no working Chromium or Chrome (" + ("; ".join(tried) or "none on PATH") + ")"
        if os.environ.get("CI") and shutil.which("apt-get"):
            pytest.fail(f"the HTML report test needs a browser: {reason}; .ci/run installs Debian's chromium")
        pytest.skip(reason)
    return found


def test_a_snap_stub_is_not_a_browser(tmp_path, monkeypatch):
    """Ubuntu's chromium-browser prints a request for the snap and fails: it is passed over."""
    stub = tmp_path / "chromium-browser"
    stub.write_text("#!/bin/sh\necho \"Command '/usr/bin/chromium-browser' requires the chromium snap to be installed.\"\n"
                    "exit 1\n")
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    found, tried = working_browser(("chromium-browser",))
    assert found is None and "requires the chromium snap" in tried[0]


def test_html_renders_in_a_real_browser_and_matches_the_json(inner, tmp_path):
    browser = chromium()
    run(inner, "--conformance-json", "r.json", "--conformance-html", "r.html", broken="adam-dataloader,lion-arrays")
    page = inner.pytester.path / "r.html"
    assert "http://" not in page.read_text() and "https://" not in page.read_text()  # self-contained
    dom = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120,
    ).stdout
    assert 'data-rendered="yes"' in dom, dom[-2000:]
    report = json.loads((inner.pytester.path / "r.json").read_text())
    shown = {m.group(1): int(m.group(2)) for m in re.finditer(r'data-verdict="([\w-]+)">(\d+) ', dom)}
    assert shown.pop("cells") == len(report["cells"])
    assert shown == report["summary"]["verdicts"]
    assert len(re.findall(r'<td class="cell [^"]*" data-i="\d+"', dom)) == len(report["cells"])
    assert 'class="cell v-mixed-tensor o-failed"' in dom


def test_a_cell_whose_setup_fails_is_an_error_not_a_skip(inner):
    inner.pytester.makepyfile(test_cells="""
import pytest

@pytest.fixture
def broken_ranks():
    raise RuntimeError("the ranks could not start")

@pytest.mark.cell(family="fit colshard", row="adam", column="arrays/nojit", optimizer="adam")
def test_fit(broken_ranks):
    pass
""")
    result = inner.run("--conformance-json", "r.json")
    report = json.loads((inner.pytester.path / "r.json").read_text())
    (cell,) = report["cells"]
    assert (cell["verdict"], cell["outcome"]) == ("error", "failed"), result.stdout
    assert "the ranks could not start" in cell["message"]


def test_a_reference_that_fell_back_is_said_once_per_reason():
    from keras_dtensor_conformance.report.recorder import CellRecord
    from keras_dtensor_conformance.report.results import build_report, fallback_lines

    def cell(id, reference):
        return CellRecord(id, f"x::{id}", "fit colshard", "r", "c", {}, verdict="pass", outcome="passed",
                          reference=reference)

    why = "keras 3.15.1 at /r lacks it: NotInBuild: keras.optimizers.Lion does not exist in this build"
    report = build_report([cell("a", f"same build (fallback: {why})"), cell("b", "keras 3.15.1 at /r"),
                           cell("c", f"same build (fallback: {why})")], {}, 1.0)
    assert report["reference_fallbacks"] == [{"reference": "same build", "why": why, "cells": 2, "example": "a"}]
    assert fallback_lines(report) == [f"single-process reference: 2 cells fell back to the same build: {why} (e.g. a)"]
    assert fallback_lines(build_report([cell("b", "keras 3.15.1 at /r")], {}, 1.0)) == []
