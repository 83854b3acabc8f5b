"""The Keras-sharded cells' judge on hand-made evidence: no ranks, no Keras.

Good evidence (each batch shard a distinct part of every epoch, together the whole, ranks of one
model axis alike, epoch 2 reshuffled, predict returning each fed row once) passes; each way a
build can break the contract gets ``data-not-sharded`` with a message naming it.
"""

from __future__ import annotations

import pytest
from keras_dtensor_conformance.verdicts import DATA_NOT_SHARDED, NUMERICS

from conformance import axes
from conformance.judge import data_sharding
from conformance.judge.cells import batch_coordinates

SAMPLES = 96
SHUFFLED = {"shuffles": True}


def steps(rows: list[int], batch: int = 12) -> list[list[int]]:
    return [rows[i:i + batch] for i in range(0, len(rows), batch)]


def rank(r: int, epochs: list[list[int]], evaluate: list[int], predict: list[int] | None = None,
         returned: list[int] | None = None) -> dict:
    predict = evaluate if predict is None else predict
    return {"rank": r, "samples": SAMPLES, "fit": [steps(e) for e in epochs], "evaluate": steps(evaluate),
            "predict_fed": steps(predict), "predict_returned": list(predict if returned is None else returned)}


def sharded(shards: int = 2, samples: int = SAMPLES) -> list[list[int]]:
    """Shard ``s`` of ``shards``: every ``shards``-th row (a strided split, like DistributedSampler's)."""
    return [list(range(s, samples, shards)) for s in range(shards)]


def reshuffled(rows: list[int]) -> list[int]:
    return list(reversed(rows))


def good(shards: int = 2) -> list[dict]:
    parts = sharded(shards)
    epoch_2 = [reshuffled(list(range(SAMPLES)))[s::shards] for s in range(shards)]
    return [rank(s, [parts[s], epoch_2[s]], parts[s]) for s in range(shards)]


DP = batch_coordinates({"kind": "data-parallel"}, 2)


def failure(values, coords=DP, spec=SHUFFLED):
    found = data_sharding.data_failure(spec, values, coords)
    assert found is not None and found[0] == DATA_NOT_SHARDED
    return found[1]


def test_a_distinct_part_per_shard_together_the_whole_passes():
    assert data_sharding.data_failure(SHUFFLED, good(), DP) is None


def test_the_batch_coordinates_follow_the_mesh():
    assert DP == {0: 0, 1: 1}
    assert batch_coordinates(axes.LAYOUTS["batchshard"], 2) == {0: 0, 1: 1}
    assert batch_coordinates(axes.LAYOUTS["colshard"], 2) == {0: 0, 1: 0}
    assert batch_coordinates(axes.LAYOUTS["batchxmodel"], 4) == {0: 0, 1: 0, 2: 1, 3: 1}


def test_every_process_seeing_everything_is_named_not_sharded():
    everything = list(range(SAMPLES))
    values = [rank(r, [everything, reshuffled(everything)], everything) for r in range(2)]
    assert "Keras did not shard the data: each of the 2 batch shards received all 96 rows" in failure(values)


def test_one_batch_shard_sees_everything_on_every_rank():
    everything = list(range(SAMPLES))
    values = [rank(r, [everything, reshuffled(everything)], everything) for r in range(2)]
    assert data_sharding.data_failure(SHUFFLED, values, batch_coordinates(axes.LAYOUTS["colshard"], 2)) is None


def test_ranks_of_one_model_axis_must_receive_the_same_rows():
    coords = batch_coordinates(axes.LAYOUTS["batchxmodel"], 4)
    values = good(2)
    values = [dict(values[0], rank=0), dict(values[0], rank=1), dict(values[1], rank=2), dict(values[1], rank=3)]
    assert data_sharding.data_failure(SHUFFLED, values, coords) is None
    values[1] = dict(values[1], fit=[steps(reshuffled(sharded()[0])), values[1]["fit"][1]])
    assert "ranks 0 and 1 share batch coordinate 0" in failure(values, coords)


def test_overlapping_parts_and_dropped_rows_are_named():
    overlapping = [rank(0, [list(range(48)), list(range(48))], list(range(48))),
                   rank(1, [list(range(40, 88)), list(range(40, 88))], list(range(40, 88)))]
    message = failure(overlapping, spec={})
    assert "rows no process received (silently dropped): 88, 89" in message
    assert "8 rows received more than once over the 2 batch shards" in message


def test_unequal_steps_are_named():
    """The same rows in more, smaller steps on one process: under DDP its peers would wait for them."""
    values = good()
    values[1]["fit"][0] = steps(sharded()[1], batch=8)
    assert failure(values) == "fit: processes took different numbers of steps per epoch: {0: [4, 4], 1: [6, 4]}"


def test_epoch_2_in_epoch_1_order_is_not_reshuffled():
    parts = sharded()
    values = [rank(s, [parts[s], parts[s]], parts[s]) for s in range(2)]
    assert "shuffle=True but ranks [0, 1] received epoch 2 in epoch 1's order" in failure(values)
    assert data_sharding.data_failure({"shuffles": False}, values, DP) is None


def test_predict_must_return_each_fed_row_once():
    values = good()
    values[0]["predict_returned"] = values[0]["predict_returned"] * 2
    assert "predict: rank 0 returned 96 predictions, not one for each of the 48 rows it fed" in failure(values)


def test_a_row_that_is_no_global_row_is_named():
    values = good()
    values[1]["evaluate"][0][0] = -1
    assert "evaluate: ranks [1] received rows that are in no global row" in failure(values)


@pytest.mark.parametrize(("repeats", "passes"), [(1, True), (3, False)])
def test_an_uneven_count_may_be_padded_by_at_most_shards_minus_one_rows(repeats, passes):
    samples = 95  # 2 shards: DistributedSampler pads one repeated row
    parts = [list(range(0, samples, 2)), list(range(1, samples, 2)) + list(range(repeats))]
    values = [dict(rank(s, [parts[s]], parts[s]), samples=samples) for s in range(2)]
    found = data_sharding.data_failure({}, values, DP)
    if passes:
        assert found is None
    else:
        assert "3 rows received more than once" in found[1]


def test_the_refusal_of_the_default_build_is_recognised():
    text = ("ValueError: When using a multi-worker distribution with auto-sharding enabled, the data must be "
            "provided as a `tf.data.Dataset` or a `keras.utils.PyDataset` instance.")
    assert data_sharding.refused(text)
    assert not data_sharding.refused("ValueError: something else")


# -- evaluate's value: the loss over every row evaluated, on every rank ----------------------------

#: Each global row's loss (as the rank computes it in NumPy from its trained weights): row i's is i.
ROW_LOSSES = [float(i) for i in range(SAMPLES)]


def evaluated(values: list[dict], losses: list[float]) -> list[dict]:
    return [dict(v, evaluate_loss=loss, row_losses=ROW_LOSSES) for v, loss in zip(values, losses, strict=True)]


def test_every_rank_returning_the_loss_over_all_rows_passes():
    mean_of_all = sum(ROW_LOSSES) / SAMPLES  # 47.5: the two shards' rows together
    assert data_sharding.evaluate_failure(evaluated(good(), [mean_of_all] * 2), DP) is None


def test_a_rank_returning_its_own_shards_loss_is_numerics():
    """The metrics not reduced across processes: shard 0 (even rows) has loss 47, shard 1 has 48."""
    found = data_sharding.evaluate_failure(evaluated(good(), [47.0, 48.0]), DP)
    assert found is not None and found[0] == NUMERICS
    assert "rank 0 returned loss 47" in found[1] and "the loss over the 96 rows the 2 batch shard(s) evaluated is 47.5" \
        in found[1] and "rank 1 returned loss 48" in found[1]


def test_ranks_of_one_batch_coordinate_count_their_rows_once():
    """A (1, n) mesh: every rank evaluates all rows; the loss is over them once, not n times."""
    everything = list(range(SAMPLES))
    values = [rank(r, [everything, reshuffled(everything)], everything) for r in range(2)]
    coords = batch_coordinates(axes.LAYOUTS["colshard"], 2)
    assert data_sharding.evaluate_failure(evaluated(values, [47.5, 47.5]), coords) is None
    assert data_sharding.evaluate_failure(evaluated(values, [47.5, 95.0]), coords)[0] == NUMERICS


def test_a_padded_row_counts_as_often_as_it_was_evaluated():
    """An uneven count padded by DistributedSampler: the repeated row is in the loss twice."""
    padded = [list(range(0, SAMPLES, 2)) + [0], list(range(1, SAMPLES, 2)) + [2]]  # one pad row each
    values = [rank(s, [padded[s], padded[s]], padded[s]) for s in range(2)]
    want = (sum(ROW_LOSSES) + 0 + 2) / (SAMPLES + 2)  # 46.55, not 47.5
    assert data_sharding.evaluate_failure(evaluated(values, [want, want]), DP) is None
    assert data_sharding.evaluate_failure(evaluated(values, [47.5, 47.5]), DP)[0] == NUMERICS
