"""Evidence -> verdict for the scenario cells (``conformance/test_scenarios.py``): one function per
scenario judge name (``SCENARIO_JUDGES``), run on each rank's evidence."""

from __future__ import annotations

from keras_dtensor_conformance import ERROR, HANG_CONSEQUENCES, HANG_VERDICT, NUMERICS, SHARDING_LOST

from conformance.judge.cells import check, ran_everywhere


SHARDED = ["R", "S(1)"]


def sharded(kernel: dict, placements=SHARDED) -> bool:
    return kernel["dtensor"] and kernel["placements"] == placements


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


#: What passes a rank-0-only gather (no SPMD build can gather a sharded kernel on one rank alone):
#: rank 0 raising within this many seconds an exception that is not one of the process group's
#: own timeouts or lost connections (that is a hang seen from inside), while every rank finishes
#: training with its kernel still sharded.
RANK0_RAISE_WITHIN_S = 5.0
NOT_A_CLEAR_ERROR = HANG_CONSEQUENCES


def _judge_rank_zero_only(v, r):
    _judge_kernel_kept(v, r)
    if v["rank"] != 0:
        return
    raised, what = v["raised"], v["what"]
    check(raised is not None, ERROR, f"rank 0 ran {what} alone and it raised nothing (returned shape "
          f"{v['returned_shape']}): a sharded kernel cannot be gathered on one rank, so a build must refuse "
          "it with a clear error", r)
    said = f"{raised['type']}: {raised['message']} (after {raised['elapsed']:.1f} s)"
    check(not NOT_A_CLEAR_ERROR.search(f"{raised['type']}: {raised['message']}"), HANG_VERDICT,
          f"rank 0 ran {what} alone and waited for the process group's timeout: {said}", r)
    check(raised["elapsed"] <= RANK0_RAISE_WITHIN_S, HANG_VERDICT, f"rank 0 ran {what} alone and raised only "
          f"after more than {RANK0_RAISE_WITHIN_S} s: {said}", r)


def _judge_changed(v, r):
    check(sharded(v["first"]), SHARDING_LOST, f"first model: {v['first']}", r)
    check(sharded(v["second"], ["R", "S(0)"]), SHARDING_LOST, f"second model (row layout): {v['second']}", r)


def _judge_reshaped(v, r):
    check(sharded(v["first"]), SHARDING_LOST, f"first model ((1, world) mesh): {v['first']}", r)
    check(sharded(v["second"]), SHARDING_LOST, f"second model ((world, 1) mesh): {v['second']}", r)


def _judge_cleared(v, r):
    check(v["distribution"] == "None", ERROR, f"distribution() after clear_session(): {v['distribution']}", r)
    check("KerasDTensorPromotionMode" not in v["modes"], ERROR, f"dispatch modes left: {v['modes']}", r)
    check(not v["kernel"]["dtensor"], ERROR, f"a new layer's kernel is still a DTensor: {v['kernel']}", r)


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


#: scenario judge name -> the function that judges one rank's evidence.
SCENARIO_JUDGES = {
    "iterate": _judge_iterate,
    "partial": _judge_partial,
    "uneven": _judge_uneven,
    "rank-zero-only": _judge_rank_zero_only,
    "changed": _judge_changed,
    "reshaped": _judge_reshaped,
    "cleared": _judge_cleared,
    "integer": _judge_integer,
    "precision": _judge_precision,
    "saved": _judge_saved,
}


def judge_scenario(judge: str, result) -> None:
    """A scenario cell: ran on every rank, and each rank's evidence keeps what the scenario guards."""
    ran_everywhere(result)
    for value in result.values:
        SCENARIO_JUDGES[judge](value, result)
