"""The communication budget (``conformance.judge.communication``) on synthetic evidence shaped as
``step_communication.measure_step_communication`` returns it, with the figures measured on the default
build (a column-sharded MLP, 2 ranks) and on the ``gradients-gathered`` mutant."""

from __future__ import annotations

import copy

from keras_dtensor_conformance import OVER_BUDGET

from conformance import axes
from conformance.judge import fit_checks
from conformance.judge.communication import figures, full_size_copies, over_budget

COLSHARD = axes.cell_spec("mlp", "sgd", "arrays", "nojit", "colshard")


def variable(path, shape, placements=None, local_shape=None) -> dict:
    if placements is None:
        return {"path": path, "type": "Variable", "shape": tuple(shape), "dtensor": False}
    return {"path": path, "type": "Variable", "shape": tuple(shape), "dtensor": True,
            "placements": placements, "local_shape": tuple(local_shape)}


def call(op, inputs, outputs, made_by=None, size=4) -> dict:
    numel = max(sum(_numel(s) for s in inputs), sum(_numel(s) for s in outputs))
    return {"op": op, "inputs": inputs, "outputs": outputs, "dtype": "float32", "bytes": numel * size,
            "made_by": made_by}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def gradient(path, shape, placements=None, local_shape=None) -> dict:
    if placements is None:
        return {"path": path, "type": "Tensor", "shape": shape, "bytes": _numel(shape) * 4}
    return {"path": path, "type": "DTensor", "shape": shape, "placements": placements, "local_shape": local_shape,
            "bytes": _numel(local_shape) * 4}


DATAPARALLEL = axes.cell_spec("mlp", "sgd", "arrays", "nojit", "dataparallel")
#: The MLP's variables under DataParallel: plain, whole on every rank.
MLP = {"mlp/dense_a/kernel": [8, 16], "mlp/dense_a/bias": [16], "mlp/dense_b/kernel": [16, 4], "mlp/dense_b/bias": [4]}


def data_parallel_rank(*gradient_calls) -> dict:
    """A DataParallel step: the gradient collectives given, then the loss' and a metric's scalars."""
    calls = [*gradient_calls, call("allreduce_", [[]], [[]]), call("allreduce_", [[2]], [[2]])]
    return {"stages": {"fit": [variable(p, s) for p, s in MLP.items()]},
            "communication": {"measured": "one eager train_on_batch", "count": len(calls),
                              "bytes": sum(c["bytes"] for c in calls), "ops": {}, "calls": calls,
                              "redistributions": [], "gradients": [gradient(p, s) for p, s in MLP.items()]}}


#: DDP's one bucket: every gradient's elements in one all-reduce (8*16 + 16 + 16*4 + 4 = 212).
BUCKET = call("allreduce_", [[212]], [[212]])


def default_build_rank() -> dict:
    """What the default build's column-sharded MLP step (SGD) was measured to do on rank 0."""
    calls = [
        call("all_gather_into_tensor", [[24, 8]], [[48, 8]]),
        call("all_reduce", [[24]], [[24]]),
        call("all_gather_into_tensor", [[24, 2]], [[48, 2]]),
        call("reduce_scatter_tensor", [[48, 8]], [[24, 8]]),
        # DTensor's own strategy for the update: dense_b/kernel's gradient arrives Shard(0) for a
        # Shard(1) kernel and is all-gathered inside _foreach_add_. Not the build's request.
        call("all_gather_into_tensor", [[8]], [[16]]),
        call("all_gather_into_tensor", [[8, 4]], [[16, 4]]),
        call("all_gather_into_tensor", [[2]], [[4]]),
        call("allreduce_", [[]], [[]]),
        call("allreduce_", [[]], [[]]),
    ]
    return {
        "stages": {"fit": [variable("mlp/dense_a/kernel", (8, 16), ["R", "S(1)"], (8, 8)),
                           variable("mlp/dense_a/bias", (16,)),
                           variable("mlp/dense_b/kernel", (16, 4), ["R", "S(1)"], (16, 2)),
                           variable("mlp/dense_b/bias", (4,))]},
        "communication": {
            "measured": "one eager train_on_batch",
            "count": len(calls), "bytes": sum(c["bytes"] for c in calls),
            "ops": {}, "calls": calls, "redistributions": [],
            "gradients": [gradient("mlp/dense_a/kernel", [8, 16], ["P(sum)", "S(1)"], [8, 8]),
                          gradient("mlp/dense_a/bias", [16], ["P(sum)", "S(0)"], [8]),
                          gradient("mlp/dense_b/kernel", [16, 4], ["P(sum)", "S(0)"], [8, 4]),
                          gradient("mlp/dense_b/bias", [4], ["P(sum)", "S(0)"], [2])],
        },
    }


def gathered_rank() -> dict:
    """The same step on the gradients-gathered mutant (``full_tensor()`` on every gradient)."""
    value = default_build_rank()
    comm = value["communication"]
    comm["calls"][4:7] = [call("all_gather_into_tensor", [[8, 8]], [[16, 8]], made_by=0),
                          call("all_gather_into_tensor", [[8]], [[16]], made_by=1),
                          call("all_gather_into_tensor", [[8, 4]], [[16, 4]], made_by=2),
                          call("all_gather_into_tensor", [[2]], [[4]], made_by=3)]
    comm["redistributions"] = [
        {"shape": [8, 16], "from": ["P(sum)", "S(1)"], "local_numel": 64, "to": ["R", "R"], "result_local_numel": 128},
        {"shape": [16], "from": ["P(sum)", "S(0)"], "local_numel": 8, "to": ["R", "R"], "result_local_numel": 16},
        {"shape": [16, 4], "from": ["P(sum)", "S(0)"], "local_numel": 32, "to": ["R", "R"], "result_local_numel": 64},
        {"shape": [4], "from": ["P(sum)", "S(0)"], "local_numel": 2, "to": ["R", "R"], "result_local_numel": 4},
    ]
    comm["gradients"] = [gradient(g["path"], g["shape"]) for g in comm["gradients"]]
    return value


def test_the_default_build_step_is_within_budget():
    """DTensor's own full-size all-gather inside the update is not the build asking for a copy."""
    assert over_budget(COLSHARD, [default_build_rank(), default_build_rank()], 2) is None


def test_gathered_gradients_are_over_budget_naming_the_op_and_the_tensor():
    found = over_budget(COLSHARD, [gathered_rank(), gathered_rank()], 2)
    assert found is not None
    verdict, message = found
    assert verdict == OVER_BUDGET
    assert "ranks 0, 1: all_gather_into_tensor [8, 8] -> [16, 8] (512 bytes): DTensor.redistribute (full_tensor) made " \
           "a (8, 16) tensor whole, ['P(sum)', 'S(1)'] -> ['R', 'R']: a full-size copy of mlp/dense_a/kernel " \
           "(sharded ['R', 'S(1)'], 64 of 128 elements on this rank)" in message
    assert "all_gather_into_tensor [8, 4] -> [16, 4] (256 bytes)" in message
    assert len(message.splitlines()) == 1 + 4  # each finding once, with the ranks it holds on
    assert "optimizer.apply received mlp/dense_b/kernel's gradient as a plain Tensor (16, 4)" in message
    # The biases are not sharded by the layout: their gathers are not judged.
    assert "bias" not in message


def test_a_plain_whole_gradient_is_over_budget_however_it_was_made():
    """A build that gathers by hand (to_local and a c10d all-gather) leaves no redistribution."""
    value = default_build_rank()
    value["communication"]["gradients"][0] = gradient("mlp/dense_a/kernel", [8, 16])
    lines = full_size_copies(value)
    assert lines == [("optimizer.apply received mlp/dense_a/kernel's gradient as a plain Tensor (8, 16), the whole "
                      "of mlp/dense_a/kernel (sharded ['R', 'S(1)'], 64 of 128 elements on this rank): made whole "
                      "before the update")]
    # A plain LOCAL part is not a whole copy.
    value["communication"]["gradients"][0] = gradient("mlp/dense_a/kernel", [8, 8])
    assert full_size_copies(value) == []


def test_redistributions_that_keep_shards_or_move_nothing_are_within_budget():
    value = default_build_rank()
    comm = value["communication"]
    comm["redistributions"] = [
        # onto the variable's own layout (distribute_tensor of a Partial gradient): a reduce-scatter
        {"shape": [8, 16], "from": ["P(sum)", "P(sum)"], "local_numel": 128, "to": ["R", "S(1)"],
         "result_local_numel": 64},
        # already whole locally (Partial on the mesh's size-1 batch axis): no collective
        {"shape": [16, 4], "from": ["P(sum)", "R"], "local_numel": 64, "to": ["R", "R"], "result_local_numel": 64},
    ]
    comm["calls"].append(call("reduce_scatter_tensor", [[8, 16]], [[8, 8]], made_by=0))
    assert full_size_copies(value) == []


def test_layouts_without_a_split_variable_are_not_judged():
    # batchshard: kernels "sharded" on a model axis of size 1 hold every element: all-reducing a
    # whole gradient over the batch axis is data parallelism, not a copy of a shard.
    batchshard = gathered_rank()
    for v in batchshard["stages"]["fit"]:
        if v["dtensor"]:
            v["local_shape"] = v["shape"]
    spec = axes.cell_spec("mlp", "sgd", "arrays", "nojit", "batchshard")
    assert over_budget(spec, [batchshard, batchshard], 2) is None
    assert fit_checks.communication_scope(spec, [batchshard, batchshard]) == "no variable is split on any rank"
    jit = axes.cell_spec("mlp", "sgd", "arrays", "jit", "colshard")
    assert "compiled step" in fit_checks.communication_scope(jit, [gathered_rank(), gathered_rank()])


def test_dataparallel_synchronising_each_gradient_once_is_within_budget_by_any_means():
    """DDP's bucket, or one all-reduce per gradient (a build without DDP): the same bytes; scalars are free."""
    assert over_budget(DATAPARALLEL, [data_parallel_rank(BUCKET)] * 2, 2) is None
    each = [call("allreduce_", [s], [s]) for s in MLP.values()]
    assert over_budget(DATAPARALLEL, [data_parallel_rank(*each)] * 2, 2) is None
    assert fit_checks.communication_scope(DATAPARALLEL, [data_parallel_rank(BUCKET)] * 2) is None


def test_dataparallel_synchronising_twice_is_over_budget_naming_the_collectives_and_the_bytes():
    """The numbers are identical (an average of averages), the traffic twice: only the budget sees it."""
    again = [call("allreduce_", [s], [s]) for s in MLP.values()]
    verdict, message = over_budget(DATAPARALLEL, [data_parallel_rank(BUCKET, *again)] * 2, 2)
    assert verdict == OVER_BUDGET
    assert message.startswith("one DataParallel train step synchronised more than each gradient once:")
    # the bucket (848 B), the kernels again (512 + 256 B); the biases (64 and 16 B) and scalars are scalar-sized
    assert "rank 0: 3 collectives moved 1616 bytes for 848 bytes of gradients (768 bytes over): allreduce_ [212]" \
        in message


def test_figures_per_rank_for_the_report():
    ranks = [default_build_rank(), gathered_rank()]
    for value in ranks:
        comm = value["communication"]
        comm["count"], comm["bytes"] = len(comm["calls"]), sum(c["bytes"] for c in comm["calls"])
        comm["ops"] = {"all_gather_into_tensor": {"count": 5, "bytes": comm["bytes"]}}
    got = figures(ranks)
    assert [(r["rank"], r["count"], r["redistributions"]) for r in got["ranks"]] == [(0, 9, 0), (1, 10, 4)]
    assert got["ranks"][0]["bytes"] == 3896
    assert len(got["full_size_copies"]) == 4 and all(line.startswith("rank 1: ") for line in got["full_size_copies"])
    # An uneven split: a line that differs by rank is kept per rank.
    other = gathered_rank()
    other["stages"]["fit"][0]["local_shape"] = (8, 4)
    lines = over_budget(COLSHARD, [gathered_rank(), other], 2)[1].splitlines()[1:]
    assert [line.split(":")[0] for line in lines] == ["rank 0", "ranks 0, 1", "rank 0", "ranks 0, 1", "rank 1", "rank 1"]
    missing = copy.deepcopy(ranks)
    del missing[1]["communication"]
    assert figures(missing) is None


def test_the_figures_reach_the_json_and_the_html_report():
    from keras_dtensor_conformance.report.html import html_page
    from keras_dtensor_conformance.report.recorder import CellRecord
    from keras_dtensor_conformance.report.results import build_report

    ranks = [default_build_rank(), default_build_rank()]
    for value in ranks:
        value["communication"]["ops"] = {"all_gather_into_tensor": {"count": 5, "bytes": 2256}}
    record = CellRecord("test_fit[sgd-arrays-nojit-colshard]", "conformance/test_fit.py::test_fit[x]", "fit colshard",
                        "sgd", "arrays/nojit", {"layout": "colshard"}, verdict="pass", outcome="passed",
                        communication=figures(ranks))
    report = build_report([record], {"keras_version": "3.16"}, 1.0)
    cell = report["cells"][0]
    assert cell["communication"]["ranks"][1] == {"rank": 1, "count": 9, "bytes": 3896, "redistributions": 0,
                                                 "ops": {"all_gather_into_tensor": {"count": 5, "bytes": 2256}},
                                                 "gradient_bytes": 424}
    page = html_page(report)
    assert '"communication": {"measured": "one eager train_on_batch"' in page
    assert "collectives / ${c.communication.ranks[0].bytes} B per step on rank 0" in page  # the grid's tooltip
