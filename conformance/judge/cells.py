"""Evidence -> verdict for every cell family but the scenarios (``scenarios``): the ``judge_*``
function a test module hands its cell's evidence to.

Each raises ``CellFailure`` with the cell's verdict, or returns when the cell passes. Each check is
a function of its own, named for what it proves, taking only the evidence it needs, so a reader sees
what a verdict rests on. The checks of training and op cells' evidence are plain functions returning
``(verdict, message)`` in ``fit_checks.py`` and ``op_checks.py``, which this module raises: a
standalone reproducer (``--conformance-repro``) inlines those, so it judges with them too.
"""


from __future__ import annotations

import pytest
from keras_dtensor_conformance import (
    DATA_NOT_SHARDED,
    ERROR,
    NOT_APPLICABLE,
    NOT_JUDGED,
    NUMERICS,
    CellFailure,
    fail,
)

from conformance.judge import agreement, data_sharding, fit_checks, hub, on_batch, op_checks, oracle, workflows
from conformance.cell_data import batch_part


def check(condition: bool, verdict: str, message: str, result) -> None:
    """Raise ``CellFailure(verdict, message)`` unless ``condition`` holds."""
    if not condition:
        raise CellFailure(verdict, message, result)


def raise_found(found: tuple[str, str] | None, result) -> None:
    """Raise ``CellFailure(verdict, message)`` for what a check of ``fit_checks`` or ``op_checks``
    found (``(verdict, message)``; None: nothing)."""
    if found is not None:
        raise CellFailure(*found, result)


def ran_everywhere(result) -> None:
    """Every rank returned: otherwise the failure is classified from the exception chains."""
    if not result.ok:
        fail(result)


def skip_if_not_in_build(result) -> None:
    """A cell the build has no API for (e.g. an optimizer it lacks) is skipped with the reason."""
    for outcome in result.outcomes:
        if outcome.error is not None and outcome.error.type.endswith("NotInBuild"):
            pytest.skip(outcome.error.message)


# ---------------------------------------------------------------- training cells
# The checks of a trained cell's evidence, and their order, are ``conformance.judge.fit_checks``
# (plain functions, which a training cell's standalone reproducer inlines); judge_fit raises what they find.
def numbers_match_oracle(spec: dict, values: list[dict], reference: dict) -> tuple[str, str] | None:
    """In the oracle's core set, the reference and every rank equal the NumPy oracle (None), else
    their failure; outside it, ``(NOT_APPLICABLE, why)``.

    The reference comparison cannot see a maths bug the single-process and distributed runs
    share; the oracle (``conformance/judge/oracle.py``) is written from Keras' documented update
    rules and imports no Keras. The reference's losses, evaluate, predict and final weights, and
    every rank's final (global) weights, must match it, each from its own initial weights.
    """
    gap = oracle.scope(spec)
    if gap is not None:
        return NOT_APPLICABLE, gap
    problems = oracle.reference_problems(spec, reference, "the single-process reference: ")
    problems += oracle.distributed_problems(spec, values)
    return (NUMERICS, "\n".join(problems)) if problems else None


def oracle_outcome(spec: dict, values: list[dict], reference: dict) -> tuple[str, str] | None:
    """``numbers_match_oracle``, or ``(NOT_JUDGED, why)`` where the oracle itself raised on the cell's
    evidence (the report counts it; the cell's other checks still decide its verdict)."""
    try:
        return numbers_match_oracle(spec, values, reference)
    except Exception as error:  # noqa: BLE001 - the oracle's own failure is an outcome, said with its reason
        return NOT_JUDGED, f"the NumPy oracle raised {type(error).__name__}: {error}"


def judge_fit(spec: dict, result, reference, nproc: int, jax: dict | None = None, record=None,
              jax_failure: str | None = None) -> None:
    """A training cell: ran, kept its sharding, matched the reference (and the NumPy oracle in its
    core set, and ``jax``, the JAX reference's evidence, where one ran), and compiled if asked:
    ``fit_checks.fit_checks``' checks, in its order, each one's outcome handed to ``record`` (the
    ``record_checks`` fixture) before the verdict is raised. A cell whose numbers the reference
    does not define is skipped with the reason."""
    ran_everywhere(result)
    values = result.values
    evidence = reference.values[0] if reference.ok else None
    failure = None if reference.ok else "the single-process reference failed: " + reference.story().strip().splitlines()[0]
    found, outcomes = fit_checks.fit_checks(spec, values, nproc, evidence,
                                            oracle=lambda: oracle_outcome(spec, values, evidence), jax=jax,
                                            jax_failure=jax_failure, **({"reference_failure": failure} if failure else {}))
    if record is not None:
        record(outcomes)
    if found is None:
        return
    verdict, message = found
    if verdict == fit_checks.NOT_COMPARABLE:
        pytest.skip(message)
    if verdict == fit_checks.NO_REFERENCE:
        raise CellFailure(ERROR, "the single-process reference failed:\n" + reference.story(), reference)
    raise CellFailure(verdict, message, result)


# ---------------------------------------------------------------- op cells
def judge_op(op: str, compile_mode: str, result, record=None) -> None:
    """An op cell: ran, equals the same op on plain tensors, kept its placements, and compiled when asked.

    The checks are ``conformance.judge.op_checks`` (plain functions of the ranks' evidence), which an op
    cell's standalone reproducer inlines: the script and the suite judge with the same code.
    """
    ran_everywhere(result)
    found, outcomes = op_checks.op_outcomes(op, compile_mode, result.values)
    if record is not None:
        record(outcomes)
    raise_found(found, result)


# ---------------------------------------------------------------- setup cells
def judge_setup(result) -> None:
    """A setup cell passes when the keras.distribution entry point ran on every rank."""
    ran_everywhere(result)


# ---------------------------------------------------------------- agreement cells
def judge_agreement(spec: dict, result, reference) -> None:
    """A metrics or callback cell: ``agreement.agreement_failure``'s checks. A rank that did not return
    is judged by the decisions every rank printed before it (a callback that decided alone), else
    classified as any cell's failure."""
    values = [o.value if o.ok else None for o in result.outcomes]
    evidence = reference.values[0] if reference.ok else None
    found = agreement.agreement_failure(spec, values, [o.stdout for o in result.outcomes], evidence)
    if found is None:
        return
    verdict, message = found
    if verdict == agreement.RANKS_FAILED:
        fail(result)
    if verdict == agreement.NO_REFERENCE:
        raise CellFailure(ERROR, "the single-process reference failed:\n" + reference.story(), reference)
    raise CellFailure(verdict, message if result.ok else f"{message}\nthen: {result.summary()}", result)


def judge_on_batch(spec: dict, result, reference) -> None:
    """An on-batch cell: ran everywhere, then ``on_batch.on_batch_failure``'s checks against the
    single process's run over the global batch."""
    ran_everywhere(result)
    if not reference.ok:
        raise CellFailure(ERROR, "the single-process reference failed:\n" + reference.story(), reference)
    raise_found(on_batch.on_batch_failure(spec, result.values, reference.values[0]), result)


# ---------------------------------------------------------------- workflow cells
def flow_ran(result, reference) -> None:
    """A flow's cell ran everywhere (a flow the process count cannot run skips with the reason), and so did
    the one process it is judged against (else the harness' ``error``)."""
    ran_everywhere(result)
    skips = [v["skip"] for v in result.values if "skip" in v]
    if skips:
        pytest.skip(skips[0])
    if not reference.ok:
        raise CellFailure(ERROR, "the single-process reference failed:\n" + reference.story(), reference)


def judge_workflow(spec: dict, result, reference, flow) -> None:
    """A workflow cell: ``flow_ran``, then ``workflows.workflow_failure``'s checks against one process running
    the same flow; ``flow`` is its ``ranks/workflows.Flow`` (which phases' layouts are judged)."""
    flow_ran(result, reference)
    raise_found(workflows.workflow_failure(spec, result.values, reference.values[0], flow.layout_phases), result)


def judge_hub(spec: dict, result, reference, record=None) -> None:
    """A KerasHub cell: ``flow_ran``, then ``hub.hub_checks``' checks against one process running the same flow
    from the same weights, each one's outcome handed to ``record`` (the ``record_checks`` fixture) before the
    verdict is raised."""
    flow_ran(result, reference)
    found, outcomes = hub.hub_checks(spec, result.values, reference.values[0])
    if record is not None:
        record(outcomes)
    raise_found(found, result)


# ---------------------------------------------------------------- Keras-sharded data cells
def batch_coordinates(layout: dict, nproc: int) -> dict[int, int]:
    """rank -> its coordinate on the mesh's batch axis (devices fill the mesh row-major, as in
    ``cell_data.batch_part``): the ranks of one coordinate form one global batch."""
    return {rank: batch_part(layout, rank, nproc)[0] for rank in range(nproc)}


def judge_keras_sharded(spec: dict, result, nproc: int) -> None:
    """A Keras-sharded cell: ran everywhere, the rows each process's steps received keep the
    per-process contract (``data_sharding.data_failure``), and ``evaluate`` returned the loss over
    every row evaluated (``data_sharding.evaluate_failure``). A build that refuses to shard the
    source itself is ``data-not-sharded`` too, with its own words: that is what it did not do."""
    if not result.ok:
        first = result.first_failure()
        if first.error is not None and data_sharding.refused(first.error.full_text()):
            raise CellFailure(DATA_NOT_SHARDED, f"Keras refused to shard the {spec['source']} source itself "
                              f"({first.error.type}: {first.error.message.splitlines()[0]})\n{result.story()}", result)
        fail(result)
    coords = batch_coordinates(spec["layout"], nproc)
    raise_found(data_sharding.data_failure(spec, result.values, coords)
                or data_sharding.evaluate_failure(result.values, coords), result)
