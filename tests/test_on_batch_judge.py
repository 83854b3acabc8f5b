"""The on-batch cells' judge on hand-made evidence: no ranks, no Keras.

Each call's logs must be the single process's over the global batch on every rank (a rank's local
value is refused even when the ranks' mean is the global one); predictions are the reference's rows
the rank fed, every column; after ``train_on_batch`` the weights are the reference's. A reference
that started from other weights makes nothing comparable. The cells' table is one entry per API.
"""

from __future__ import annotations

import numpy as np
import pytest
from keras_dtensor_conformance.verdicts import ERROR, NUMERICS

from conformance import axes
from conformance.judge import on_batch
from conformance.ranks import on_batch as rank_on_batch
from conformance.test_on_batch import on_batch_cells, on_batch_params

INITIAL = [np.ones((2, 2), "float32")]
WEIGHTS = {"mlp/dense_a/kernel": np.full((2, 2), 0.5, "float32")}
ROWS = {0: np.array([0, 1]), 1: np.array([2, 3])}
GLOBAL = np.arange(16, dtype="float32").reshape(4, 4)


def value(api: str, rank: int | None = None, **fields) -> dict:
    rows = ROWS[rank] if rank is not None else np.arange(4)
    found = {"api": api, "rows": rows, "initial_weights": INITIAL, "weights": WEIGHTS}
    if rank_on_batch.APIS[api][0] == "predict":
        found["predict"] = GLOBAL[rows]
    elif rank_on_batch.APIS[api][0] == "calls":
        found["calls"] = [{"loss": 1.0, "mae": 0.5}, {"loss": 0.8, "mae": 0.4}]
    else:
        found["evaluate"] = {"loss": 1.0, "mae": 0.5}
    return {**found, **fields}


def judged(api: str, ranks: list[dict], reference: dict | None = None):
    return on_batch.on_batch_failure({"api": api}, ranks, reference or value(api))


@pytest.mark.parametrize("api", list(rank_on_batch.APIS))
def test_the_single_process_results_on_every_rank_pass(api):
    assert judged(api, [value(api, 0), value(api, 1)]) is None


def test_a_local_metric_is_refused_naming_the_call_the_rank_and_both_values():
    local = [{"loss": 1.0, "mae": 0.4}, {"loss": 0.8, "mae": 0.4}]
    verdict, message = judged("test_on_batch", [value("test_on_batch", 0, calls=local),
                                                value("test_on_batch", 1)])
    assert verdict == NUMERICS
    assert "test_on_batch() call 1['mae']: rank 0 reports 0.4, rank 1 0.5" in message


def test_evaluate_equal_on_every_rank_but_not_global_is_refused():
    ranks = [value("evaluate", r, evaluate={"loss": 1.0, "mae": 0.45}) for r in (0, 1)]
    verdict, message = judged("evaluate", ranks)
    assert verdict == NUMERICS and "evaluate()['mae']: rank 0 reports 0.45" in message


def test_predictions_with_the_columns_split_are_refused():
    half = value("predict_on_batch", 0, predict=GLOBAL[ROWS[0]][:, :2])
    verdict, message = judged("predict_on_batch", [half, value("predict_on_batch", 1)])
    assert verdict == NUMERICS and "rank 0: predict: shape (2, 2), reference (2, 4)" in message


def test_predictions_of_every_row_are_compared_with_every_row():
    every_row = value("predict", 0, predict=GLOBAL)
    assert judged("predict", [every_row, value("predict", 1)]) is None
    wrong = value("predict", 1, predict=GLOBAL[ROWS[0]])  # rank 1 returned rank 0's rows
    assert judged("predict", [value("predict", 0), wrong])[0] == NUMERICS


def test_weights_after_train_on_batch_are_the_single_process_ones():
    moved = value("train_on_batch", 1, weights={"mlp/dense_a/kernel": np.full((2, 2), 0.6, "float32")})
    verdict, message = judged("train_on_batch", [value("train_on_batch", 0), moved])
    assert verdict == NUMERICS and "rank 1: weight mlp/dense_a/kernel" in message


def test_a_reference_from_other_weights_is_not_comparable():
    elsewhere = value("evaluate", initial_weights=[np.zeros((2, 2), "float32")])
    verdict, message = judged("evaluate", [value("evaluate", 0), value("evaluate", 1)], elsewhere)
    assert verdict == ERROR and "not comparable" in message


def test_every_api_runs_on_the_default_layouts_and_under_full_on_every_layout_compiled_too():
    default, full = on_batch_cells(False), on_batch_cells(True)
    assert {(api, layout) for api, _, layout in default} == {
        (a, l) for a in rank_on_batch.APIS for l in axes.ON_BATCH_DEFAULT_LAYOUTS}
    assert {(api, layout) for api, _, layout in full} == {(a, l) for a in rank_on_batch.APIS for l in axes.MATRIX_LAYOUTS}
    assert {mode for _, mode, _ in default} == {"nojit"} and {mode for _, mode, _ in full} == {"nojit", "jit"}
    ids = [p.id for p in on_batch_params(True)]
    assert "train_on_batch-colshard" in ids and "predict-jit-dataparallel" in ids and len(ids) == len(set(ids))


def test_a_rank_with_other_weights_than_the_reference_is_one_verdict_not_a_traceback():
    extra = value("evaluate", 0, initial_weights=[*INITIAL, np.zeros(2, "float32")])
    verdict, message = judged("evaluate", [extra, value("evaluate", 1)])
    assert verdict == ERROR and message == ("rank 0 built 2 weights, the single-process reference 1: the runs are "
                                            "not comparable")
