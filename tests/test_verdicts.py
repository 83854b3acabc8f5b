"""Each verdict category is produced from a real cause on the ranks, not from a canned message."""

from __future__ import annotations

import copy

from conformance import axes, rank_train
from conformance.judge import judge_fit
from keras_dtensor_conformance.verdicts import (
    COMPILE_FALLBACK,
    CRASH_VERDICT,
    HANG_VERDICT,
    MIXED_TENSOR,
    NO_SHARDING_STRATEGY,
    NUMERICS,
    SHARDING_LOST,
    CellFailure,
    classify_failure,
)
from tests import torch_cells, verdict_cells


def verdict(spec, result, reference, nproc) -> str:
    try:
        judge_fit(spec, result, reference, nproc)
    except CellFailure as failure:
        return failure.verdict
    return "pass"


def test_mixed_tensor_with_promotion_mode_off(keras_ranks):
    result = keras_ranks.run(verdict_cells.subtract_without_promotion, False)
    assert classify_failure(result)[0] == MIXED_TENSOR, result.story()


def test_mixed_tensor_under_torch_compile_is_found_down_the_chain(keras_ranks):
    """Dynamo reports it as 'RuntimeError when making fake tensor call'; the verdict is the same."""
    result = keras_ranks.run(verdict_cells.subtract_without_promotion, True)
    error = result.outcomes[0].error
    assert "TorchRuntimeError" in error.type
    assert "got mixed" not in error.chain[0].splitlines()[0]
    assert classify_failure(result)[0] == MIXED_TENSOR, result.story()


def test_no_sharding_strategy(keras_ranks):
    result = keras_ranks.run(verdict_cells.searchsorted_on_dtensor)
    assert classify_failure(result)[0] == NO_SHARDING_STRATEGY, result.story()


def test_hang_and_crash(dist_ranks):
    assert classify_failure(dist_ranks.run(torch_cells.hang_on_rank, 1, timeout=5))[0] == HANG_VERDICT
    assert classify_failure(dist_ranks.run(torch_cells.crash_on_rank, 0, "kill"))[0] == CRASH_VERDICT


def test_training_verdicts(keras_ranks, references):
    """One real run per check: a right cell passes, and each way of being wrong gets its verdict."""
    n = keras_ranks.nproc
    spec = axes.cell_spec("mlp", "adam", "arrays", "nojit", "colshard")
    result = keras_ranks.run(rank_train.train, spec)
    assert verdict(spec, result, references.get(spec), n) == "pass"

    # sharding-lost: the LayoutMap key "dense.*kernel" matches nothing (re.fullmatch), so the
    # kernels the cell asked to shard stay plain Parameters.
    unmatched = copy.deepcopy(spec)
    unmatched["layout"]["map"] = {"dense.*kernel": [None, "model"]}
    assert verdict(spec, keras_ranks.run(rank_train.train, unmatched), references.get(spec), n) == SHARDING_LOST

    # numerics: the reference trained with another learning rate is not what the ranks computed.
    other = copy.deepcopy(spec)
    other["optimizer"]["kwargs"]["learning_rate"] = 0.02
    assert verdict(spec, result, references.get(other), n) == NUMERICS

    # compile-fallback: this nightly warns and runs jit_compile=True eagerly under ModelParallel.
    jit = axes.cell_spec("mlp", "adam", "arrays", "jit", "colshard")
    assert verdict(jit, keras_ranks.run(rank_train.train, jit), references.get(jit), n) == COMPILE_FALLBACK
