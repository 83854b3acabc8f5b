"""The order of a training cell's checks, written once (``fit_checks.fit_failure``) for the judge
and for a training cell's reproducer: the first failed check decides, and the two outcomes that
are no verdict (numbers not comparable, no reference) come at their place in that order."""

from __future__ import annotations

import types

import pytest
from keras_dtensor_conformance.verdicts import COMPILE_FALLBACK, ERROR, NUMERICS, SHARDING_LOST, CellFailure

from conformance import axes
from conformance.judge import fit_checks, judge_fit

SPEC = axes.cell_spec("mlp", "adam", "arrays", "jit", "colshard")
#: Each check of fit_checks, and what it finds when the test makes it fail.
CHECKS = {
    "sharding_lost": (SHARDING_LOST, "kernel replicated"),
    "reference_elsewhere": (ERROR, "reference on cpu, ranks on cuda"),
    "local_batch_statistics": "local batch statistics",
    "numbers_differ": (NUMERICS, "loss differs"),
    "not_compiled": (COMPILE_FALLBACK, "graph break"),
}


@pytest.fixture
def checks(monkeypatch):
    """fit_checks' checks replaced by stubs that record their calls and fail when told to."""
    state = types.SimpleNamespace(failing=set(), called=[])

    def stub(name):
        def check(*args):
            state.called.append(name)
            return CHECKS[name] if name in state.failing else None
        return check

    for name in CHECKS:
        monkeypatch.setattr(fit_checks, name, stub(name))
    return state


def _oracle(state, finding=None):
    def check():
        state.called.append("oracle")
        return finding
    return check


def test_every_check_runs_in_order_when_all_pass(checks):
    assert fit_checks.fit_failure(SPEC, [{}], 1, {}, oracle=_oracle(checks)) is None
    assert checks.called == ["sharding_lost", "reference_elsewhere", "local_batch_statistics", "numbers_differ",
                             "oracle", "not_compiled"]


@pytest.mark.parametrize("failing, found", [
    ({"sharding_lost", "numbers_differ", "not_compiled"}, CHECKS["sharding_lost"]),
    ({"reference_elsewhere", "numbers_differ"}, CHECKS["reference_elsewhere"]),
    ({"local_batch_statistics", "numbers_differ"}, (fit_checks.NOT_COMPARABLE, "local batch statistics")),
    ({"numbers_differ", "not_compiled"}, CHECKS["numbers_differ"]),
    ({"not_compiled"}, CHECKS["not_compiled"]),
])
def test_the_first_failed_check_decides(checks, failing, found):
    checks.failing = failing
    assert fit_checks.fit_failure(SPEC, [{}], 1, {}) == found


def test_the_oracle_runs_between_the_numbers_and_compilation(checks):
    checks.failing = {"not_compiled"}
    assert fit_checks.fit_failure(SPEC, [{}], 1, {}, oracle=_oracle(checks, (NUMERICS, "oracle"))) == \
        (NUMERICS, "oracle")
    assert checks.called[-2:] == ["numbers_differ", "oracle"]


def test_a_failed_reference_comes_after_the_sharding(checks):
    assert fit_checks.fit_failure(SPEC, [{}], 1, None)[0] == fit_checks.NO_REFERENCE
    checks.failing = {"sharding_lost"}
    assert fit_checks.fit_failure(SPEC, [{}], 1, None) == CHECKS["sharding_lost"]


def test_the_judge_skips_what_is_not_comparable_and_blames_a_failed_reference_on_the_harness(checks):
    result = types.SimpleNamespace(ok=True, values=[{}])
    reference = types.SimpleNamespace(ok=True, values=[{}], story=lambda: "the reference's story")
    checks.failing = {"local_batch_statistics"}
    with pytest.raises(pytest.skip.Exception, match="local batch statistics"):
        judge_fit(SPEC, result, reference, 1)
    failed = types.SimpleNamespace(ok=False, values=[None], story=lambda: "rank 0: it raised")
    with pytest.raises(CellFailure) as failure:
        judge_fit(SPEC, result, failed, 1)
    assert failure.value.verdict == ERROR and failure.value.result is failed
    assert failure.value.detail == "the single-process reference failed:\nrank 0: it raised"
