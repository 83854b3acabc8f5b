"""The report by promise: cells grouped by the promise of keras.distribution each tests and breaks.

Reports are built from synthetic records (``tests/promise_records.py``, no ranks); the views of the
grouping are tests/test_promise_views.py's. ``test_a_wrong_grouping_fails_the_grouping_checks`` runs
the grouping checks against deliberately wrong groupings: a check that cannot fail would prove nothing.
"""

from __future__ import annotations

import pytest
from keras_dtensor_conformance import VERDICTS, Promise
from keras_dtensor_conformance.report import promises

from conformance import promises as suite
from conformance import test_scenarios
from conformance.judge.scenarios import SCENARIO_JUDGES
from tests.promise_records import VARIABLE_LOST, by_name, measured, record, report_of, with_checks


def check_grouping(report: dict) -> None:
    """What the grouping of ``RECORDS`` must say: shared by the passing test and the mutants' one."""
    cells = {c["id"]: c["promises"] for c in report["cells"]}
    found = by_name(report)
    # A lost slot breaks the optimizer state, a lost variable the variables; a message with both, both.
    assert cells["slot-lost"]["sharded-optimizer-state"] == "broken"
    assert cells["slot-lost"]["sharded-variables"] == "kept"  # one check looked at both: the variables held
    assert cells["variable-lost"]["sharded-variables"] == "expected-broken"
    assert "sharded-optimizer-state" not in cells["variable-lost"]  # SGD keeps no slots: it does not test them
    assert cells["both-lost"]["sharded-variables"] == cells["both-lost"]["sharded-optimizer-state"] == "broken"
    # A crash broke "runs to the end" and proved nothing about the rest: not judged, never kept.
    assert cells["crashed"]["runs-to-the-end"] == "broken"
    assert cells["crashed"]["numbers-match-single-process"] == "not judged"
    assert cells["crashed"]["sharded-variables"] == "not judged"
    assert cells["numbers"]["numbers-match-single-process"] == "expected-broken"
    # A failure that comes after a promise was checked keeps it: the checks' order (sharding, numbers, compile).
    assert cells["numbers"]["sharded-variables"] == cells["numbers"]["runs-to-the-end"] == "kept"
    assert cells["fallback"]["sharded-variables"] == cells["fallback"]["numbers-match-single-process"] == "kept"
    assert cells["jit-numbers"]["compile"] == "not judged"  # compilation is checked after the numbers
    assert cells["fallback"]["compile"] == "expected-broken" and cells["kept-jit"]["compile"] == "kept"
    assert cells["skipped-jit"]["compile"] == "not tested"
    assert "compile" not in cells["dataparallel"] and "sharded-variables" not in cells["dataparallel"]
    assert cells["op-lost"]["ops-keep-placements"] == "broken" and "sharded-variables" not in cells["op-lost"]
    # Per promise: its cells' states counted, and its status.
    assert found["compile"] == {**found["compile"], "status": "expected-broken", "cells": 4, "kept": 1,
                                "expected_broken": 1, "not_tested": 1, "broken": 0, "not_judged": 1}
    assert found["sharded-variables"]["status"] == "broken"
    assert found["sharded-variables"]["broken_examples"] == ["variable-lost", "both-lost"]
    assert found["numbers-match-single-process"]["status"] == "broken"
    assert found["setup"]["status"] == found["communication-budget"]["status"] == "not tested"
    assert found["communication-budget"]["cells"] == 0
    assert report["unclaimed_failures"] == []


def test_cells_are_grouped_by_the_promise_their_verdict_breaks():
    report = report_of()
    check_grouping(report)
    assert [p["name"] for p in report["promises"]] == [p.name for p in suite.PROMISES]  # the suite's order
    assert list(report).index("promises") < list(report).index("clusters")


def _every_ran_cell_kept(promise, cell):  # mutant: a failed cell keeps the promises it does not break
    state = ORIGINAL_CELL_STATE(promise, cell)
    return promises.KEPT if state == promises.NOT_JUDGED else state


def _expected_is_broken(promise, cell):  # mutant: an expected failure counts as an unexpected one
    state = ORIGINAL_CELL_STATE(promise, cell)
    return promises.BROKEN if state == promises.EXPECTED_BROKEN else state


ORIGINAL_CELL_STATE = promises.cell_state


@pytest.mark.parametrize("mutate", [
    lambda mp: mp.setattr(promises, "cell_state", _every_ran_cell_kept),
    lambda mp: mp.setattr(promises, "cell_state", _expected_is_broken),
    lambda mp: mp.setattr(suite, "about_slots", lambda line: "optimizer slot " in line and "after" in line),
    lambda mp: mp.setattr(promises, "status", lambda counts: promises.KEPT if counts["kept"] else promises.NOT_TESTED),
    lambda mp: mp.setattr(Promise, "kept_by", lambda self, cell: False),
], ids=["failed-cells-keep-the-rest", "expected-counts-as-broken", "slots-taken-for-variables", "status-ignores-breaks",
        "later-failures-unjudge"])
def test_a_wrong_grouping_fails_the_grouping_checks(monkeypatch, mutate):
    mutate(monkeypatch)
    with pytest.raises(AssertionError):
        check_grouping(report_of())


def test_a_failure_no_promise_claims_is_listed_apart():
    report = report_of([record("a", "pass", "passed"), record("b", "a-new-verdict", "failed")])
    assert report["unclaimed_failures"] == ["b"]
    assert "1 failed cells break no declared promise" in promises.lines(report["promises"], ["b"])[-1]


def test_every_verdict_of_every_family_breaks_a_promise_the_cell_tests():
    """The suite's table leaves no failure out: each verdict, on a cell of each family, breaks at least one promise."""
    families = {"fit colshard": {"optimizer": "adam", "layout": "colshard", "compile": "jit"},
                "ops compiled": {"op": "add", "compile": "compiled"}, "setup": {"entry": "initialize"},
                "scenarios": {"scenario": "uneven-sharding"},
                "kerashub gemma": {"model": "gemma", "flow": "fit-adamw", "layout": "authors"}}
    for family, axes in families.items():
        for verdict in [*VERDICTS, suite.OVER_BUDGET]:
            if verdict == "pass":
                continue
            message = VARIABLE_LOST if family != "ops compiled" else "rank 0: the result is Replicate"
            cell = {"id": "x", "family": family, "axes": axes, "verdict": verdict, "outcome": "failed",
                    "message": message, "cause": None}
            broken = [p.name for p in suite.PROMISES if p.broken_by(cell)]
            if verdict == suite.OVER_BUDGET and family not in ("fit colshard", "kerashub gemma"):
                continue  # the budget is a training step's
            assert broken, f"{verdict} on a {family} cell breaks no promise"


def test_agreement_cells_test_and_break_metrics_and_callbacks_agree():
    """The cells of conformance/test_agreement.py (a ``metric`` or ``callback`` axis) are what the
    promise is about: a passing one keeps it, a numerics one breaks it; a training cell does not test it."""
    kept = record("mae-dataparallel", "pass", "passed", family="agreement metrics", metric="mae",
                  layout="dataparallel", compile="nojit")
    broken = record("earlystopping-dataparallel", "numerics", "failed", family="agreement callbacks",
                    callback="earlystopping", layout="dataparallel")
    plain = record("adam-fit", "pass", "passed")
    states = {c["id"]: c["promises"] for c in report_of([kept, broken, plain])["cells"]}
    assert states["mae-dataparallel"]["metrics-and-callbacks-agree"] == "kept"
    assert states["earlystopping-dataparallel"]["metrics-and-callbacks-agree"] == "broken"
    assert "metrics-and-callbacks-agree" not in states["adam-fit"]


def test_a_failure_checked_later_keeps_what_was_checked_before_it():
    """The checks run in order (a training cell: sharding, communication, numbers, compilation; an op
    cell: value, placements, compilation), so a cell that failed a later check kept the earlier promises."""
    fallback = record("fallback", "compile-fallback", "xfailed", "no graph", compile="jit")
    fallback.communication = {"count": 9, "bytes": 3896}
    over = record("over", "over-budget", "failed", "ranks 0, 1: all_gather_into_tensor ...")
    over.communication = {"count": 9, "bytes": 3896}
    op = record("op-fallback", "compile-fallback", "xfailed", "compiled 0 graph(s)", family="ops compiled",
                op="add", operand="tensor", placement="shard1", compile="compiled")
    states = {c["id"]: c["promises"] for c in report_of([fallback, over, op])["cells"]}
    assert states["fallback"]["communication-budget"] == "kept"
    assert states["over"]["communication-budget"] == "broken"
    assert states["over"]["sharded-variables"] == states["over"]["sharded-optimizer-state"] == "kept"
    assert states["over"]["numbers-match-single-process"] == "not judged"
    assert states["op-fallback"]["ops-keep-placements"] == "kept"


def test_the_sharding_scenarios_follow_the_scenarios_judges():
    """A scenario is in the sharding set exactly when its judge checks a kernel's sharding."""
    sharding_judges = {"partial", "uneven", "rank-zero-only", "changed", "reshaped", "integer", "precision", "saved"}
    assert sharding_judges <= set(SCENARIO_JUDGES)
    judge_of = {name: entry[2] for name, entry in test_scenarios.SCENARIOS.items()}
    assert suite.SHARDING_SCENARIOS == {n for n, j in judge_of.items() if j in sharding_judges}


def test_a_failure_in_the_input_code_breaks_per_process_input():
    cell = record("input", "error", "failed")
    cell.cause = {"exception": "ValueError: x", "where": "keras/src/backend/torch/distribution_lib.py:290 in "
                                                        "distribute_data_input", "ops": []}
    states = report_of([cell])["cells"][0]["promises"]
    assert states["per-process-input"] == states["runs-to-the-end"] == "broken"
    assert states["numbers-match-single-process"] == "not judged"


def test_a_promise_is_one_entry_and_a_duplicate_name_is_refused():
    checkpoints = Promise("checkpoints", "checkpoints resume", tests=lambda c: c["family"] == "checkpoints",
                          breaks=("numerics",))
    report = report_of([record("ck", "numerics", "failed", family="checkpoints")], [*suite.PROMISES, checkpoints])
    assert by_name(report)["checkpoints"]["status"] == "broken"
    with pytest.raises(ValueError, match="two promises are named 'setup'"):
        report_of(table=[*suite.PROMISES, suite.PROMISES[-4]])


def test_keras_sharded_cells_test_keras_shards_input_and_hand_fed_cells_do_not():
    """issue 19: a Keras-sharded cell (``test_data_sharding.py``) keeps ``keras-shards-input`` when it
    passes and breaks it when Keras did not shard (or an uneven cell left a process waiting); a
    hand-fed training cell does not test it, and the Keras-sharded cells do not test the hand-fed
    ``per-process-input``."""
    family = "keras-sharded dataparallel"
    kept = record("pydataset-dataparallel", "pass", "passed", family=family, data="pydataset")
    refused = record("arrays-dataparallel", "data-not-sharded", "xfailed", "Keras refused to shard", family=family)
    crashed = record("pydataset-uneven-dataparallel", "crash", "failed", family=family, uneven=True)
    hand_fed = record("adam-fit", "pass", "passed", family="fit dataparallel hand-fed", layout="dataparallel")
    report = report_of([kept, refused, crashed, hand_fed])
    states = {c["id"]: c["promises"] for c in report["cells"]}
    assert states["pydataset-dataparallel"]["keras-shards-input"] == "kept"
    assert states["arrays-dataparallel"]["keras-shards-input"] == "expected-broken"
    assert states["pydataset-uneven-dataparallel"]["keras-shards-input"] == "broken"
    assert "keras-shards-input" not in states["adam-fit"]
    assert states["adam-fit"]["per-process-input"] == "kept"
    assert "per-process-input" not in states["pydataset-dataparallel"]
    assert report["unclaimed_failures"] == []


def test_a_promise_counts_a_cell_from_its_checks_outcomes():
    """Kept only where a check of the promise held; not applicable where none could fail, counted
    apart; a JAX difference breaks agreeing with JAX, not the single-process promise."""
    dataparallel = with_checks(measured(record("dp", "pass", "passed", layout="dataparallel")),
                               variable_layouts="not applicable",
                               slot_layouts="not applicable", step_communication="held",
                               single_process_numbers="held", jax_numbers="held", oracle_numbers="not applicable",
                               compiled="not applicable")
    replicated = with_checks(measured(record("rep", "pass", "passed", layout="replicated")),
                             variable_layouts="not applicable", slot_layouts="not applicable",
                             step_communication="not applicable",
                             single_process_numbers="held")
    schedulefree = with_checks(measured(record("sf", "numerics", "xfailed", "torch differs from JAX ...",
                                               optimizer="schedulefreeadamw")),
                               variable_layouts="held", slot_layouts="held", step_communication="held",
                               single_process_numbers="held", jax_numbers="failed",
                               oracle_numbers="not applicable", compiled="not reached")
    report = report_of([dataparallel, replicated, schedulefree])
    states = {c["id"]: c["promises"] for c in report["cells"]}
    assert states["rep"]["communication-budget"] == "not applicable"
    assert "sharded-variables" not in states["rep"]  # a replicated layout is not one the promise tests
    assert states["dp"]["communication-budget"] == states["dp"]["per-process-input"] == "kept"
    assert "per-process-input" not in states["rep"]  # one batch shard: not a cell of that promise
    assert states["sf"]["numbers-match-single-process"] == "kept"
    assert states["sf"]["agrees-with-jax-backend"] == "expected-broken"
    assert "compile" not in states["sf"]  # a nojit cell: not one of compile's, whatever it recorded
    found = by_name(report)
    assert (found["communication-budget"]["kept"], found["communication-budget"]["not_applicable"]) == (2, 1)
    line = next(line for line in promises.lines(report["promises"], []) if " communication-budget " in line)
    assert "3 cells: kept on 2 where it could fail, not applicable on 1" in line
    # every cell is nojit: none is compile's, though each recorded its compile check
    assert found["compile"]["cells"] == 0 and found["compile"]["status"] == "not tested"


def test_a_promise_counts_only_the_cells_it_tests():
    """The judge records every check on every training cell, so a nojit cell records ``compiled``
    (not applicable) and a cell whose step was not measured ``step-communication``: they are not
    the cells of ``compile`` or ``communication-budget`` (``Promise.tests``), and are not counted
    there as not applicable. A failure that breaks a promise counts under it wherever it is."""
    later = {"frozen_unchanged": "not applicable", "single_process_numbers": "held", "jax_numbers": "held",
             "oracle_numbers": "held"}
    nojit = with_checks(measured(record("nojit", "pass", "passed")), variable_layouts="held", slot_layouts="held",
                        step_communication="held", compiled="not applicable", **later)
    jit = with_checks(measured(record("jit", "pass", "passed", compile="jit")), variable_layouts="held",
                      slot_layouts="held", step_communication="not applicable", compiled="held", **later)
    unmeasured = with_checks(record("unmeasured", "pass", "passed", compile="spe4"), variable_layouts="held",
                             slot_layouts="held", step_communication="not applicable", compiled="not applicable",
                             **later)
    replicated = with_checks(measured(record("rep", "pass", "passed", layout="replicated")),
                             variable_layouts="not applicable", slot_layouts="not applicable",
                             step_communication="not applicable", compiled="not applicable", **later)
    # a layout the promise does not test, whose check failed all the same (a variable the JAX backend laid out)
    lost = with_checks(measured(record("dp-lost", "sharding-lost", "failed", VARIABLE_LOST, layout="dataparallel")),
                       variable_layouts="failed", slot_layouts="held", **{name: "not reached" for name in (
                           "step_communication", "single_process_numbers", "jax_numbers", "oracle_numbers",
                           "compiled")}, frozen_unchanged="not applicable")
    report = report_of([nojit, jit, unmeasured, replicated, lost])
    states = {c["id"]: c["promises"] for c in report["cells"]}
    found = by_name(report)
    assert [cell for cell in states if "compile" in states[cell]] == ["jit"]
    assert (found["compile"]["cells"], found["compile"]["kept"], found["compile"]["not_applicable"]) == (1, 1, 0)
    assert "unmeasured" not in [cell for cell in states if "communication-budget" in states[cell]]
    assert (found["communication-budget"]["kept"], found["communication-budget"]["not_applicable"]) == (1, 2)
    assert "sharded-variables" not in states["rep"]
    assert found["sharded-variables"]["not_applicable"] == 0
    assert states["dp-lost"]["sharded-variables"] == "broken"
    line = next(line for line in promises.lines(report["promises"], []) if " compile " in line)
    assert "1 cells: kept on 1 where it could fail, not applicable on 0" in line


def test_on_batch_cells_test_and_break_on_batch_apis_agree():
    """The cells of conformance/test_on_batch.py (family ``on-batch``) are what the promise is about:
    a passing one keeps it, a numerics one breaks it, an exception on a rank does not (it breaks
    runs-to-the-end); a training cell does not test it."""
    kept = record("evaluate-colshard", "pass", "passed", family="on-batch", api="evaluate", layout="colshard")
    broken = record("test_on_batch-dataparallel", "numerics", "failed", family="on-batch", api="test_on_batch",
                    layout="dataparallel")
    plain = record("adam-fit", "pass", "passed")
    states = {c["id"]: c["promises"] for c in report_of([kept, broken, plain])["cells"]}
    assert states["evaluate-colshard"]["on-batch-apis-agree"] == "kept"
    assert states["test_on_batch-dataparallel"]["on-batch-apis-agree"] == "broken"
    assert "on-batch-apis-agree" not in states["adam-fit"]


def test_a_frozen_kernel_that_trained_breaks_frozen_stays_frozen_and_leaves_the_rest_unjudged():
    """The frozen check comes first: a LoRA cell whose frozen kernel moved breaks frozen-stays-frozen,
    and the layouts and numbers it never reached are not judged, not kept. A LoRA cell that kept its
    frozen kernel and stopped at its layouts keeps frozen-stays-frozen and has not judged the numbers."""
    later = dict(variable_layouts="not reached", slot_layouts="not reached", step_communication="not reached",
                 single_process_numbers="not reached", jax_numbers="not reached",
                 oracle_numbers="not reached", compiled="not reached")
    moved = with_checks(record("lora-adam-arrays-nojit-colshard", "numerics", "failed",
                               "rank 0: frozen mlp/dense_a/kernel changed in training", model="lora"),
                        frozen_unchanged="failed", **later)
    lost = with_checks(record("lora-adam-arrays-nojit-rowshard", "sharding-lost", "failed", VARIABLE_LOST,
                              model="lora", layout="rowshard"),
                       frozen_unchanged="held", **dict(later, variable_layouts="failed", slot_layouts="held"))
    plain = with_checks(record("adam-arrays-nojit-colshard", "pass", "passed"), frozen_unchanged="not applicable",
                        **{name: "held" for name in later})
    states = {c["id"]: c["promises"] for c in report_of([moved, lost, plain])["cells"]}
    assert states["lora-adam-arrays-nojit-colshard"]["frozen-stays-frozen"] == "broken"
    assert states["lora-adam-arrays-nojit-colshard"]["numbers-match-single-process"] == "not judged"
    assert states["lora-adam-arrays-nojit-colshard"]["sharded-variables"] == "not judged"
    assert states["lora-adam-arrays-nojit-rowshard"]["frozen-stays-frozen"] == "kept"
    assert states["lora-adam-arrays-nojit-rowshard"]["numbers-match-single-process"] == "not judged"
    assert states["adam-arrays-nojit-colshard"]["frozen-stays-frozen"] == "not applicable"
    # an older report, without check outcomes: the frozen numerics keeps nothing it came before
    bare = record("lora-adam-arrays-nojit-colshard", "numerics", "failed",
                  "rank 0: frozen mlp/dense_a/kernel changed in training", model="lora")
    states = report_of([bare])["cells"][0]["promises"]
    assert states["frozen-stays-frozen"] == "broken" and states["sharded-variables"] == "not judged"
