"""Failed cells are grouped by cause (``causes``, ``clusters``): the innermost exception, with
Keras' wrapper lines, numbers and ANSI codes taken out, and the innermost frame of the build.

The rank failures here are real exceptions raised from files of a fake build tree, turned into
outcomes as a rank turns them (``RankError.from_exception``); the end-to-end proof on a real
build is ``test_a_mutant_build_is_one_cluster_at_its_line``.
"""

from __future__ import annotations

import json

import pytest
from keras_dtensor_conformance.rank.outcomes import CRASH, OK, RAISED, PoolResult, RankError, RankOutcome
from keras_dtensor_conformance.report import causes, clusters
from keras_dtensor_conformance.report.compare import compare_reports
from keras_dtensor_conformance.report.markdown import markdown
from keras_dtensor_conformance.report.recorder import CellRecord
from keras_dtensor_conformance.report.results import build_report

from tests import mutants
from tests.test_mutants import run_suite

BOLD, RESET = "\x1b[1m", "\x1b[0m"


@pytest.fixture
def build_tree(tmp_path):
    """A tree holding keras/__init__.py and one module of the build that raises as Keras does:
    the real error, re-raised from a wrapper whose message leads with Keras' headline."""
    package = tmp_path / "keras"
    (package / "src").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "src" / "ops.py").write_text(
        "def dispatch(shape):\n"
        "    raise RuntimeError(f'aten.sub.Tensor: got mixed torch.Tensor and DTensor, shape {shape}')\n"
        "\n"
        "def call(shape):\n"
        "    try:\n"
        "        dispatch(shape)\n"
        "    except RuntimeError as e:\n"
        "        raise ValueError(\n"
        f"            'Exception encountered when calling Dense.call().\\n\\n{BOLD}' + str(e) + '{RESET}'\n"
        "            '\\n\\nArguments received by Dense.call():\\n  • inputs=x'\n"
        "        ) from e\n"
    )
    return tmp_path


def raised(build_tree, shape) -> RankError:
    import importlib.util

    spec = importlib.util.spec_from_file_location("fake_keras_ops", build_tree / "keras" / "src" / "ops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        module.call(shape)
    except ValueError as exc:
        return RankError.from_exception(exc)
    raise AssertionError("the fake build did not raise")


def keras_file(build_tree) -> str:
    return str(build_tree / "keras" / "__init__.py")


def test_the_cause_is_the_innermost_exception_at_the_builds_innermost_frame(build_tree):
    result = PoolResult("train", [RankOutcome(0, RAISED, error=raised(build_tree, [24, 6]), failed_at=1.0),
                                  RankOutcome(1, OK)])
    assert causes.cause_of("message", result, keras_file(build_tree)) == {
        "exception": "RuntimeError: aten.<op>: got mixed torch.Tensor and DTensor, shape [N, N]",
        "where": "keras/src/ops.py:2 in dispatch",
        "ops": ["aten.sub.Tensor"],
    }


def test_a_keras_wrapper_headline_is_passed_over_to_the_message_it_wraps():
    assert causes.normalise(causes.innermost_line([
        f"IndexError: Exception encountered when calling Dense.call().\n\n{BOLD}The shape of the mask [24, 6] at "
        f"index 1 does not match{RESET}\n\nArguments received by Dense.call():\n  • inputs=torch.Tensor(shape=[24])"
    ])) == "IndexError: The shape of the mask [N, N] at index N does not match"


def test_a_crash_is_placed_at_the_dying_threads_innermost_frame_of_the_build(build_tree):
    ops = build_tree / "keras" / "src" / "ops.py"
    stderr = (
        "Fatal Python error: Aborted\n\n"
        'Thread 0x01 (most recent call first):\n  File "/usr/lib/python3.11/threading.py", line 982 in run\n\n'
        f'Current thread 0x02 (most recent call first):\n  File "/site/torch/_ops.py", line 1279 in __call__\n'
        f'  File "{ops}", line 2 in dispatch\n  File "{ops}", line 6 in call\n\n'
    )
    crash = RankOutcome(0, CRASH, exitcode=-6, stderr=stderr, failed_at=2.0)
    peer = RankOutcome(1, RAISED, error=RankError("RuntimeError", "x", "", [
        "RuntimeError: [/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:61667: Connection reset by peer"]),
        failed_at=1.0)
    cause = causes.cause_of("message", PoolResult("f", [crash, peer]), keras_file(build_tree))
    assert cause == {"exception": "crashed, killed by signal 6 (SIGABRT)", "where": "keras/src/ops.py:2 in dispatch",
                     "ops": []}


def test_a_judged_verdict_is_its_first_line_with_numbers_normalised():
    assert causes.cause_of("rank 1: step_losses: max abs difference 0.0176 from the reference (rtol 1e-05)\nmore",
                           None, None) == {
        "exception": "rank N: step_losses: max abs difference N from the reference (rtol N)", "where": "", "ops": []}


def cell(id, verdict, outcome="xfailed", exception="E: boom", where="", **axes) -> dict:
    return {"id": id, "family": axes.pop("family", "fit colshard"), "verdict": verdict, "outcome": outcome,
            "axes": axes, "cause": {"exception": exception, "where": where}}


CELLS = [
    cell("a", "compile-fallback", exception="no graph", optimizer="sgd", compile="jit"),
    cell("b", "compile-fallback", exception="no graph", optimizer="adam", compile="jit"),
    cell("c", "compile-fallback", exception="no graph", optimizer="adam", compile="jit", family="fit rowshard"),
    cell("d", "error", outcome="failed", exception="IndexError: mask", where="keras/src/x.py:3 in f",
         optimizer="adam", compile="nojit"),
    cell("e", "pass", outcome="passed", optimizer="adam", compile="nojit"),
    cell("f", None, outcome="skipped", optimizer="adam", compile="nojit"),
]


def test_clusters_are_largest_first_with_what_their_cells_share():
    found = clusters.clusters(CELLS)
    assert [(c["verdict"], c["cells"], c["unexpected"], c["example"]) for c in found] == [
        ("compile-fallback", 3, 0, "a"), ("error", 1, 1, "d")]
    assert found[0]["shared"] == {"compile": "jit"}  # not the family, not the optimizer
    assert found[1]["where"] == "keras/src/x.py:3 in f"
    assert clusters.lines(found)[:2] == ["3 cells, all expected: compile-fallback: no graph",
                                         "    shared: compile jit; e.g. a"]


def test_compare_says_which_clusters_are_new_gone_grown_and_shrunk():
    old = clusters.clusters(CELLS[:2] + [cell("g", "numerics", exception="diff")])
    new = clusters.clusters(CELLS)
    change = clusters.changes(old, new)
    assert [c["cells"] for c in change["new"]] == [1] and change["new"][0]["key"].startswith("error | IndexError")
    assert change["gone"] == [{"key": "numerics | diff | ", "cells": 1}]
    assert change["grown"] == [{"key": "compile-fallback | no graph | ", "old": 2, "new": 3}]
    assert change["shrunk"] == []


def test_reports_lead_with_clusters_and_carry_no_ansi_codes(build_tree):
    error = raised(build_tree, [2, 3])
    record = CellRecord("test_fit[x]", "conformance/test_fit.py::test_fit[x]", "fit colshard", "sgd", "arrays/n",
                        {"optimizer": "sgd"}, verdict="mixed-tensor", outcome="failed",
                        message=f"{BOLD}mixed{RESET}", ranks=[{"rank": 0, "status": RAISED, "headline": f"{BOLD}h{RESET}",
                                                              "story": error.traceback, "duration": 0.1}],
                        cause=causes.cause_of("", PoolResult("f", [RankOutcome(0, RAISED, error=error)]),
                                              keras_file(build_tree)))
    report = build_report([record], {"keras_version": "3"}, 1.0)
    assert "\x1b" not in json.dumps(report)
    assert report["clusters"][0]["where"] == "keras/src/ops.py:2 in dispatch"
    text = markdown(report)
    assert text.index("Failures by cause") < text.index("### fit colshard")
    compared = compare_reports({"cells": [], "clusters": []}, report)
    assert [c["cells"] for c in compared["clusters"]["new"]] == [1]


def test_a_mutant_build_is_one_cluster_at_its_line(keras_nightly_tree, tmp_path):
    """foreach-plain-lr lets every ``torch._foreach_*`` update through the promotion mode's dispatch
    unpromoted: SGD fails on ``_foreach_add_``, Adam on ``_foreach_mul_``, both at that one line,
    and the report makes them one cluster that names the line and both operators."""
    case = next(c for c in mutants.CASES if c.mutant.name == "foreach-plain-lr")
    build = mutants.write_mutant(keras_nightly_tree, str(tmp_path / "build"), case.mutant)
    cells = [c for c in case.expected if case.expected[c] == "mixed-tensor"][:2]
    verdicts = run_suite(build, [f"conformance/test_fit.py::{c}" for c in cells], tmp_path)
    assert [verdicts[c] for c in cells] == ["mixed-tensor"] * len(cells)
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report["clusters"]) == 1, report["clusters"]
    found = report["clusters"][0]
    assert found["cells"] == len(cells)
    assert found["ops"] == ["aten._foreach_add_.List", "aten._foreach_mul_.Scalar"]
    assert "got mixed torch.Tensor and DTensor" in found["exception"]
    assert found["where"].startswith("keras/src/backend/torch/ops/core.py:"), found  # the mutated dispatch
