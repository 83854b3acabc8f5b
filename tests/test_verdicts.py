"""Each verdict category is produced from a real cause on the ranks, not from a canned message."""

from __future__ import annotations

import copy
import re

from keras_dtensor_conformance.rank.outcomes import HANG
from keras_dtensor_conformance.verdicts import (
    COMPILE_FALLBACK,
    COMPILE_TIMEOUT,
    CRASH_VERDICT,
    HANG_VERDICT,
    MIXED_TENSOR,
    NO_SHARDING_STRATEGY,
    NUMERICS,
    SHARDING_LOST,
    CellFailure,
    classify_failure,
)

from conformance import axes
from conformance.judge.cells import judge_fit
from conformance.ranks import train as rank_train
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
    verdict, message = classify_failure(dist_ranks.run(torch_cells.hang_on_rank, 1, timeout=5))
    assert verdict == HANG_VERDICT
    assert "hung (no answer within the 5s timeout)" in message and "compiling" not in message
    assert classify_failure(dist_ranks.run(torch_cells.crash_on_rank, 0, "kill"))[0] == CRASH_VERDICT


def run_warm(pool, fn, *args, timeout: float):
    """``pool.run`` on ranks that already compiled once: a fresh rank's first seconds go to
    importing the cell module and dynamo, so a short timeout would catch them there instead."""
    assert pool.run(torch_cells.compile_for_long, 1).ok
    return pool.run(fn, *args, timeout=timeout)


def test_timeout_while_compiling_is_not_a_hang(dist_ranks):
    """Out of time with dynamo still tracing (its frames in the stacks dumped at the timeout) is a
    slow compile, not a deadlock; a rank waiting for the compiling one does not make it a hang."""
    result = run_warm(dist_ranks, torch_cells.compile_for_long, timeout=3)
    assert all(o.status == HANG and o.compiling for o in result.outcomes), result.story()
    verdict, message = classify_failure(result)
    assert verdict == COMPILE_TIMEOUT
    assert re.search(r"rank 0 \(pid \d+\): timed out while compiling \(no answer within the 3s timeout; "
                     r"still in torch/_dynamo/\S+\.py in [\w<>]+\)", message), message
    assert "hung" not in message.splitlines()[0]

    result = run_warm(dist_ranks, torch_cells.compile_on_rank, 1, timeout=3)
    verdict, message = classify_failure(result)
    assert verdict == COMPILE_TIMEOUT, message
    assert "barrier" in result.outcomes[0].stack and not result.outcomes[0].compiling
    assert re.search(r"first failure: rank 1 \(pid \d+\): timed out while compiling .*; then rank 0 "
                     r"\(pid \d+\): hung", message.splitlines()[0]), message


def test_the_first_failure_names_the_verdict_not_a_later_crash(dist_ranks):
    """A rank raises a real no-sharding-strategy error; another dies a second later. The cell is
    judged by the bug that came first, not by the worst status."""
    result = dist_ranks.run(torch_cells.no_strategy_then_crash_on_rank, 1)
    assert [o.status for o in result.outcomes[:2]] == ["raised", "crash"], result.story()
    verdict, message = classify_failure(result)
    assert verdict == NO_SHARDING_STRATEGY, message
    assert "; first failure: rank 0 " in message.splitlines()[0]


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
