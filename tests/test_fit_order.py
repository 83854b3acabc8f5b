"""The order of a training cell's checks, written once (``fit_checks.fit_checks``) for the judge
and for a training cell's reproducer: the first failed check decides, the two outcomes that are
no verdict (numbers not comparable, no reference) come at their place in that order, each check
records what it found (held, failed, not applicable, not reached), and a difference from JAX is
arbitrated by the NumPy oracle."""

from __future__ import annotations

import types

import pytest
from keras_dtensor_conformance import FAILED, HELD, JAX_BACKEND_DIFFERS, NOT_APPLICABLE, NOT_JUDGED, NOT_REACHED
from keras_dtensor_conformance.verdicts import COMPILE_FALLBACK, ERROR, NUMERICS, SHARDING_LOST, CellFailure

from conformance import axes
from conformance.judge import fit_checks
from conformance.judge.cells import judge_fit

SPEC = axes.cell_spec("mlp", "adam", "arrays", "jit", "colshard")
#: Each check of fit_checks, and what it finds when the test makes it fail.
CHECKS = {
    "frozen_changed": (NUMERICS, "frozen kernel changed"),
    "sharding_lost": (SHARDING_LOST, "kernel replicated"),
    "step_communication": ("over-budget", "a full-size copy"),
    "reference_elsewhere": (ERROR, "reference on cpu, ranks on cuda"),
    "local_batch_statistics": "local batch statistics",
    "numbers_differ": (NUMERICS, "loss differs"),
    "masks_differ": (NUMERICS, "ranks' dropout masks differ"),
    "differs_from_jax": (NUMERICS, "weights differ from JAX"),
    "jax_layouts_differ": (JAX_BACKEND_DIFFERS, "the JAX backend shards the bias"),
    "not_compiled": (COMPILE_FALLBACK, "graph break"),
}
LAYOUTS = (fit_checks.VARIABLE_LAYOUTS, fit_checks.SLOT_LAYOUTS)


@pytest.fixture
def checks(monkeypatch):
    """fit_checks' checks replaced by stubs that record their calls and fail when told to; every
    check can fail on the cell (no scope says otherwise)."""
    state = types.SimpleNamespace(failing=set(), called=[])

    def stub(name):
        def check(*args):
            state.called.append(name)
            return CHECKS[name] if name in state.failing else None
        return check

    def sharding(*args):
        found = stub("sharding_lost")()
        return found, {name: (FAILED, "lost") if found else (HELD, "") for name in LAYOUTS}

    for name in CHECKS:
        if name != "sharding_lost":  # one look at variables and slots: sharding_checks, below
            monkeypatch.setattr(fit_checks, name, stub(name))
    monkeypatch.setattr(fit_checks, "sharding_checks", sharding)
    monkeypatch.setattr(fit_checks, "communication_scope", lambda *args: None)
    monkeypatch.setattr(fit_checks, "frozen_scope", lambda *args: None)
    return state


def _oracle(state, finding=None):
    def check():
        state.called.append("oracle")
        return finding
    return check


def outcomes_of(*args, **kwargs) -> dict[str, str]:
    return {name: outcome for name, (outcome, _) in fit_checks.fit_checks(*args, **kwargs)[1].items()}


def test_every_check_runs_in_order_when_all_pass(checks):
    found, outcomes = fit_checks.fit_checks(SPEC, [{}], 1, {}, oracle=_oracle(checks), jax={})
    assert found is None
    assert checks.called == ["frozen_changed", "sharding_lost", "step_communication", "reference_elsewhere", "local_batch_statistics",
                             "numbers_differ", "differs_from_jax", "jax_layouts_differ", "oracle",
                             "not_compiled"]
    assert list(outcomes) == list(fit_checks.CHECKS)
    # the MLP draws no dropout mask: its numbers are the single process's
    assert outcomes.pop(fit_checks.DROPOUT_MASKS) == (NOT_APPLICABLE, "the model draws no dropout mask")
    assert {outcome for outcome, _ in outcomes.values()} == {HELD}


def test_a_dropout_models_numbers_are_held_to_each_other_not_to_the_single_process(checks):
    dropout = axes.cell_spec("transformer-dropout", "sgd", "arrays", "jit", "colshard")
    found, outcomes = fit_checks.fit_checks(dropout, [{}], 1, {}, oracle=_oracle(checks), jax={})
    assert found is None and "numbers_differ" not in checks.called
    assert checks.called.index("masks_differ") == checks.called.index("local_batch_statistics") + 1
    assert outcomes[fit_checks.SINGLE_PROCESS_NUMBERS][0] == NOT_APPLICABLE
    assert outcomes[fit_checks.DROPOUT_MASKS] == (HELD, "")
    checks.failing = {"masks_differ", "not_compiled"}
    assert fit_checks.fit_failure(dropout, [{}], 1, {}) == CHECKS["masks_differ"]


@pytest.mark.parametrize("failing, found", [
    ({"frozen_changed", "sharding_lost", "numbers_differ"}, CHECKS["frozen_changed"]),
    ({"sharding_lost", "numbers_differ", "not_compiled"}, CHECKS["sharding_lost"]),
    ({"step_communication", "numbers_differ"}, CHECKS["step_communication"]),
    ({"reference_elsewhere", "numbers_differ"}, CHECKS["reference_elsewhere"]),
    ({"local_batch_statistics", "numbers_differ"}, (fit_checks.NOT_COMPARABLE, "local batch statistics")),
    ({"numbers_differ", "not_compiled"}, CHECKS["numbers_differ"]),
    ({"not_compiled"}, CHECKS["not_compiled"]),
])
def test_the_first_failed_check_decides(checks, failing, found):
    checks.failing = failing
    assert fit_checks.fit_failure(SPEC, [{}], 1, {}) == found


def test_after_the_first_failure_the_checks_are_not_reached(checks):
    checks.failing = {"step_communication", "numbers_differ"}
    outcomes = outcomes_of(SPEC, [{}], 1, {})
    assert outcomes[fit_checks.VARIABLE_LAYOUTS] == HELD and outcomes[fit_checks.STEP_COMMUNICATION] == FAILED
    assert {outcomes[name] for name in fit_checks.CHECKS[4:]} == {NOT_REACHED}
    checks.failing = {"numbers_differ"}
    outcomes = outcomes_of(SPEC, [{}], 1, {})
    assert outcomes[fit_checks.SINGLE_PROCESS_NUMBERS] == FAILED
    assert outcomes[fit_checks.JAX_NUMBERS] == outcomes[fit_checks.COMPILED] == NOT_REACHED


def test_a_check_not_reached_names_what_stopped_it(checks):
    """The first failed check, or the reference: a reference is no check, so it is named as itself."""
    def whys(*args):
        return {name: why for name, (outcome, why) in fit_checks.fit_checks(*args)[1].items() if outcome == NOT_REACHED}

    checks.failing = {"frozen_changed"}
    assert set(whys(SPEC, [{}], 1, {}).values()) == {"frozen-unchanged failed"}
    checks.failing = {"sharding_lost"}
    assert set(whys(SPEC, [{}], 1, {}).values()) == {"variable-layouts failed"}
    checks.failing = {"step_communication"}
    assert set(whys(SPEC, [{}], 1, {}).values()) == {"step-communication failed"}
    checks.failing = set()
    assert set(whys(SPEC, [{}], 1, None).values()) == {"the single-process reference failed"}
    checks.failing = {"local_batch_statistics"}
    assert set(whys(SPEC, [{}], 1, {}).values()) == {
        "the numbers cannot be compared with the single process's: local batch statistics"}
    checks.failing = {"numbers_differ"}
    assert set(whys(SPEC, [{}], 1, {}).values()) == {"single-process-numbers failed"}


def test_what_cannot_fail_on_a_cell_is_not_applicable(checks):
    nojit = dict(SPEC, compile="nojit")
    outcomes = outcomes_of(nojit, [{}], 1, {})  # no JAX run, no oracle (a reproducer's)
    assert outcomes[fit_checks.JAX_NUMBERS] == outcomes[fit_checks.ORACLE_NUMBERS] == NOT_APPLICABLE
    assert outcomes[fit_checks.COMPILED] == NOT_APPLICABLE
    outcomes = outcomes_of(nojit, [{}], 1, {}, oracle=lambda: (NOT_APPLICABLE, "no oracle for adafactor"), jax={})
    assert outcomes[fit_checks.ORACLE_NUMBERS] == NOT_APPLICABLE and outcomes[fit_checks.JAX_NUMBERS] == HELD


def test_the_oracle_arbitrates_a_difference_from_jax(checks):
    checks.failing = {"differs_from_jax"}
    # torch agrees with the oracle: the JAX backend is named, the torch checks held, compilation still judged
    found, outcomes = fit_checks.fit_checks(SPEC, [{}], 1, {}, oracle=_oracle(checks), jax={})
    assert found[0] == JAX_BACKEND_DIFFERS and "weights differ from JAX" in found[1]
    assert outcomes[fit_checks.JAX_NUMBERS] == (FAILED, "weights differ from JAX")
    assert outcomes[fit_checks.ORACLE_NUMBERS][0] == outcomes[fit_checks.COMPILED][0] == HELD
    checks.failing.add("not_compiled")  # a torch failure comes first
    assert fit_checks.fit_failure(SPEC, [{}], 1, {}, oracle=_oracle(checks), jax={}) == CHECKS["not_compiled"]
    checks.failing = {"differs_from_jax"}
    # the oracle against torch: torch's bug; no oracle: a difference, no side claimed
    found = fit_checks.fit_failure(SPEC, [{}], 1, {}, oracle=_oracle(checks, (NUMERICS, "oracle: weight w")), jax={})
    assert found[0] == NUMERICS and "the NumPy oracle disagrees with torch too" in found[1]
    found = fit_checks.fit_failure(SPEC, [{}], 1, {}, oracle=lambda: (NOT_APPLICABLE, "no oracle for lion"), jax={})
    assert found[0] == NUMERICS and "no NumPy oracle says which backend is right (no oracle for lion)" in found[1]
    assert "bug" not in found[1]


def test_the_oracle_runs_between_the_numbers_and_compilation(checks):
    checks.failing = {"not_compiled"}
    assert fit_checks.fit_failure(SPEC, [{}], 1, {}, oracle=_oracle(checks, (NUMERICS, "oracle"))) == \
        (NUMERICS, "oracle")
    assert checks.called[-3:] == ["differs_from_jax", "jax_layouts_differ", "oracle"]


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
    recorded = []
    with pytest.raises(CellFailure) as failure:
        judge_fit(SPEC, result, failed, 1, record=recorded.append)
    assert failure.value.verdict == ERROR and failure.value.result is failed
    assert failure.value.detail == "the single-process reference failed:\nrank 0: it raised"
    assert recorded[0][fit_checks.VARIABLE_LAYOUTS][0] == HELD  # recorded before the verdict is raised
    assert recorded[0][fit_checks.SINGLE_PROCESS_NUMBERS] == (NOT_JUDGED, "the single-process reference failed: rank 0: it raised")
    assert recorded[0][fit_checks.JAX_NUMBERS][0] == NOT_REACHED


def test_a_frozen_kernel_must_end_as_it_began():
    """``frozen_changed`` on hand-made evidence: a LoRA-frozen kernel that moved is ``numerics``
    naming it and the rank; one bit-equal passes; a model that freezes nothing cannot fail."""
    import numpy as np

    kernel = np.ones((2, 2), "float32")
    still = {"frozen": ["mlp/dense_a/kernel"], "initial_weights": {"mlp/dense_a/kernel": kernel},
             "weights": {"mlp/dense_a/kernel": kernel.copy()}}
    moved = dict(still, weights={"mlp/dense_a/kernel": kernel + 1e-7})
    assert fit_checks.frozen_changed([still, still]) is None and fit_checks.frozen_scope([still, still]) is None
    verdict, message = fit_checks.frozen_changed([still, moved])
    assert verdict == NUMERICS and message.startswith("rank 1: frozen mlp/dense_a/kernel changed in training")
    plain = {"frozen": [], "initial_weights": {}, "weights": {}}
    assert fit_checks.frozen_scope([plain, plain]) == "the model freezes no variable"


def test_a_frozen_variable_is_owed_no_optimizer_slots_without_jax():
    """Without the JAX reference's slot counts, the layout map and ``axes.SLOTS`` say which slots a
    laid-out variable needs: a frozen one (LoRA's kernel, in the evidence's ``frozen``) needs none."""
    from conformance import axes

    spec = axes.cell_spec("lora", "adam", "arrays", "nojit", "colshard")
    kernel = {"path": "mlp/dense_a/kernel", "type": "Parameter", "shape": (8, 16), "dtensor": True,
              "placements": ["R", "S(1)"], "local_shape": (8, 8)}
    value = {"stages": {"fit": [kernel]}, "slots": [], "unmatched_optimizer_variables": [],
             "frozen": ["mlp/dense_a/kernel"]}
    assert fit_checks.sharding_checks(spec, [value], 2)[0] is None
    found = fit_checks.sharding_checks(spec, [dict(value, frozen=[])], 2)[0]
    assert found[0] == SHARDING_LOST and "expected 2 optimizer slots for mlp/dense_a/kernel, found 0" in found[1]
