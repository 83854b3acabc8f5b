"""Op cells judge what the build did, not artefacts of how the cell looks at the result.

Each test runs real op cells on the ranks (or the rank-side helper on a real DTensor) and
fails if the cell's own machinery would give a false verdict: a pending reduction read twice,
a compile check that demands graphs from a function with no tensor op, a placement check that
never compares anything.
"""

from __future__ import annotations

import pytest
from keras_dtensor_conformance.rank.outcomes import OK, PoolResult, RankOutcome
from keras_dtensor_conformance.verdicts import COMPILE_FALLBACK, SHARDING_LOST, CellFailure

from conformance.judge import op_checks
from conformance.judge.cells import judge_op
from conformance.ranks import ops as rank_ops


def op_verdict(keras_ranks, op, operand, placement, compile_mode) -> str:
    try:
        judge_op(op, compile_mode, keras_ranks.run(rank_ops.op_cell, op, operand, placement, compile_mode))
    except CellFailure as failure:
        return failure.verdict
    return "pass"


# ---------------------------------------------------------------- rank-side helpers
def mask_partial_evidence() -> dict:
    """An embedding lookup in a ``Shard(0)`` table: a ``_MaskPartial`` DTensor, read by the helper."""
    import torch
    from keras_dtensor_conformance.rank import context as rank_context
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication

    mesh = init_device_mesh("cpu", (rank_context.current().world_size,))
    table = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    idx = torch.tensor([2, 0, 3])
    with implicit_replication():
        got = torch.nn.functional.embedding(idx, distribute_tensor(table, mesh, [Shard(0)]))
    evidence = rank_ops.result_evidence(got, table[idx].numpy())
    return {**evidence, "type": type(got.placements[0]).__name__}


def test_result_evidence_reads_a_pending_reduction_once(dist_ranks):
    """``result_evidence`` converts a ``_MaskPartial`` result once: a second reduction would raise."""
    for value in dist_ranks.run(mask_partial_evidence).values:
        assert value["type"] == "_MaskPartial"
        assert value["match"], value
        assert value["placements"][0].startswith("MaskP"), value


def test_take_along_the_sharded_axis_passes(keras_ranks):
    """Formerly a bare AssertionError: the cell gathered take's _MaskPartial result twice."""
    assert op_verdict(keras_ranks, "take", None, "shard0", "eager") == "pass"


# ---------------------------------------------------------------- compile control
@pytest.mark.parametrize("op", ["shape", "is-tensor"])
def test_a_compiled_op_with_no_tensor_work_needs_no_graph(keras_ranks, op):
    """Its plain control compiles no graph either, so compiling none on DTensors is no fallback."""
    value = keras_ranks.run(rank_ops.op_cell, op, None, "shard1", "compiled").values[0]
    assert value["control_graphs"] == 0
    assert op_verdict(keras_ranks, op, None, "shard1", "compiled") == "pass"


def test_a_compiled_tensor_op_still_falls_back_on_the_nightly(keras_ranks):
    """The control is not a loophole: add compiles a graph on plain tensors, none under the promotion mode."""
    value = keras_ranks.run(rank_ops.op_cell, "add", "tensor", "shard1", "compiled").values[0]
    assert value["control_graphs"] >= 1 and value["compiled_graphs"] == 0, value
    # dynamo skips the frame under the mode: a skip, not a graph break (on either side)
    assert value["graph_breaks"] == {} and value["control_graph_breaks"] == {}, value
    assert op_verdict(keras_ranks, "add", "tensor", "shard1", "compiled") == COMPILE_FALLBACK


# ---------------------------------------------------------------- placement check
def test_placements_come_from_torch(keras_ranks):
    """A sharded elementwise result keeps its shard; a contraction over the shard is a Partial sum."""
    add = keras_ranks.run(rank_ops.op_cell, "add", "tensor", "shard1", "eager").values[0]
    assert add["placements"] == ["S(1)"] and add["expected_placements"] == [["S(1)"]], add
    summed = keras_ranks.run(rank_ops.op_cell, "sum-axis1", None, "shard1", "eager").values[0]
    assert summed["expected_placements"] == [["P(sum)"]], summed


def _op_result(**evidence) -> PoolResult:
    value = {"match": True, "got": "", "expected": "", "compiled_graphs": 0, "control_graphs": 0, **evidence}
    return PoolResult("op_cell", [RankOutcome(rank=r, status=OK, value=value) for r in range(2)])


@pytest.mark.parametrize("placements, verdict", [
    (["S(1)"], "pass"),
    (None, SHARDING_LOST),  # gathered to a plain tensor
    (["R"], SHARDING_LOST),  # redistributed
])
def test_judge_compares_placements(placements, verdict):
    result = _op_result(placements=placements, expected_placements=[["S(1)"]])
    try:
        judge_op("add", "eager", result)
    except CellFailure as failure:
        assert failure.verdict == verdict and "['S(1)']" in failure.detail, failure.detail
        return
    assert verdict == "pass"


def test_ops_with_no_tensor_result_are_exempt_by_name():
    judge_op("shape", "eager", _op_result(placements=None, expected_placements=None))
    with pytest.raises(CellFailure):
        judge_op("add", "eager", _op_result(placements=None, expected_placements=[["S(1)"]]))


def test_judge_holds_a_compiled_cell_to_its_control():
    with pytest.raises(CellFailure, match="fewer than the 1"):
        judge_op("add", "compiled", _op_result(placements=["R"], expected_placements=[["R"]], control_graphs=1))
    judge_op("add", "compiled", _op_result(placements=["R"], expected_placements=[["R"]], compiled_graphs=1,
                                           control_graphs=1))


#: A graph-break reason as ``ranks/ops._counted_since`` records it (dynamo's first line and explanation).
USER_BREAK = "Call to `torch._dynamo.graph_break()` Explanation: User-inserted graph break. Message: None"


def _break(count: int, *frames: str) -> dict:
    return {USER_BREAK: {"count": count, "frames": list(frames)}}


def _compiled_value(**evidence) -> dict:
    """One rank's evidence of a compiled ``add`` cell whose value and placements hold."""
    return {"match": True, "got": "", "expected": "", "placements": ["R"], "expected_placements": [["R"]],
            "compiled_graphs": 1, "control_graphs": 1, **evidence}


def _compiled_failure(**evidence) -> tuple[str, str] | None:
    return op_checks.op_failure("add", "compiled", [_compiled_value(**evidence)] * 2)


@pytest.mark.parametrize("evidence, says", [
    # a graph break splits the function: more graphs than the control, the break and its frames named
    ({"compiled_graphs": 2, "graph_breaks": _break(2, "add keras/src/backend/torch/numpy.py:120", "<lambda> ops.py:9")},
     (f"graph break(s): {USER_BREAK} (2x, in add keras/src/backend/torch/numpy.py:120, <lambda> ops.py:9); "
      "it compiled 2 graph(s) there, the same function 1 on plain tensors (no graph break)")),
    # as many graphs as the control, but a break the control does not have
    ({"compiled_graphs": 1, "graph_breaks": _break(1)}, f"{USER_BREAK} (1x, in frame not recorded)"),
    # more graphs with no break recorded
    ({"compiled_graphs": 3}, ("compiled 3 graph(s) on DTensors, more than the 1 the same function compiles on "
                              "plain tensors (no graph break recorded)")),
    # more graphs than a control that breaks too: the extra break is named
    ({"compiled_graphs": 3, "control_graphs": 2, "graph_breaks": _break(2), "control_graph_breaks": _break(1)},
     f"(breaks: {USER_BREAK} (1x, in frame not recorded))"),
])
def test_a_graph_break_on_dtensors_fails_the_compiled_cell_and_is_named(evidence, says):
    """Issue 40, item 4: "compiles the whole step" is broken by a break, not only by fewer graphs."""
    found = _compiled_failure(**evidence)
    assert found is not None and found[0] == COMPILE_FALLBACK, found
    assert found[1].startswith("rank 0: torch._dynamo ") and says in found[1], found[1]
    outcomes = op_checks.op_outcomes("add", "compiled", [_compiled_value(**evidence)] * 2)[1]
    assert outcomes[op_checks.OP_COMPILED] == ("failed", found[1]), outcomes


def test_what_the_control_does_too_is_no_graph_break_failure():
    """The same breaks and graphs as the plain control pass; so do a run with no break recorded and evidence
    from before breaks were recorded (no ``graph_breaks``); a run with fewer graphs names its breaks too."""
    assert _compiled_failure(compiled_graphs=2, control_graphs=2, graph_breaks=_break(1),
                             control_graph_breaks=_break(1)) is None
    assert _compiled_failure(graph_breaks={}, control_graph_breaks={}) is None
    assert _compiled_failure() is None
    found = _compiled_failure(compiled_graphs=0, graph_breaks=_break(1, "f x.py:1"))
    assert found[0] == COMPILE_FALLBACK and "compiled 0 graph(s), fewer than the 1" in found[1], found
    assert found[1].endswith(f"; graph break(s): {USER_BREAK} (1x, in f x.py:1)"), found[1]
    # an eager cell is never held to the compile rule
    eager = _compiled_value(compiled_graphs=2, control_graphs=0, graph_breaks=_break(1))
    assert op_checks.op_failure("add", "eager", [eager] * 2) is None


# ---------------------------------------------------------------- the placement rule
@pytest.mark.parametrize(("got", "want", "kept"), [
    ("S(0)", "S(0)", True),
    ("R", "P(max)", True),          # torch.max(x, dim).values where torch.amax gives P(max): reduction completed
    ("S(0)", "P(sum)", True),       # reduced and scattered
    ("R", "MaskP(sum, (8, 4), 0)", True),  # an embedding lookup's pending masked sum, completed
    ("S(1)", "R", True),            # more sharded than asked
    ("R", "S(0)", False),           # gathered: the sharding is lost
    ("S(1)", "S(0)", False),        # sharded along another dimension
    ("P(sum)", "R", False),         # a reduction left pending where the twin completed it
    ("P(sum)", "P(max)", False),    # another reduction
])
def test_a_placement_is_kept_when_it_keeps_what_the_twin_promises(got, want, kept):
    assert op_checks.placement_kept(got, want) is kept


def test_a_plain_tensor_keeps_nothing_and_mesh_dims_are_all_checked():
    assert not op_checks.placements_kept(None, ["S(0)"])
    assert op_checks.placements_kept(None, None)
    assert not op_checks.placements_kept(["R", "S(0)"], ["S(0)", "S(0)"])
    assert op_checks.placements_kept(["S(0)", "R"], ["S(0)", "P(max)"])


def test_max_completed_by_torch_max_passes_and_a_gather_still_fails():
    """The rule on an op cell's evidence: torch.max's replicated result passes where the twin gives
    P(max); a gathered result where the twin keeps a shard still fails as sharding-lost."""
    evidence = [{"placements": ["R"], "expected_placements": [["P(max)"]]}] * 2
    assert op_checks.op_placements_kept("max-axis1", evidence) is None
    gathered = [{"placements": ["R"], "expected_placements": [["S(0)"]]}] * 2
    verdict, message = op_checks.op_placements_kept("max-axis1", gathered)
    assert verdict == "sharding-lost" and "placements ['S(0)']" in message
