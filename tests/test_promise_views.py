"""The promises in every view: the comparison of two reports, Markdown, the HTML page (in node and in a
real browser), the terminal of a session whose suite declares them, ``-q`` included. Reports are built
from synthetic records (``tests/promise_records.py``); the grouping itself is tests/test_promises.py's.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
from keras_dtensor_conformance.report.compare import compare_lines, compare_reports
from keras_dtensor_conformance.report.html import html_page
from keras_dtensor_conformance.report.markdown import markdown

from conformance import promises as suite
from tests.promise_records import RECORDS, record, report_of, with_checks

def test_compare_says_which_promises_are_newly_kept_or_broken():
    old = report_of()
    new = report_of([r if r.id not in ("slot-lost", "both-lost") else record(r.id, "pass", "passed") for r in RECORDS]
                    + [record("op-numbers", "numerics", "failed", family="setup", entry="initialize")])
    change = compare_reports(old, new)["promises"]
    assert change["known"]
    assert [(e["name"], e["old"], e["new"]) for e in change["newly_kept"]] == [
        ("sharded-optimizer-state", "broken", "kept")]
    assert [(e["name"], e["old"], e["new"]) for e in change["newly_broken"]] == [("setup", "not tested", "broken")]
    # sharded-variables: broken -> expected-broken is no newly kept promise, but it is said
    assert [(e["name"], e["old"], e["new"]) for e in change["changed"]] == [
        ("sharded-variables", "broken", "expected-broken")]
    text = compare_lines(compare_reports(old, new))
    assert text[1] == "promises: 1 newly kept, 1 newly broken, 1 other changes"
    assert "  NEWLY BROKEN setup: not tested -> broken" in text
    assert "  NEWLY KEPT sharded-optimizer-state: broken -> kept" in text


def test_an_old_report_without_promises_compares_as_unknown():
    old = report_of()
    for key in ("promises", "unclaimed_failures"):
        del old[key]
    change = compare_reports(old, report_of())["promises"]
    assert change == {"known": False, "newly_kept": [], "newly_broken": [], "changed": []}
    assert "promises: unknown before" in compare_lines(compare_reports(old, report_of()))[1]
    # and a comparison saved before promises existed still renders
    saved = compare_reports(old, report_of())
    del saved["promises"]
    assert compare_lines(saved)[0].startswith("compared with Keras")


def test_markdown_leads_with_the_promise_table():
    report = report_of()
    report["compare"] = compare_reports(report_of(), report)
    text = markdown(report)
    assert text.index("### Promises of keras.distribution") < text.index("### Failures by cause")
    assert text.index("### Promises of keras.distribution") < text.index("### fit colshard")
    assert ("| **broken** | optimizer slots are sharded like their variable (`sharded-optimizer-state`) | 8 | "
            "4 | 2 | 0 | 1 | 0 | 1 |") in text
    assert "| not tested | a train step communicates within the layout's budget (`communication-budget`) | 0 |" in text
    assert "promises: 0 newly kept, 0 newly broken, 0 other changes" in text


#: A DOM just big enough for the report page's script: what it writes into each element is kept.
NODE_DOM = r"""
const fs = require("fs");
const html = fs.readFileSync(process.argv[2], "utf8");
const scripts = [...html.matchAll(/<script[^>]*>([\s\S]*?)<\/script>/g)].map(m => m[1]);
const els = {};
function el(id) {
  return els[id] = els[id] || {id, innerHTML: "", textContent: "", value: "", dataset: {}, options: [],
    classList: {toggle() {}}, add(o) { this.options.push(o); }, append() {}, addEventListener() {},
    insertAdjacentHTML(_, h) { this.innerHTML += h; }};
}
el("report-data").textContent = scripts[0];
global.document = {getElementById: el, createElement: () => el("x" + Math.random()), querySelectorAll: () => [],
                   body: {dataset: {}}};
global.Option = function (text, value) { this.text = text; this.value = value; };
eval(scripts[1]);
console.log(JSON.stringify({promises: els.promises.innerHTML, compare: els.compare ? els.compare.innerHTML : "",
                            filter: els["f-promise"].options.map(o => o.value),
                            rendered: document.body.dataset.rendered}));
"""


def test_the_html_page_shows_the_promises_and_filters_by_them(tmp_path):
    report = report_of()
    old = report_of([r for r in RECORDS if r.id != "crashed"])
    report["compare"] = compare_reports(old, report)
    page = tmp_path / "r.html"
    page.write_text(html_page(report))
    text = page.read_text()
    assert text.index('<div id="promises">') < text.index('<div id="clusters">')
    node = shutil.which("node")
    if node is None:
        pytest.skip("no node to run the page's script (test_report.py's browser test renders it where Chromium is)")
    script = tmp_path / "dom.js"
    script.write_text(NODE_DOM)
    shown = json.loads(subprocess.run([node, str(script), str(page)], capture_output=True, text=True,
                                      check=True).stdout)
    assert shown["rendered"] == "yes"
    rows = shown["promises"].split('<tr class="promise ')[1:]
    assert len(rows) == len(report["promises"])
    assert rows[1].startswith('s-broken" data-promise="sharded-optimizer-state" data-status="broken">')
    assert rows[2].startswith('s-not-tested" data-promise="communication-budget"')
    assert shown["filter"] == [p.name for p in suite.PROMISES]
    assert "promise newly broken: <code>runs-to-the-end</code> kept &rarr; broken" in shown["compare"]


PROMISE_CONFTEST = """
from keras_dtensor_conformance import Promise

def pytest_conformance_promises():
    return [
        Promise("slots", "optimizer slots sharded", tests=lambda c: c["axes"]["optimizer"] != "sgd",
                breaks=lambda c: c["verdict"] == "mixed-tensor"),
        Promise("compiles", "compiles", tests=lambda c: True, breaks=("compile-fallback",)),
        Promise("budget", "within budget", tests=lambda c: False, breaks=("over-budget",)),
    ]
"""


def test_a_session_leads_with_the_promises_its_suite_declares_even_under_q(inner):
    from tests.test_report import run

    inner.pytester.makeconftest(PROMISE_CONFTEST)
    run(inner, "--conformance-json", "old.json", broken="sgd-arrays")
    result = run(inner, "-q", "--conformance-json", "r.json", "--conformance-md", "r.md", "--conformance-compare",
                 "old.json", broken="adam-dataloader,sgd-arrays")
    out = result.stdout
    section = out[out.index("keras-dtensor-conformance report"):]
    lines = section.splitlines()
    start = lines.index("promises of keras.distribution (per promise, the cells that test it):")
    assert [line.split() for line in lines[start + 1:start + 4]] == [
        ["BROKEN", "slots", "4", "cells:", "kept", "on", "3", "where", "it", "could", "fail,", "not", "applicable",
         "on", "0,", "1", "broken;", "e.g.", "test_fit[dataloader-adam]"],
        ["BROKEN", "compiles", "6", "cells:", "kept", "on", "4", "where", "it", "could", "fail,", "not",
         "applicable", "on", "0,", "1", "broken,", "1", "not", "judged;", "e.g.", "test_fit[arrays-sgd]"],
        ["NOT", "TESTED", "budget", "no", "cell", "of", "this", "run", "tests", "it"],
    ]
    assert section.index("promises of keras.distribution") < section.index("failures by cause")
    assert "\nfit colshard\n" not in section  # -q: no grid, but the promises, causes and counts
    assert "6 cells: 1 compile-fallback, 1 mixed-tensor, 4 pass" in section
    assert "  NEWLY BROKEN slots: kept -> broken" in section
    report = json.loads((inner.pytester.path / "r.json").read_text())
    assert [(p["name"], p["status"]) for p in report["promises"]] == [
        ("slots", "broken"), ("compiles", "broken"), ("budget", "not tested")]
    assert report["compare"]["promises"]["newly_broken"][0]["name"] == "slots"
    assert "| **broken** | optimizer slots sharded (`slots`) | 4 | 3 | 1 | 0 | 0 | 0 |" in (
        inner.pytester.path / "r.md").read_text()


def test_the_promises_render_in_a_real_browser(inner, tmp_path):
    """Where Chromium is (CI installs it), the page's promise rows are the JSON's promises, in order."""
    from tests.test_report import chromium, run

    browser = chromium()
    inner.pytester.makeconftest(PROMISE_CONFTEST)
    run(inner, "--conformance-json", "r.json", "--conformance-html", "r.html", broken="adam-dataloader")
    page = inner.pytester.path / "r.html"
    dom = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120, check=False,
    ).stdout
    assert 'data-rendered="yes"' in dom, dom[-2000:]
    report = json.loads((inner.pytester.path / "r.json").read_text())
    shown = re.findall(r'<tr class="promise s-[\w-]+" data-promise="([\w-]+)" data-status="([\w -]+)"', dom)
    assert shown == [(p["name"], p["status"]) for p in report["promises"]] == [
        ("slots", "broken"), ("compiles", "kept"), ("budget", "not tested")]


def test_the_html_cell_detail_shows_each_checks_outcome(tmp_path):
    """A click on a cell shows what each of its checks found, why where not applicable."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("no node to run the page's script")
    cell = with_checks(record("rep", "pass", "passed", layout="replicated"), variable_layouts="not applicable",
                       single_process_numbers="held")
    cell.checks["variable-layouts"]["why"] = "the layout asks no variable for a layout"
    page = tmp_path / "r.html"
    page.write_text(html_page(report_of([cell])))
    script = tmp_path / "dom.js"
    script.write_text(NODE_DOM.replace("addEventListener() {}", "addEventListener(_, f) { this.listener = f; }")
                      .replace("console.log(", 'els.grids.listener({target: {closest: () => ({dataset: {i: "0"}})}});\n'
                               "console.log(JSON.stringify(els.details.textContent));\nif (0) console.log("))
    shown = json.loads(subprocess.run([node, str(script), str(page)], capture_output=True, text=True,
                                      check=True).stdout)
    assert "checks:\n  variable-layouts: not applicable (the layout asks no variable for a layout)\n" \
           "  single-process-numbers: held\n" in shown
