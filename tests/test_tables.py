"""One entry per optimizer and per op: the rows are checked as the suite imports them.

A row that names an oracle rule that does not exist, or one that does not model it, a row
without its slot counts, an op whose second operand contradicts its kind: each fails at import
with a message naming the row, instead of a cell that runs unjudged or a table out of step.
"""

from __future__ import annotations

import ast
import collections
import os
import subprocess
import sys

import pytest

from conformance import axes
from conformance.axes import Optimizer, Slots
from conformance.judge import oracle
from conformance.ranks import ops as rank_ops
from conformance.ranks import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _check(**entry):
    oracle.check_named_rules({"new": Optimizer("SGD", {"learning_rate": 0.05}, slots=Slots(0), **entry)})


def test_the_tables_of_the_suite_pass_their_checks():
    axes.check_optimizers(axes.OPTIMIZERS)
    oracle.check_named_rules(axes.OPTIMIZERS)
    rank_ops.check_ops(rank_ops.OPS)
    assert axes.BENCHMARKED == tuple(n for n, o in axes.OPTIMIZERS.items() if o.benchmark)


@pytest.mark.parametrize("entry, said", [
    ({"oracle": "nope"}, "oracle='nope' is not a rule of oracle.RULES (sgd, adam, adamw, rmsprop); "
                         "None where no rule models it"),
    ({"oracle": "adam"}, "oracle='adam' models keras.optimizers.Adam, not SGD"),
    ({"oracle": "sgd", "loss_scale": True}, "oracle='sgd', but SGD with loss_scale has no rule"),
    ({}, "the oracle's rule 'sgd' models it as configured; say oracle='sgd'"),
])
def test_a_wrong_oracle_rule_is_named(entry, said):
    with pytest.raises(ValueError) as error:
        _check(**entry)
    assert str(error.value) == f"axes.OPTIMIZERS['new']: {said}"


def test_an_argument_outside_the_rule_is_named():
    with pytest.raises(ValueError, match=r"oracle='sgd', but SGD with nesterov has no rule"):
        oracle.check_named_rules({"new": Optimizer("SGD", {"nesterov": True}, slots=Slots(1), oracle="sgd")})


@pytest.mark.parametrize("entry, said", [
    ({"slots": {"full": 2}}, "slots must be a Slots, not {'full': 2}"),
    ({"slots": Slots(1, factored=-1)}, "Slots.factored must be a count (an int >= 0), not -1"),
    ({"slots": Slots(1.0)}, "Slots.full must be a count (an int >= 0), not 1.0"),
    ({"slots": Slots(0), "schedule": "cosine"}, "schedule 'cosine' is not one the ranks build (exponential-decay)"),
])
def test_an_optimizer_row_that_is_not_whole_is_named(entry, said):
    with pytest.raises(ValueError) as error:
        axes.check_optimizers({"new": Optimizer("SGD", {"learning_rate": 0.05}, **entry)})
    assert str(error.value) == f"axes.OPTIMIZERS['new']: {said}"
    with pytest.raises(ValueError, match=r"axes.OPTIMIZERS\['new'\]: must be an Optimizer"):
        axes.check_optimizers({"new": {"class": "SGD", "kwargs": {}}})  # a row as the table had them
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'slots'"):
        Optimizer("SGD", {"learning_rate": 0.05})


def test_a_float32_cell_is_what_it_was_before_the_policy_axis_and_a_mixed_one_names_its_policy():
    assert "policy" not in axes.cell_spec("mlp", "adam", "arrays", "nojit", "colshard")
    assert axes.cell_id("mlp", "adam", "arrays", "nojit", "colshard") == "adam-arrays-nojit-colshard"
    mixed = ("lora", "adam", "arrays", "nojit", "colshard", "mixed_float16")
    assert axes.cell_spec(*mixed)["policy"] == "mixed_float16"
    assert axes.cell_id(*mixed) == "mixed_float16-lora-adam-arrays-nojit-colshard"
    default = axes.training_cells(False)
    assert all(len(cell) == 6 and cell[5] in axes.POLICIES for cell in default)
    full = axes.training_cells(True)
    mixed = [c for c in default if c[5] != "float32"]
    assert {(c[5], c[1], c[4]) for c in mixed} == set(axes.MIXED_DEFAULT) and len(mixed) == len(axes.MIXED_DEFAULT)
    assert {c[5] for c in mixed} == set(axes.POLICIES[1:])  # the covering design: each policy, layout kind,
    assert {c[4] for c in mixed} == {"colshard", "rowshard", "dataparallel"}  # and a state kind in the default
    assert {c[1] for c in mixed} >= {"sgd", "adam", "lossscale"}
    for policy in axes.POLICIES[1:]:  # the optimizers whose state meets the precision; --full: every layout
        assert {c[1] for c in full if c[5] == policy} >= set(axes.MIXED_OPTIMIZERS)
        assert {c[4] for c in full if c[5] == policy} == set(axes.MATRIX_LAYOUTS)
    lora = {(c[0], c[4]) for c in default if c[0] in axes.LORA_MODELS}
    assert lora == set(axes.LORA_DEFAULT) and {m for m, _ in lora} == set(axes.LORA_MODELS)
    assert {(c[0], c[4]) for c in full if c[0] in axes.LORA_MODELS} == {
        (m, layout) for m in axes.LORA_MODELS for layout in axes.MATRIX_LAYOUTS}


@pytest.mark.parametrize("full", [False, True], ids=["default", "full"])
def test_no_two_training_cells_build_and_run_the_same(full):
    """A cell's id names the model it builds: two cells that build one model with one optimizer, data
    source, compile mode, layout and policy are one cell run twice under two names."""
    built = collections.Counter((train.model_name(axes.cell_spec(*cell)), *cell[1:])
                                for cell in axes.training_cells(full))
    assert [cell for cell, n in built.items() if n > 1] == []


def test_slot_counts_are_plain_data_a_reproducer_inlines():
    assert ast.literal_eval(repr(axes.SLOTS)) == axes.SLOTS
    assert axes.SLOTS["muon"] == {"full": 1, "factored": 0, "adamw_velocity": 1}


def test_a_bad_optimizer_row_fails_the_import():
    """The check runs as the suite imports the judge, not only when a test calls it."""
    code = ("from conformance import axes\n"
            "axes.OPTIMIZERS['sgd-typo'] = axes.Optimizer('SGD', {'learning_rate': 0.05}, slots=axes.Slots(0),"
            " oracle='sdg')\n"
            "import conformance.judge.cells\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "ValueError: axes.OPTIMIZERS['sgd-typo']: oracle='sdg' is not a rule of oracle.RULES "
        "(sgd, adam, adamw, rmsprop); None where no rule models it")


# ---------------------------------------------------------------- ops
def _f(*_):
    return None


@pytest.mark.parametrize("entry, said", [
    ({"kind": "ternary"}, "kind 'ternary': 'unary' or 'binary'"),
    ({"kind": "unary", "other_shape": (8, 3), "scalar": False},
     "a unary op has no second operand: no other_shape, no scalar=False"),
    ({"kind": "binary", "other_shape": (8, 3)},
     "a second operand of shape (8, 3) is a matrix, never a scalar: say scalar=False"),
    ({"kind": "unary", "twin": "torch.neg"}, "keras must be callable, and twin callable or None"),
])
def test_an_op_row_that_contradicts_itself_is_named(entry, said):
    with pytest.raises(ValueError) as error:
        rank_ops.check_ops({"new": rank_ops.Op(**{"keras": _f, "twin": _f, **entry})})
    assert str(error.value) == f"ranks/ops.OPS['new']: {said}"


def test_the_op_tables_derive_from_the_rows():
    assert rank_ops.NO_SCALAR == ("matmul", "dot", "einsum", "concatenate")
    assert list(rank_ops.OP_KINDS) == list(rank_ops.OPS)
