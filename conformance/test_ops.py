"""Op cells: keras.ops x operand kind x placement x compile mode, on DTensors (see rank_ops.py).

A cell passes when the op runs on every rank, its value equals the same op on plain tensors, a
tensor result is a DTensor with the placements DTensor's own propagation gives (from the same
computation in plain torch), and, under torch.compile, dynamo compiled the graphs the same function
compiles on plain tensors, no fewer and no more, with no graph break the plain run has not (none for
an op with no tensor work, such as ``shape``).
"""

from __future__ import annotations

import itertools

import pytest

from conformance.judge.cells import judge_op
from conformance.ranks import ops as rank_ops


def op_params() -> list:
    params = []
    for op, kind in rank_ops.OP_KINDS.items():
        operands = [None] if kind == "unary" else [
            o for o in rank_ops.OPERANDS if not (o == "scalar" and op in rank_ops.NO_SCALAR)
        ]
        for operand, placement, mode in itertools.product(operands, rank_ops.PLACEMENTS, rank_ops.OP_COMPILE):
            cell = "-".join(p for p in (op, operand, placement, mode) if p)
            mark = pytest.mark.cell(
                family=f"ops {mode}", row=op, column=f"{operand or 'unary'}/{placement}",
                op=op, operand=operand or "none", placement=placement, compile=mode,
            )
            params.append(pytest.param(op, operand, placement, mode, id=cell, marks=mark))
    return params


@pytest.mark.parametrize("op, operand, placement, compile_mode", op_params())
def test_op(keras_ranks, op, operand, placement, compile_mode, record_checks, request):
    # The cell as data, on the item as a training cell's is: its reproducer calls ``op_cell(**spec)``.
    spec = {"op": op, "operand": operand, "placement": placement, "compile_mode": compile_mode}
    request.node.user_properties.append(("spec", spec))
    judge_op(op, compile_mode, keras_ranks.run(rank_ops.op_cell, op, operand, placement, compile_mode),
             record=record_checks)
