"""Rank side of op cells: one keras.ops function on a DTensor, eager or under torch.compile.

The op runs with a ModelParallel distribution set (as it would inside training, so the build's
promotion machinery is active) on a DTensor of the cell's placement, against a second operand
of the cell's kind. The rank gathers three kinds of evidence for the judge:

- value: the result against the same op on plain tensors;
- placements: the result's placements against those DTensor's own propagation gives for the
  same computation written in plain torch (each op's ``twin``), run on the same DTensor outside
  Keras' promotion mode, with plain operands replicated by DTensor's own rule
  (``implicit_replication``), so the expectation comes from torch, not from the build;
- compilation: graphs dynamo compiled, and graph breaks it recorded by reason, for the DTensor
  run against a control, the same function compiled on plain tensors with no dispatch mode on the
  stack (a function with no tensor op, such as ``shape``, compiles no graph even there, and so
  needs none on DTensors).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
from keras_dtensor_conformance import rank_context

ROWS, COLS = 4, 8
TAKE_INDICES = (2, 0, 3)
#: Row index per (row, column) for take_along_axis on axis 0.
ALONG_ROWS = (1, 0, 3, 2)


def _x() -> np.ndarray:
    return (np.arange(ROWS * COLS, dtype="float32").reshape(ROWS, COLS) - 13.0) / 7.0


def _along() -> np.ndarray:
    return np.tile(np.array(ALONG_ROWS).reshape(ROWS, 1), (1, COLS))


@dataclasses.dataclass(frozen=True)
class Op:
    """One op of the matrix: everything its cells need, in one place.

    ``keras`` and ``twin`` are called on the rank as ``keras(keras.ops, idx, along)`` and
    ``twin(torch, idx, along)`` (``idx``: ``TAKE_INDICES``, ``along``: ``ALONG_ROWS`` per column,
    as NumPy arrays for Keras and as tensors on the ranks' device for torch) and return the
    function the cell runs, ``f(x)`` or ``f(x, other)``: Keras and torch are imported on the
    rank only, and torch's indices must be on the ranks' device. ``twin`` is the same computation in
    plain torch, whose placements on the same DTensor are the ones a correct build's result has
    (``twin_placements``); it returns a tuple where torch spells the computation in two ways that
    DTensor propagates differently, either right. ``twin`` is None for an op whose result is not
    a tensor (a NumPy array, a shape, a bool): no placements to check.
    """

    kind: str  #: "unary" (f(x)) or "binary" (f(x, other))
    keras: Callable
    twin: Callable | None
    #: binary: the second operand's shape (None: x's); an op taking a matrix of another shape
    #: takes no scalar (``scalar=False``)
    other_shape: tuple | None = None
    scalar: bool = True  #: binary: a Python scalar is among its second operands


#: name -> op: the one place to add one. Binary ops first, then unary, in the order of the ids.
OPS = {
    # binary: f(x, other)
    "add": Op("binary", lambda K, *_: K.add, lambda torch, *_: torch.add),
    "subtract": Op("binary", lambda K, *_: K.subtract, lambda torch, *_: torch.subtract),
    "multiply": Op("binary", lambda K, *_: K.multiply, lambda torch, *_: torch.multiply),
    "divide": Op("binary",
                 lambda K, *_: lambda a, b: K.divide(a, K.abs(b) + 1.0) if not np.isscalar(b) else K.divide(a, b),
                 lambda torch, *_: lambda a, b: (torch.divide(a, torch.abs(b) + 1.0) if isinstance(b, torch.Tensor)
                                                 else a / b)),
    "minimum": Op("binary", lambda K, *_: K.minimum,
                  lambda torch, *_: lambda a, b: torch.minimum(_as_tensor(a), _as_tensor(b))),
    "maximum": Op("binary", lambda K, *_: K.maximum,
                  lambda torch, *_: lambda a, b: torch.maximum(_as_tensor(a), _as_tensor(b))),
    "power": Op("binary", lambda K, *_: lambda a, b: K.power(K.abs(a) + 1.0, b),
                lambda torch, *_: lambda a, b: torch.pow(torch.abs(a) + 1.0, b)),
    "where": Op("binary", lambda K, *_: lambda a, b: K.where(K.greater(a, 0.0), a, b),
                lambda torch, *_: lambda a, b: torch.where(torch.gt(a, 0.0), a, _as_tensor(b))),
    "matmul": Op("binary", lambda K, *_: K.matmul, lambda torch, *_: torch.matmul,
                 other_shape=(COLS, 3), scalar=False),
    "dot": Op("binary", lambda K, *_: K.dot, lambda torch, *_: torch.matmul, other_shape=(COLS, 3), scalar=False),
    "einsum": Op("binary", lambda K, *_: lambda a, b: K.einsum("ij,jk->ik", a, b),
                 lambda torch, *_: lambda a, b: torch.einsum("ij,jk->ik", a, b), other_shape=(COLS, 3), scalar=False),
    "concatenate": Op("binary", lambda K, *_: lambda a, b: K.concatenate([a, b], axis=0),
                      lambda torch, *_: lambda a, b: torch.cat([a, b], dim=0), scalar=False),
    # unary: f(x)
    "relu": Op("unary", lambda K, *_: K.relu, lambda torch, *_: torch.relu),
    "exp": Op("unary", lambda K, *_: K.exp, lambda torch, *_: torch.exp),
    "sqrt": Op("unary", lambda K, *_: lambda a: K.sqrt(K.abs(a)), lambda torch, *_: lambda a: torch.sqrt(torch.abs(a))),
    "abs": Op("unary", lambda K, *_: K.abs, lambda torch, *_: torch.abs),
    "square": Op("unary", lambda K, *_: K.square, lambda torch, *_: torch.square),
    "tanh": Op("unary", lambda K, *_: K.tanh, lambda torch, *_: torch.tanh),
    "softmax": Op("unary", lambda K, *_: lambda a: K.softmax(a, axis=-1),
                  lambda torch, *_: lambda a: torch.softmax(a, dim=-1)),
    "cast": Op("unary", lambda K, *_: lambda a: K.cast(K.cast(a * 4.0, "int32"), "float32"),
               lambda torch, *_: lambda a: (a * 4.0).to(torch.int32).to(torch.float32)),
    "sum-axis0": Op("unary", lambda K, *_: lambda a: K.sum(a, axis=0), lambda torch, *_: lambda a: torch.sum(a, dim=0)),
    "sum-axis1": Op("unary", lambda K, *_: lambda a: K.sum(a, axis=1), lambda torch, *_: lambda a: torch.sum(a, dim=1)),
    "mean-axis0": Op("unary", lambda K, *_: lambda a: K.mean(a, axis=0),
                     lambda torch, *_: lambda a: torch.mean(a, dim=0)),
    "mean-axis1": Op("unary", lambda K, *_: lambda a: K.mean(a, axis=1),
                     lambda torch, *_: lambda a: torch.mean(a, dim=1)),
    "max-axis0": Op("unary", lambda K, *_: lambda a: K.max(a, axis=0),
                     lambda torch, *_: lambda a: torch.amax(a, dim=0)),
    "max-axis1": Op("unary", lambda K, *_: lambda a: K.max(a, axis=1),
                     lambda torch, *_: lambda a: torch.amax(a, dim=1)),
    # Rows by index: torch's index_select (a replicated result of a Shard(0) input) or an
    # embedding lookup (a _MaskPartial result: a pending masked sum); neither loses anything.
    "take": Op("unary", lambda K, idx, _: lambda a: K.take(a, idx, axis=0),
               lambda torch, idx, _: (lambda a: torch.index_select(a, 0, idx),
                                      lambda a: torch.nn.functional.embedding(idx, a))),
    "take-along-axis": Op("unary", lambda K, _, along: lambda a: K.take_along_axis(a, along, axis=0),
                          lambda torch, _, along: lambda a: torch.take_along_dim(a, along, dim=0)),
    "slice": Op("unary", lambda K, *_: lambda a: a[1:3], lambda torch, *_: lambda a: a[1:3]),
    "index-array": Op("unary", lambda K, idx, _: lambda a: a[K.convert_to_tensor(idx)],
                      lambda torch, idx, _: lambda a: a[idx]),
    "reshape": Op("unary", lambda K, *_: lambda a: K.reshape(a, (COLS, ROWS)),
                  lambda torch, *_: lambda a: torch.reshape(a, (COLS, ROWS))),
    "transpose": Op("unary", lambda K, *_: K.transpose, lambda torch, *_: lambda a: torch.transpose(a, 0, 1)),
    "expand-dims": Op("unary", lambda K, *_: lambda a: K.expand_dims(a, 0),
                      lambda torch, *_: lambda a: torch.unsqueeze(a, 0)),
    "repeat": Op("unary", lambda K, *_: lambda a: K.repeat(a, 2, axis=0),
                 lambda torch, *_: lambda a: torch.repeat_interleave(a, 2, dim=0)),
    # Not a tensor: no placements to check.
    "convert-to-numpy": Op("unary", lambda K, *_: K.convert_to_numpy, None),
    "shape": Op("unary", lambda K, *_: lambda a: tuple(K.shape(a)), None),
    "is-tensor": Op("unary", lambda K, *_: K.is_tensor, None),
}


def _op_problem(entry) -> str | None:
    """What is wrong with one row of OPS, or None."""
    if not isinstance(entry, Op):
        return f"must be an Op, not {entry!r}"
    if entry.kind not in ("unary", "binary"):
        return f"kind {entry.kind!r}: 'unary' or 'binary'"
    if entry.kind == "unary" and (entry.other_shape is not None or not entry.scalar):
        return "a unary op has no second operand: no other_shape, no scalar=False"
    if entry.other_shape is not None and entry.scalar:
        return f"a second operand of shape {entry.other_shape} is a matrix, never a scalar: say scalar=False"
    if not callable(entry.keras) or not (entry.twin is None or callable(entry.twin)):
        return "keras must be callable, and twin callable or None"
    return None


def check_ops(table: dict) -> None:
    """Every row of ``table`` is a consistent ``Op``; raises ValueError naming the first that is not."""
    for name, entry in table.items():
        problem = _op_problem(entry)
        if problem:
            raise ValueError(f"ranks/ops.OPS[{name!r}]: {problem}")


check_ops(OPS)
#: name -> "unary" | "binary", in table order: the matrix's rows (test_ops.py).
OP_KINDS = {name: op.kind for name, op in OPS.items()}
#: Binary ops whose second operand cannot be a scalar.
NO_SCALAR = tuple(name for name, op in OPS.items() if op.kind == "binary" and not op.scalar)
#: The second operand of a binary op: a plain torch tensor (after or before the DTensor), a Python
#: scalar, a NumPy array, or a DTensor of another placement.
OPERANDS = ("tensor", "tensor-first", "scalar", "numpy", "dtensor")
PLACEMENTS = ("shard0", "shard1", "replicate")
OP_COMPILE = ("eager", "compiled")


def _twin(entry: Op, device):
    """The op's torch twin, with its indices on the operand's device (cuda under NCCL)."""
    import torch

    return entry.twin(torch, torch.tensor(TAKE_INDICES, device=device), torch.from_numpy(_along()).to(device))


def _as_tensor(value):
    """A twin's operand as torch needs it: a Python scalar becomes a tensor, as Keras'
    ``convert_to_tensor`` makes it."""
    import torch

    return value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.float32)


def _placement(name: str):
    from torch.distributed.tensor import Replicate, Shard

    return {"shard0": Shard(0), "shard1": Shard(1), "replicate": Replicate()}[name]


def _to_numpy(value):
    """A result as NumPy (or a tuple/bool as is), gathering a DTensor: call it once per result.

    A DTensor whose placement is a pending reduction can be reduced only once: ``take`` along a
    ``Shard(0)`` axis returns a ``_MaskPartial`` DTensor whose mask is released by the first
    ``full_tensor()``, and a second one raises a bare AssertionError.
    """
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = value.full_tensor()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, (tuple, bool)):
        return value
    import keras

    return np.asarray(keras.ops.convert_to_numpy(value))


def placements_of(value) -> list[str] | None:
    """A DTensor's placements as text (``["S(0)"]``); None for anything else."""
    from torch.distributed.tensor import DTensor

    return [str(p) for p in value.placements] if isinstance(value, DTensor) else None


def result_evidence(got, expected) -> dict:
    """What the judge needs from the op's result, which is converted exactly once (see ``_to_numpy``)."""
    placements = placements_of(got)
    got = _to_numpy(got)
    return {
        "placements": placements,
        "match": _matches(got, expected),
        "got": repr(got)[:300],
        "expected": repr(expected)[:300],
    }


def twin_placements(spellings: tuple, kind: str, operand: str | None, args) -> list[list[str]]:
    """Placements DTensor's own propagation gives each spelling of the twin, outside every dispatch mode.

    Plain tensors among ``args`` are replicated by DTensor's own rule (``implicit_replication``),
    which is what the build's promotion of a plain operand is meant to do.
    """
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), implicit_replication():
        return [placements_of(_bind(twin, kind, operand)(*args)) for twin in spellings]


def _spellings(twin) -> tuple:
    return twin if isinstance(twin, tuple) else (twin,)


def _bind(fn, kind: str, operand: str | None):
    """``fn`` as called on (x, other): with the operands swapped for ``tensor-first``."""
    if kind == "unary":
        return lambda a: fn(a)
    if operand == "tensor-first":
        return lambda a, b: fn(b, a)
    return lambda a, b: fn(a, b)


def op_cell(op: str, operand: str | None, placement: str, compile_mode: str) -> dict:
    import keras
    import torch
    from torch.distributed.tensor import distribute_tensor

    ctx = rank_context.current()
    mesh = keras.distribution.DeviceMesh((ctx.world_size,), ["model"], ctx.device_names())
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name="model")
    )
    entry = OPS[op]
    kind, other_shape = entry.kind, entry.other_shape
    fn = entry.keras(keras.ops, np.array(TAKE_INDICES), _along())
    if operand == "tensor-first" and other_shape is not None:
        other_shape = (3, ROWS)  # other @ x: (3, 4) @ (4, 8)
    x_np = _x()
    other_np = np.linspace(-1.5, 2.0, int(np.prod(other_shape or x_np.shape)), dtype="float32").reshape(
        other_shape or x_np.shape
    )
    # Plain operands live where the ranks compute (cuda under NCCL): an index or operand on another
    # device than the DTensor's is the harness' mistake, not the build's.
    device = ctx.torch_device()
    x = distribute_tensor(torch.from_numpy(x_np).to(device), mesh.backend_mesh, [_placement(placement)])
    plain_other = torch.from_numpy(other_np).to(device)
    other = {
        None: None,
        "tensor": plain_other,
        "tensor-first": plain_other,
        "scalar": 2.0,
        "numpy": other_np,
        "dtensor": distribute_tensor(
            plain_other, mesh.backend_mesh, [_placement("replicate" if placement != "replicate" else "shard0")]
        ),
    }[operand]
    plain_x = torch.from_numpy(x_np).to(device)
    args = (x,) if kind == "unary" else (x, other)
    plain_args = (plain_x,) if kind == "unary" else (plain_x, 2.0 if operand == "scalar" else plain_other)
    twin_args = (x,) if kind == "unary" else (x, plain_other if operand == "numpy" else other)
    call = _bind(fn, kind, operand)

    expected = _to_numpy(call(*plain_args))
    control_graphs, control_breaks = (_plain_control_graphs((op, operand), call, plain_args)
                                      if compile_mode == "compiled" else (0, {}))
    before = _dynamo_counts()
    run = torch.compile(call, backend="aot_eager") if compile_mode == "compiled" else call
    got = run(*args)
    compiled_graphs, graph_breaks = _counted_since(before)
    evidence = result_evidence(got, expected)
    # The twin runs only after the result was read: DTensor's propagation cache hands the twin's
    # result the same _MaskPartial placement object as the op's, whose mask buffer counts its
    # users, so a twin run first would let the op's result be reduced twice unnoticed.
    want = None if entry.twin is None else twin_placements(_spellings(_twin(entry, device)), kind, operand, twin_args)
    return {
        **evidence,
        "expected_placements": want,
        "compiled_graphs": compiled_graphs,
        "control_graphs": control_graphs,
        "graph_breaks": graph_breaks,
        "control_graph_breaks": control_breaks,
    }


#: (op, operand) -> (graphs, graph breaks by reason) of its plain control, measured once per rank
#: process: the control's inputs do not depend on the cell's placement, and compiling it costs
#: about a second.
_CONTROL_GRAPHS: dict[tuple, tuple[int, dict]] = {}


def _plain_control_graphs(key: tuple, call, plain_args) -> tuple[int, dict]:
    """Graphs dynamo compiles for ``call`` on plain tensors with no dispatch mode on the stack, and
    the graph breaks it records there (``_counted_since``).

    The control a compiled DTensor run is held to: a function with no tensor op (``shape``,
    ``is_tensor``) compiles no graph even here. It runs with every mode popped (and put back),
    because under a dispatch mode such as the build's promotion mode dynamo compiles nothing,
    which would make the control as blind as the run it controls. Its backend is ``eager``: the
    number of graphs is dynamo's decision, made before any backend sees them, and skipping
    AOTAutograd makes the control several times cheaper.
    """
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    if key not in _CONTROL_GRAPHS:
        before = _dynamo_counts()
        with _disable_current_modes():
            torch.compile(call, backend="eager")(*plain_args)  # dynamo alone decides the graphs
        _CONTROL_GRAPHS[key] = _counted_since(before)
    return _CONTROL_GRAPHS[key]


def _dynamo_counts() -> tuple:
    """Dynamo's own counters so far: graphs compiled, graph breaks by reason, and its per-frame
    compilation records (a bounded deque: ``_counted_since`` tells the new ones by identity)."""
    import sys

    if "torch._dynamo" not in sys.modules:
        return 0, {}, []
    from torch._dynamo.utils import counters, get_compilation_metrics

    return int(counters["stats"]["unique_graphs"]), dict(counters["graph_break"]), list(get_compilation_metrics())


def _counted_since(before: tuple) -> tuple[int, dict]:
    """Graphs compiled since ``before`` (``_dynamo_counts``), and the graph breaks recorded since, as
    ``{reason: {"count": n, "frames": ["co_name file:line", ...]}}`` (the frames that restarted at the
    break, as ``ranks/train._compiled_during`` records a fit's): a reason is dynamo's first line and
    its ``Explanation:`` line (the whole text runs to ten lines)."""
    graphs, breaks, records = _dynamo_counts()
    seen = {id(record) for record in before[2]}
    records = [r for r in records if id(r) not in seen]
    new: dict[str, dict] = {}
    for reason, count in breaks.items():
        if count > before[1].get(reason, 0):
            lines = [line.strip() for line in str(reason).splitlines() if line.strip()]
            explanation = next((line for line in lines[1:] if line.startswith("Explanation:")), "")
            head = " ".join([lines[0] if lines else "", explanation]).strip()
            info = new.setdefault(head, {"count": 0, "frames": []})
            info["count"] += count - before[1].get(reason, 0)
            info["frames"] = list(dict.fromkeys(info["frames"] + [
                f"{r.co_name} {(r.co_filename or '?').split('site-packages/')[-1]}:{r.co_firstlineno}"
                for r in records if reason in (r.restart_reasons or ())]))
    return graphs - before[0], new


def _matches(got, expected) -> bool:
    if isinstance(expected, (tuple, bool)) or isinstance(got, (tuple, bool)):
        return got == expected
    return got.shape == expected.shape and bool(np.allclose(got, expected, rtol=1e-5, atol=1e-6))
