"""Each rank feeds its own part of every global batch, and the numerics rules that follow from it.

Keras' multi-process contract is per-process local data assembled into the global batch (torch:
``DTensor.from_local`` of the per-process batch). While every rank fed the whole batch, a
DataParallel that never all-reduced its gradients passed (each rank's gradient was already the
global one): the ``dataparallel-no-allreduce`` mutant proves that blind spot closed.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance import axes
from conformance.judge.numerics import numerics_problems
from conformance import cell_data
from conformance.ranks import train as rank_train

NPROCS = (1, 2, 3, 4, 8)


@pytest.mark.parametrize("nproc", NPROCS)
def test_every_rank_feeds_an_equal_part(nproc):
    """The global batch divides evenly over every batch-shard count a cell can have."""
    assert cell_data.BATCH % nproc == 0
    parts = [cell_data.local_rows(i, nproc) for i in range(nproc)]
    assert {len(p) for p in parts} == {cell_data.SAMPLES // nproc}


@pytest.mark.parametrize("nproc", NPROCS)
def test_the_parts_make_up_each_global_batch_in_order(nproc):
    """Concatenating the ranks' rows of step s gives global batch s, rows in order."""
    local = cell_data.BATCH // nproc
    parts = [cell_data.local_rows(i, nproc).reshape(cell_data.STEPS, local) for i in range(nproc)]
    for step in range(cell_data.STEPS):
        rows = np.concatenate([p[step] for p in parts])
        assert rows.tolist() == list(range(step * cell_data.BATCH, (step + 1) * cell_data.BATCH))


@pytest.mark.parametrize(("layout", "nproc", "parts"), [
    ("colshard", 2, [(0, 1), (0, 1)]),  # a (1, n) mesh: one batch shard, every rank feeds it all
    ("rowshard", 3, [(0, 1)] * 3),
    ("batchshard", 3, [(0, 3), (1, 3), (2, 3)]),  # (n, 1): rank r feeds shard r
    ("dataparallel", 4, [(0, 4), (1, 4), (2, 4), (3, 4)]),
    ("batchxmodel", 4, [(0, 2), (0, 2), (1, 2), (1, 2)]),  # 2x2: by the batch coordinate
    # meshes named or ordered otherwise: the batch axis found by its name, not its place
    ("colshard-modelfirst", 2, [(0, 1), (0, 1)]),  # ("model", "batch") = (n, 1)
    ("batchshard-modelfirst", 2, [(0, 2), (1, 2)]),  # ("model", "batch") = (1, n)
    ("colshard-data", 2, [(0, 1), (0, 1)]),  # ("data", "model") = (1, n)
])
def test_batch_part_is_the_ranks_batch_coordinate(layout, nproc, parts):
    assert [cell_data.batch_part(axes.LAYOUTS[layout], r, nproc) for r in range(nproc)] == parts


# ---------------------------------------------------------------- numerics rules
def _reference(rows=24):
    rng = np.random.default_rng(1)
    return {"step_losses": [1.0, 0.9, 0.8, 0.7], "epoch_loss": [0.7], "evaluate": 0.6,
            "predict": rng.standard_normal((rows, 4)), "weights": {"w": np.arange(3.0)}}


def _rank(reference, index, count, **override):
    rows = np.arange(index * len(reference["predict"]) // count, (index + 1) * len(reference["predict"]) // count)
    value = {"step_losses": reference["step_losses"], "epoch_loss": reference["epoch_loss"],
             "evaluate": reference["evaluate"], "predict": reference["predict"][rows], "rows": rows,
             "batch_part": [index, count], "weights": dict(reference["weights"])}
    return {**value, **override}


def test_global_values_on_every_rank_pass():
    ref = _reference()
    assert numerics_problems([_rank(ref, 0, 2), _rank(ref, 1, 2)], ref) == []


def test_local_values_whose_mean_is_the_global_pass():
    """DDP without a metric all-reduce: rank 0 reports 0.5, rank 1 0.7 where the global is 0.6."""
    ref = _reference()
    values = [_rank(ref, 0, 2, evaluate=0.5), _rank(ref, 1, 2, evaluate=0.7)]
    assert numerics_problems(values, ref) == []


def test_local_values_that_do_not_average_to_the_global_fail():
    ref = _reference()
    values = [_rank(ref, 0, 2, evaluate=0.5), _rank(ref, 1, 2, evaluate=0.6)]
    problems = numerics_problems(values, ref)
    assert any("evaluate (mean over 2 batch shard(s))" in p for p in problems), problems


def test_one_wrong_rank_of_replicas_fails():
    """Ranks of one batch shard fed the same rows: they cannot report different values."""
    ref = _reference()
    values = [_rank(ref, 0, 1, evaluate=0.5), _rank(ref, 0, 1, evaluate=0.7)]
    problems = numerics_problems(values, ref)
    assert any("fed the same rows but report different evaluate" in p for p in problems), problems


def test_predict_is_compared_with_the_rows_the_rank_fed():
    ref = _reference()
    swapped = _rank(ref, 0, 2, predict=ref["predict"][12:])
    problems = numerics_problems([swapped, _rank(ref, 1, 2)], ref)
    assert any(p.startswith("rank 0: predict") for p in problems), problems


def test_predict_of_all_rows_is_accepted():
    """A build that gathers the batch axis too returns the global rows on every rank."""
    ref = _reference()
    assert numerics_problems([_rank(ref, 0, 2, predict=ref["predict"]), _rank(ref, 1, 2)], ref) == []


def test_weights_must_be_the_global_references_on_every_rank():
    ref = _reference()
    drifted = _rank(ref, 1, 2, weights={"w": np.arange(3.0) + 0.01})
    problems = numerics_problems([_rank(ref, 0, 2), drifted], ref)
    assert "ranks 0 and 1 disagree on weight w" in problems
    assert any(p.startswith("rank 1: weight w") for p in problems), problems


# ---------------------------------------------------------------- on the ranks
def test_dataparallel_ranks_feed_and_predict_their_own_rows(keras_ranks):
    """On the real build: each DataParallel rank fed its own rows and got predictions for them."""
    n = keras_ranks.nproc
    spec = axes.cell_spec("mlp", "sgd", "arrays", "nojit", "dataparallel")
    result = keras_ranks.run(rank_train.train, spec)
    assert result.ok, result.story()
    for rank, value in enumerate(result.values):
        assert value["batch_part"] == [rank, n]
        assert value["rows"].tolist() == cell_data.local_rows(rank, n).tolist()
        assert len(value["predict"]) == cell_data.SAMPLES // n
