"""Evidence -> verdict for op cells, as plain functions that a standalone reproducer can inline.

``judge.cells.judge_op`` decides an op cell's verdict here, and so does the script
``--conformance-repro`` writes for an op cell (it inlines this module's source:
``conformance/reproducible.py``), so the script a contributor runs judges with the suite's own
rules, not a copy of them. That is why nothing here raises pytest's or the plugin's exceptions:
each check returns ``(verdict, message)`` for the first rank whose evidence fails it, or None.
The verdict and outcome names are plain strings (a reproducer inlines them by value); nothing
of the rank side is imported (whether a result is a tensor is in the evidence).

The evidence is what ``rank_ops.op_cell`` returns on each rank, in rank order.
"""

from __future__ import annotations

from keras_dtensor_conformance import (
    COMPILE_FALLBACK,
    FAILED,
    HELD,
    NOT_APPLICABLE,
    NOT_REACHED,
    NUMERICS,
    SHARDING_LOST,
)


def op_value_matches(values: list[dict]) -> tuple[str, str] | None:
    """The op's value equals the same op on plain tensors, on every rank."""
    for rank, value in enumerate(values):
        if not value["match"]:
            return NUMERICS, f"rank {rank}: got {value['got']}, expected {value['expected']}"
    return None


def _pending(placement: str) -> bool:
    """A pending reduction: ``P(sum)``, ``P(max)``, an embedding lookup's ``MaskP(sum, ...)``."""
    return placement.startswith(("P(", "MaskP("))


def placement_kept(got: str, want: str) -> bool:
    """Whether a result placed ``got`` on one mesh dimension keeps what ``want`` promises there.

    The same placement keeps it. A pending reduction may be completed (replicated, or reduced and
    scattered to a shard): ``torch.max(x, dim).values`` on a DTensor sharded along ``dim`` gives a
    replicated result where ``torch.amax`` gives ``P(max)``, and both are right. A result at least
    as sharded as asked keeps it too (a shard where a replica was expected). A shard gathered into
    a replica, a shard of another dimension, or a reduction left pending where none was, is lost.
    """
    if got == want:
        return True
    if _pending(want):
        return got == "R" or got.startswith("S(")
    return want == "R" and got.startswith("S(")


def placements_kept(got: list[str] | None, want: list[str] | None) -> bool:
    """``placement_kept`` on every mesh dimension; a plain tensor keeps nothing of a DTensor's
    (and is right only where the twin's result is a plain tensor too)."""
    if got is None or want is None:
        return got is want
    return len(got) == len(want) and all(map(placement_kept, got, want))


def no_tensor(values: list[dict]) -> bool:
    """The op's result is no tensor (a NumPy array, a shape, a bool): its twin is none
    (``ranks/ops.OPS``), so the ranks report no expected placements."""
    return all(v["expected_placements"] is None for v in values)


def op_placements_kept(op: str, values: list[dict]) -> tuple[str, str] | None:
    """A tensor result is a DTensor that keeps what DTensor's own propagation gives (``placement_kept``).

    The expected placements come from torch: the same computation in plain torch on the same
    DTensor (each op's ``twin`` in ``ranks/ops.OPS``; one list of placements per torch spelling of
    it, any of which is right). Ops whose result is no tensor (no twin: ``no_tensor``) are exempt.
    """
    if no_tensor(values):
        return None
    for rank, value in enumerate(values):
        got, want = value["placements"], value["expected_placements"]
        if not any(placements_kept(got, w) for w in want):
            said = "a plain tensor (not a DTensor)" if got is None else f"a DTensor with placements {got}"
            return SHARDING_LOST, (f"rank {rank}: the result is {said}; DTensor's own propagation gives "
                                   f"placements {' or '.join(map(str, want))}")
    return None


def _breaks(breaks: dict) -> str:
    """Graph breaks by reason (``{reason: {"count", "frames"}}``, ``ranks/ops._counted_since``) as a
    message names them: each with its count and the frames that restarted at it."""
    return "; ".join(f"{reason} ({info['count']}x, in {', '.join(info['frames']) or 'frame not recorded'})"
                     for reason, info in breaks.items())


def op_really_compiled(compile_mode: str, values: list[dict]) -> tuple[str, str] | None:
    """A compiled cell compiles the whole function on DTensors, as it does on plain tensors.

    The control (``control_graphs``, ``control_graph_breaks``) is the same function compiled on
    plain tensors in the same cell: an op with no tensor work (``shape``, ``is_tensor``) compiles
    no graph even there, and so needs none on DTensors. The DTensor run fails when dynamo compiled
    fewer graphs than the control (code it ran eagerly), more graphs (a graph break splits the
    function, with eager code between its graphs), or recorded any graph break
    (``torch._dynamo.utils.counters["graph_break"]``, ``graph_breaks``) where the control records
    none; the message names each break's reason, count and frames.
    """
    if compile_mode != "compiled":
        return None
    for rank, value in enumerate(values):
        got, control = value["compiled_graphs"], value["control_graphs"]
        breaks, control_breaks = value.get("graph_breaks") or {}, value.get("control_graph_breaks") or {}
        if got < control:
            return COMPILE_FALLBACK, (f"rank {rank}: torch.compile ran the op on DTensors but torch._dynamo "
                                      f"compiled {got} graph(s), fewer than the {control} the same function "
                                      "compiles on plain tensors"
                                      + (f"; graph break(s): {_breaks(breaks)}" if breaks else ""))
        if breaks and (got > control or not control_breaks):
            plain = f"breaks: {_breaks(control_breaks)}" if control_breaks else "no graph break"
            return COMPILE_FALLBACK, (f"rank {rank}: torch._dynamo broke the op's function on DTensors, graph "
                                      f"break(s): {_breaks(breaks)}; it compiled {got} graph(s) there, the same "
                                      f"function {control} on plain tensors ({plain})")
        if got > control:
            return COMPILE_FALLBACK, (f"rank {rank}: torch._dynamo compiled {got} graph(s) on DTensors, more than "
                                      f"the {control} the same function compiles on plain tensors (no graph break "
                                      "recorded)")
    return None


#: An op cell's checks, in ``op_outcomes``' order (the promises name them).
OP_VALUE = "op-value"
OP_PLACEMENTS = "op-placements"
OP_COMPILED = "op-compiled"
OP_CHECKS = (OP_VALUE, OP_PLACEMENTS, OP_COMPILED)


def op_scope(check: str, op: str, compile_mode: str, values: list[dict]) -> str | None:
    """None when ``check`` can fail on this op cell, else why it cannot."""
    if check == OP_PLACEMENTS and no_tensor(values):
        return "the result is no tensor: no placement to compare"
    if check == OP_COMPILED and compile_mode != "compiled":
        return "not a compiled cell"
    if check == OP_COMPILED and all(v["control_graphs"] == 0 for v in values):
        return "the same function compiles no graph on plain tensors either"
    return None


def op_outcomes(op: str, compile_mode: str, values: list[dict]) -> tuple[tuple[str, str] | None, dict]:
    """(the first failed check's ``(verdict, message)`` or None; each check's ``(outcome, why)``),
    in the order a reader would ask: is the value right, is it still sharded, was it compiled."""
    runs = ((OP_VALUE, lambda: op_value_matches(values)), (OP_PLACEMENTS, lambda: op_placements_kept(op, values)),
            (OP_COMPILED, lambda: op_really_compiled(compile_mode, values)))
    outcomes, found, failed = {}, None, None
    for name, run in runs:
        scope = op_scope(name, op, compile_mode, values)
        if found is not None:
            outcomes[name] = (NOT_REACHED, f"{failed} failed")
        elif scope is not None:
            outcomes[name] = (NOT_APPLICABLE, scope)
        else:
            found, failed = run(), name
            outcomes[name] = (FAILED, found[1].splitlines()[0]) if found else (HELD, "")
    return found, outcomes


def op_failure(op: str, compile_mode: str, values: list[dict]) -> tuple[str, str] | None:
    """The first failed check's ``(verdict, message)`` of a cell that ran on every rank (``op_outcomes``);
    None: it passes."""
    return op_outcomes(op, compile_mode, values)[0]
