"""Rank side of op cells: one keras.ops function on a DTensor, eager or under torch.compile.

The op runs with a ModelParallel distribution set (as it would inside training, so the build's
promotion machinery is active) on a DTensor of the cell's placement, against a second operand
of the cell's kind. Its result is compared on the rank with the same op on plain tensors.
"""

from __future__ import annotations

import numpy as np

from keras_dtensor_conformance import rank_context

ROWS, COLS = 4, 8


def _x() -> np.ndarray:
    return (np.arange(ROWS * COLS, dtype="float32").reshape(ROWS, COLS) - 13.0) / 7.0


def _ops():
    import keras.ops as K

    idx = np.array([2, 0, 3])
    along = np.tile(np.array([[1], [0], [3], [2]]), (1, COLS))
    return {
        # binary: f(x, other), other of shape ``other`` (None: same as x)
        "add": ("binary", K.add, None),
        "subtract": ("binary", K.subtract, None),
        "multiply": ("binary", K.multiply, None),
        "divide": ("binary", lambda a, b: K.divide(a, K.abs(b) + 1.0) if not np.isscalar(b) else K.divide(a, b), None),
        "minimum": ("binary", K.minimum, None),
        "maximum": ("binary", K.maximum, None),
        "power": ("binary", lambda a, b: K.power(K.abs(a) + 1.0, b), None),
        "where": ("binary", lambda a, b: K.where(K.greater(a, 0.0), a, b), None),
        "matmul": ("binary", K.matmul, (COLS, 3)),
        "dot": ("binary", K.dot, (COLS, 3)),
        "einsum": ("binary", lambda a, b: K.einsum("ij,jk->ik", a, b), (COLS, 3)),
        "concatenate": ("binary", lambda a, b: K.concatenate([a, b], axis=0), None),
        # unary: f(x)
        "relu": ("unary", K.relu, None),
        "exp": ("unary", K.exp, None),
        "sqrt": ("unary", lambda a: K.sqrt(K.abs(a)), None),
        "abs": ("unary", K.abs, None),
        "square": ("unary", K.square, None),
        "tanh": ("unary", K.tanh, None),
        "softmax": ("unary", lambda a: K.softmax(a, axis=-1), None),
        "cast": ("unary", lambda a: K.cast(K.cast(a * 4.0, "int32"), "float32"), None),
        "sum-axis0": ("unary", lambda a: K.sum(a, axis=0), None),
        "sum-axis1": ("unary", lambda a: K.sum(a, axis=1), None),
        "mean-axis0": ("unary", lambda a: K.mean(a, axis=0), None),
        "mean-axis1": ("unary", lambda a: K.mean(a, axis=1), None),
        "max-axis0": ("unary", lambda a: K.max(a, axis=0), None),
        "max-axis1": ("unary", lambda a: K.max(a, axis=1), None),
        "take": ("unary", lambda a: K.take(a, idx, axis=0), None),
        "take-along-axis": ("unary", lambda a: K.take_along_axis(a, along, axis=0), None),
        "slice": ("unary", lambda a: a[1:3], None),
        "index-array": ("unary", lambda a: a[K.convert_to_tensor(idx)], None),
        "reshape": ("unary", lambda a: K.reshape(a, (COLS, ROWS)), None),
        "transpose": ("unary", K.transpose, None),
        "expand-dims": ("unary", lambda a: K.expand_dims(a, 0), None),
        "repeat": ("unary", lambda a: K.repeat(a, 2, axis=0), None),
        "convert-to-numpy": ("unary", K.convert_to_numpy, None),
        "shape": ("unary", lambda a: tuple(K.shape(a)), None),
        "is-tensor": ("unary", K.is_tensor, None),
    }


#: name -> "binary" | "unary" (as data for the matrix, without importing Keras in the controller).
OP_KINDS = {
    **{n: "binary" for n in ("add", "subtract", "multiply", "divide", "minimum", "maximum", "power", "where",
                             "matmul", "dot", "einsum", "concatenate")},
    **{n: "unary" for n in ("relu", "exp", "sqrt", "abs", "square", "tanh", "softmax", "cast", "sum-axis0",
                            "sum-axis1", "mean-axis0", "mean-axis1", "max-axis0", "max-axis1", "take",
                            "take-along-axis", "slice", "index-array", "reshape", "transpose", "expand-dims",
                            "repeat", "convert-to-numpy", "shape", "is-tensor")},
}
#: The second operand of a binary op: a plain torch tensor (after or before the DTensor), a Python
#: scalar, a NumPy array, or a DTensor of another placement.
OPERANDS = ("tensor", "tensor-first", "scalar", "numpy", "dtensor")
#: Binary ops whose second operand must be a matrix of another shape: no scalar operand.
NO_SCALAR = ("matmul", "dot", "einsum", "concatenate")
PLACEMENTS = ("shard0", "shard1", "replicate")
OP_COMPILE = ("eager", "compiled")


def _placement(name: str):
    from torch.distributed.tensor import Replicate, Shard

    return {"shard0": Shard(0), "shard1": Shard(1), "replicate": Replicate()}[name]


def _to_numpy(value):
    import keras
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = value.full_tensor()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(keras.ops.convert_to_numpy(value)) if not isinstance(value, (tuple, bool)) else value


def op_cell(op: str, operand: str | None, placement: str, compile_mode: str) -> dict:
    import keras
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    ctx = rank_context.current()
    mesh = keras.distribution.DeviceMesh((ctx.world_size,), ["model"], ctx.device_names())
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name="model")
    )
    kind, fn, other_shape = _ops()[op]
    if operand == "tensor-first" and op in NO_SCALAR and other_shape is not None:
        other_shape = (3, ROWS)  # other @ x: (3, 4) @ (4, 8)
    x_np = _x()
    other_np = np.linspace(-1.5, 2.0, int(np.prod(other_shape or x_np.shape)), dtype="float32").reshape(
        other_shape or x_np.shape
    )
    x = distribute_tensor(torch.from_numpy(x_np), mesh.backend_mesh, [_placement(placement)])

    if kind == "unary":
        call, plain_args = (lambda a: fn(a)), (torch.from_numpy(x_np),)
        args = (x,)
    else:
        plain_other = torch.from_numpy(other_np)
        other = {
            "tensor": plain_other,
            "tensor-first": plain_other,
            "scalar": 2.0,
            "numpy": other_np,
            "dtensor": distribute_tensor(
                plain_other, mesh.backend_mesh, [_placement("replicate" if placement != "replicate" else "shard0")]
            ),
        }[operand]
        if operand == "tensor-first":
            call, args = (lambda a, b: fn(b, a)), (x, other)
            plain_args = (torch.from_numpy(x_np), plain_other)
        else:
            call, args = (lambda a, b: fn(a, b)), (x, other)
            plain_args = (torch.from_numpy(x_np), 2.0 if operand == "scalar" else plain_other)

    expected = _to_numpy(call(*plain_args))
    graphs_before = _graphs()
    run = torch.compile(call, backend="aot_eager") if compile_mode == "compiled" else call
    got = run(*args)
    compiled_graphs = _graphs() - graphs_before
    return {
        "result_is_dtensor": isinstance(got, DTensor),
        "match": _matches(_to_numpy(got), expected),
        "got": repr(_to_numpy(got))[:300],
        "expected": repr(expected)[:300],
        "compiled_graphs": compiled_graphs,
    }


def _graphs() -> int:
    import sys

    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _matches(got, expected) -> bool:
    if isinstance(expected, (tuple, bool)) or isinstance(got, (tuple, bool)):
        return got == expected
    return got.shape == expected.shape and bool(np.allclose(got, expected, rtol=1e-5, atol=1e-6))
