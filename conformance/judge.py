"""Evidence -> verdict, for every cell family: the one place a cell's verdict is decided.

The rank modules (``rank_*.py``) only gather evidence and return it as plain data; the test
modules only run a cell and hand its evidence here. Each ``judge_*`` function raises
``CellFailure`` with the cell's verdict, or returns when the cell passes. Each check is a
function of its own, named for what it proves, taking only the evidence it needs, so a reader
sees what a verdict rests on.
"""

from __future__ import annotations

import pytest

from conformance.numerics import numerics_problems
from conformance.sharding import sharding_problems
from keras_dtensor_conformance.verdicts import (
    COMPILE_FALLBACK,
    ERROR,
    NUMERICS,
    SHARDING_LOST,
    CellFailure,
    fail,
)


def check(condition: bool, verdict: str, message: str, result) -> None:
    """Raise ``CellFailure(verdict, message)`` unless ``condition`` holds."""
    if not condition:
        raise CellFailure(verdict, message, result)


def ran_everywhere(result) -> None:
    """Every rank returned: otherwise the failure is classified from the exception chains."""
    if not result.ok:
        fail(result)


def skip_if_not_in_build(result) -> None:
    """A cell the build has no API for (e.g. an optimizer it lacks) is skipped with the reason."""
    for outcome in result.outcomes:
        if outcome.error is not None and outcome.error.type.endswith("NotInBuild"):
            pytest.skip(outcome.error.message)


# ---------------------------------------------------------------- training cells
def sharding_kept(spec: dict, values: list[dict], nproc: int, result) -> None:
    """Every variable the layout shards, and every optimizer slot of it, is a DTensor as asked."""
    problems = []
    for rank, value in enumerate(values):
        for stage, variables in value["stages"].items():
            problems += sharding_problems(spec["layout"], variables, nproc, f"rank {rank} after {stage}: ")
        problems += sharding_problems(spec["layout"], value["slots"], nproc, f"rank {rank} optimizer slot ")
    check(not problems, SHARDING_LOST, "\n".join(problems), result)


def numbers_match_reference(values: list[dict], reference, result) -> None:
    """Losses, evaluate, predict and final weights equal the single-process reference's."""
    if not reference.ok:
        raise CellFailure(ERROR, "the single-process reference failed:\n" + reference.story(), reference)
    problems = numerics_problems(values, reference.values[0])
    check(not problems, NUMERICS, "\n".join(problems), result)


def really_compiled(spec: dict, values: list[dict], result) -> None:
    """A ``jit`` cell's fit ran compiled graphs (torch._dynamo's own counters)."""
    if spec["compile"] != "jit":
        return
    if any(v["compiled_graphs"] == 0 for v in values):
        said = "; ".join(dict.fromkeys(w for v in values for w in v["warnings"])) or "no warning"
        raise CellFailure(COMPILE_FALLBACK, f"jit_compile=True but torch._dynamo compiled no graph ({said})", result)


def judge_fit(spec: dict, result, reference, nproc: int) -> None:
    """A training cell: ran, kept its sharding, matched the reference, and compiled if asked."""
    ran_everywhere(result)
    values = result.values
    sharding_kept(spec, values, nproc, result)
    numbers_match_reference(values, reference, result)
    really_compiled(spec, values, result)


# ---------------------------------------------------------------- op cells
def judge_op(compile_mode: str, result) -> None:
    """An op cell: ran, equals the same op on plain tensors, and compiled when asked."""
    ran_everywhere(result)
    for rank, value in enumerate(result.values):
        check(value["match"], NUMERICS, f"rank {rank}: got {value['got']}, expected {value['expected']}", result)
    if compile_mode == "compiled" and any(v["compiled_graphs"] == 0 for v in result.values):
        raise CellFailure(COMPILE_FALLBACK, "torch.compile ran the op but torch._dynamo compiled no graph", result)


# ---------------------------------------------------------------- setup cells
def judge_setup(result) -> None:
    """A setup cell passes when the keras.distribution entry point ran on every rank."""
    ran_everywhere(result)


# ---------------------------------------------------------------- scenario cells
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


def _judge_changed(v, r):
    check(sharded(v["first"]), SHARDING_LOST, f"first model: {v['first']}", r)
    check(sharded(v["second"], ["R", "S(0)"]), SHARDING_LOST, f"second model (row layout): {v['second']}", r)


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
    "kernel-kept": _judge_kernel_kept,
    "changed": _judge_changed,
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
