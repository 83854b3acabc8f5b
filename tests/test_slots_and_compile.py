"""The slot count check (conformance/slots.py) and the whole-step compile check
(conformance/compile_evidence.py): each passes what the default build really does and fails each
way of being short, with a message that names what is missing.

The mutants ``slots-renamed`` and ``graph-break-mid-step`` (tests/mutants/training.py) prove the same on
real patched builds; these tests pin the rules on evidence, and the slot matching on a real run.
"""

from __future__ import annotations

import copy

from keras_dtensor_conformance.verdicts import COMPILE_FALLBACK, SHARDING_LOST

from conformance import axes
from conformance.judge import compile_evidence, fit_checks, slots
from conformance.ranks import train as rank_train

COLSHARD = axes.LAYOUTS["colshard"]
KERNEL = {"path": "mlp/dense_a/kernel", "shape": (8, 16), "dtensor": True, "placements": ["R", "S(1)"],
          "local_shape": (8, 8), "type": "Parameter"}


def _slot(name, shape, factor=None, placements=None, local_shape=None):
    info = {"path": f"adam/{name}", "shape": shape, "reference": KERNEL["path"], "factor": factor,
            "dtensor": placements is not None, "type": "DTensor" if placements else "Tensor"}
    if placements:
        info.update(placements=placements, local_shape=local_shape)
    return info


def _full(name):
    return _slot(name, (8, 16), placements=["R", "S(1)"], local_shape=(8, 8))


# ---------------------------------------------------------------- slot counts
def test_all_slots_found_pass_and_a_missing_one_is_named():
    found = [_full("mlp_dense_a_kernel_momentum"), _full("mlp_dense_a_kernel_velocity")]
    assert slots.slot_problems("adam", COLSHARD, [KERNEL], found, 2) == []
    assert slots.slot_problems("adam", COLSHARD, [KERNEL], found[:1], 2) == [
        "expected 2 optimizer slots for mlp/dense_a/kernel, found 1: adam/mlp_dense_a_kernel_momentum"]
    # Nothing matched (a build that renamed its slots): the check that looked only at the slots
    # it found passed here; the count does not.
    assert slots.slot_problems("adam-amsgrad", COLSHARD, [KERNEL], [], 2) == [
        "expected 3 optimizer slots for mlp/dense_a/kernel, found 0: none"]


def test_unsharded_variables_are_not_counted():
    bias = {"path": "mlp/dense_a/bias", "shape": (16,), "dtensor": False, "type": "Parameter"}
    assert slots.slot_problems("adam", COLSHARD, [bias], [], 2) == []


def test_muon_gives_a_velocity_to_what_adamw_updates():
    embeddings = {**KERNEL, "path": "emb/embedding/embeddings"}
    attention = {**KERNEL, "path": "attn/attention/query/kernel", "shape": (8, 4, 2)}
    assert slots.expected("muon", KERNEL) == {"full": 1, "factored": 0}
    assert slots.expected("muon", embeddings)["full"] == 2
    assert slots.expected("muon", attention)["full"] == 2


def test_factored_slots_are_counted_and_held_to_a_layout():
    velocity = _full("mlp_dense_a_kernel_velocity")
    r_plain, c_plain = _slot("kernel", (8,), 0), _slot("kernel_1", (16,), 1)
    assert slots.slot_problems("adafactor", COLSHARD, [KERNEL], [velocity, r_plain, c_plain], 2) == []
    assert slots.slot_problems("adafactor", COLSHARD, [KERNEL], [velocity, r_plain], 2) == [
        "expected 2 factored optimizer slots for mlp/dense_a/kernel, found 1: adam/kernel"]
    # c keeps the kernel's sharded column axis: Shard(0) on the model axis is the kernel's layout
    # kept; Shard(0) on r (whose kept axis the kernel does not shard) is neither that nor replicated.
    c_sharded = _slot("kernel_1", (16,), 1, ["R", "S(0)"], (8,))
    r_sharded = _slot("kernel", (8,), 0, ["R", "S(0)"], (4,))
    assert slots.slot_problems("adafactor", COLSHARD, [KERNEL], [velocity, r_plain, c_sharded], 2) == []
    problems = slots.slot_problems("adafactor", COLSHARD, [KERNEL], [velocity, r_sharded, c_plain], 2)
    assert problems == ["adam/kernel (factored r of mlp/dense_a/kernel): DTensor ['R', 'S(0)'] local (4,), "
                        "expected ['R', 'R'] local (8,) or replicated"]
    wrong_shape = _slot("kernel", (16,), 0)
    assert "shape (16,), expected (8,)" in slots.slot_problems(
        "adafactor", COLSHARD, [KERNEL], [velocity, wrong_shape, c_plain], 2)[0]


def test_factored_layout_keeps_the_variables_sharding_on_the_kept_dimensions():
    rows = {**KERNEL, "placements": ["S(0)", "R"]}
    row_layout = axes.LAYOUTS["rowshard"]
    assert slots.factored_layout(row_layout, rows, 0, 2) == (["R", "S(0)"], (4,))  # r keeps the rows
    assert slots.factored_layout(row_layout, rows, 1, 2) == (["R", "R"], (16,))  # c reduced them
    query = {"path": "attn/attention/query/kernel", "shape": (8, 4, 2)}
    assert slots.factored_layout(COLSHARD, query, 0, 2) == (["R", "S(1)"], (8, 2))
    assert slots.factored_layout(COLSHARD, query, 1, 2) == (["R", "R"], (8, 2))


def _adafactor_cell(keras_ranks):
    spec = axes.cell_spec("mlp", "adafactor", "arrays", "nojit", "colshard")
    result = keras_ranks.run(rank_train.train, spec)
    assert result.ok, result.story()
    return spec, result


def test_real_adafactor_slots_are_found_per_kernel(keras_ranks):
    """On the default build: both kernels' velocity and factored r, c are found, each with its own
    kernel although every factored slot is named "kernel" and dense_a's c and dense_b's r are
    both (16,); the judge passes them, and fails the same evidence with a slot taken away."""
    spec, result = _adafactor_cell(keras_ranks)
    value = result.values[0]
    by_kernel = {}
    for slot in value["slots"]:
        by_kernel.setdefault(slot["reference"], []).append((slot["factor"], tuple(slot["shape"])))
    assert sorted(by_kernel["mlp/dense_a/kernel"], key=str) == [(0, (8,)), (1, (16,)), (None, (8, 16))]
    assert sorted(by_kernel["mlp/dense_b/kernel"], key=str) == [(0, (16,)), (1, (4,)), (None, (16, 4))]
    assert fit_checks.sharding_checks(spec, result.values, keras_ranks.nproc)[0] is None

    short = copy.deepcopy(result)
    for value in short.values:
        value["slots"] = [s for s in value["slots"]
                          if not (s["reference"] == "mlp/dense_b/kernel" and s["factor"] == 1)]
    verdict, message = fit_checks.sharding_checks(spec, short.values, keras_ranks.nproc)[0]
    assert verdict == SHARDING_LOST
    assert "expected 2 factored optimizer slots for mlp/dense_b/kernel, found 1" in message


# ---------------------------------------------------------------- whole-step compile
#: What the default build's test_fit[sgd-arrays-jit-dataparallel] gives (measured, abridged).
NIGHTLY = {
    "compiled_graphs": 4, "aot_graphs": 4, "failed_frames": [], "frames_not_compiled": 1,
    "compiled_frames": ["error_handler keras/src/utils/traceback_utils.py:111 (32 ops)"],
    "graph_breaks": {
        "Unsupported method call Explanation: Dynamo does not know how to trace method "
        "`set_runtime_stats_and_log` of class `Logger`": {"count": 1, "frames": ["train_step trainer.py:101"]},
        "Attempted to call function marked as skipped Explanation: Dynamo developers have intentionally "
        "marked that the function `DistributedDataParallel._inside_ddp_forward` in file torch/_compile.py "
        "should not be traced.": {"count": 2, "frames": ["helper contextlib.py:299"]},
        "Unsupported Tensor.backward() call Explanation: Dynamo currently does not support tracing "
        "`Tensor.backward()` when trace_autograd_ops is off.": {
            "count": 2, "frames": ["torch_dynamo_resume_in_train_step_at_107 trainer.py:107"]},
    },
    "warnings": [],
}
JIT = axes.cell_spec("mlp", "sgd", "arrays", "jit", "dataparallel")


def _verdict(value):
    return fit_checks.not_compiled(JIT, [value, value]) or ("pass", "")


def test_the_default_builds_compiled_step_passes():
    assert compile_evidence.compile_problems(NIGHTLY) == []
    assert _verdict(NIGHTLY) == ("pass", "")


def test_a_graph_break_mid_step_is_a_fallback_and_is_named():
    broken = copy.deepcopy(NIGHTLY)
    reason = "Call to `torch._dynamo.graph_break()` Explanation: User-inserted graph break. Message: None"
    broken["graph_breaks"][reason] = {"count": 2, "frames": ["torch_dynamo_resume_in_train_step_at_107 trainer.py:107"]}
    verdict, message = _verdict(broken)
    assert verdict == COMPILE_FALLBACK
    assert ("rank 0: graph break (2x, in torch_dynamo_resume_in_train_step_at_107 trainer.py:107): "
            "Call to `torch._dynamo.graph_break()`") in message


def test_a_failed_frame_or_an_eager_backward_is_a_fallback():
    failed = {**NIGHTLY, "failed_frames": ["train_step trainer.py:101: Unsupported: x"]}
    assert _verdict(failed)[0] == COMPILE_FALLBACK
    assert "frame fell back to eager: train_step trainer.py:101" in _verdict(failed)[1]
    no_aot = {**NIGHTLY, "aot_graphs": 0}
    assert "the backward ran eagerly" in _verdict(no_aot)[1]
    nothing = {**NIGHTLY, "compiled_graphs": 0, "warnings": ["Running without `torch.compile`"]}
    assert _verdict(nothing) == (COMPILE_FALLBACK, "jit_compile=True but torch._dynamo compiled no graph "
                                                   "(Running without `torch.compile`)")
