"""Scenario cells: failure modes real Keras builds have hit, each judged on what it must keep.

Scenarios that make rank 0 alone run a collective get a short timeout: on a build that hangs
there, the cell fails as ``hang`` in seconds, every rank's stack is dumped, and the session goes on.
"""

from __future__ import annotations

import pytest

from conformance import rank_scenarios
from keras_dtensor_conformance.verdicts import SHARDING_LOST, NUMERICS, CellFailure, fail

SHARDED = ["R", "S(1)"]
HANG_TIMEOUT = 20.0  # a correct build finishes these in milliseconds; a hang costs this, plus a restart


def sharded(kernel: dict, placements=SHARDED) -> bool:
    return kernel["dtensor"] and kernel["placements"] == placements


def check(condition: bool, verdict: str, message: str, result) -> None:
    if not condition:
        raise CellFailure(verdict, message, result)


def _judge_iterate(v, r):
    check(v["match"], NUMERICS, f"rows of the iterated kernel differ from the kernel: {v}", r)


def _judge_partial(v, r):
    check(sharded(v["kernel"]), SHARDING_LOST, f"after assigning a {v['value_placements']} value: {v['kernel']}", r)
    check(v["match"], NUMERICS, "the assigned value differs from the product", r)


def _judge_uneven(v, r):
    check(v["global_shape"] == (8, 5), NUMERICS, f"get_weights() shape {v['global_shape']}", r)
    check(sharded(v["kernel"]), SHARDING_LOST, f"{v['kernel']}", r)
    check(v["match"], NUMERICS, "predict() differs from the forward pass computed from get_weights()", r)


def _judge_kernel_kept(v, r):
    check(sharded(v["kernel"]), SHARDING_LOST, f"{v['kernel']}", r)


def _judge_changed(v, r):
    check(sharded(v["first"]), SHARDING_LOST, f"first model: {v['first']}", r)
    check(sharded(v["second"], ["R", "S(0)"]), SHARDING_LOST, f"second model (row layout): {v['second']}", r)


def _judge_cleared(v, r):
    check(v["distribution"] == "None", "error", f"distribution() after clear_session(): {v['distribution']}", r)
    check("KerasDTensorPromotionMode" not in v["modes"], "error", f"dispatch modes left: {v['modes']}", r)
    check(not v["kernel"]["dtensor"], "error", f"a new layer's kernel is still a DTensor: {v['kernel']}", r)


def _judge_integer(v, r):
    check(sharded(v["variable"]), SHARDING_LOST, f"{v['variable']}", r)
    check(v["value"] == [list(range(8)), list(range(8, 16))], NUMERICS, f"read back {v['value']}", r)


def _judge_precision(v, r):
    check(sharded(v["kernel"]), SHARDING_LOST, f"{v['kernel']}", r)
    check(v["dtype"] == "float32", NUMERICS, f"kernel dtype {v['dtype']}", r)
    check(v["finite"], NUMERICS, "non-finite predictions", r)


def _judge_saved(v, r):
    check(v["same_weights"], NUMERICS, "loaded weights differ from the saved ones", r)
    check(sharded(v["kernel_after_load"]), SHARDING_LOST, f"after load: {v['kernel_after_load']}", r)
    check(sharded(v["kernel_after_fit"]), SHARDING_LOST, f"after training on: {v['kernel_after_fit']}", r)


SCENARIOS = {
    "iterate-dtensor": (rank_scenarios.iterate_dtensor, (), _judge_iterate, None),
    "assign-partial": (rank_scenarios.assign_partial, (), _judge_partial, None),
    "uneven-sharding": (rank_scenarios.uneven_sharding, (), _judge_uneven, None),
    "rank0-convert-to-numpy": (rank_scenarios.rank_zero_only, ("convert-to-numpy",), _judge_kernel_kept, HANG_TIMEOUT),
    "rank0-callback-get-weights": (rank_scenarios.rank_zero_only, ("get-weights",), _judge_kernel_kept, HANG_TIMEOUT),
    "rank0-checkpoint-save": (rank_scenarios.rank_zero_only, ("save-weights",), _judge_kernel_kept, HANG_TIMEOUT),
    "distribution-changed-between-fits": (rank_scenarios.distribution_changed_between_fits, (), _judge_changed, None),
    "clear-session-undoes-distribution": (rank_scenarios.clear_session_undoes_distribution, (), _judge_cleared, None),
    "integer-variable": (rank_scenarios.integer_variable, (), _judge_integer, None),
    "mixed-float16": (rank_scenarios.mixed_precision, ("mixed_float16",), _judge_precision, None),
    "mixed-bfloat16": (rank_scenarios.mixed_precision, ("mixed_bfloat16",), _judge_precision, None),
    "save-load-keras": (rank_scenarios.save_and_load, ("keras",), _judge_saved, None),
    "save-load-weights-h5": (rank_scenarios.save_and_load, ("h5",), _judge_saved, None),
}


@pytest.mark.parametrize("scenario", [
    pytest.param(name, id=name, marks=pytest.mark.cell(family="scenarios", row=name, column="colshard", scenario=name))
    for name in SCENARIOS
])
def test_scenario(keras_ranks, scenario):
    function, args, judge, timeout = SCENARIOS[scenario]
    result = keras_ranks.run(function, *args, timeout=timeout)
    if not result.ok:
        fail(result)
    for value in result.values:
        judge(value, result)
