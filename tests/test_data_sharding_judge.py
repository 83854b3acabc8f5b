"""The Keras-sharded cells' judge on hand-made evidence: no ranks, no Keras.

Good evidence (each batch shard a distinct part of every epoch, together the whole, ranks of one
model axis alike, epoch 2 reshuffled, predict returning each fed row once) passes; each way a
build can break the contract gets ``data-not-sharded`` with a message naming it.
"""

from __future__ import annotations

import pytest
from keras_dtensor_conformance.verdicts import DATA_NOT_SHARDED

from conformance import axes
from conformance.judge import batch_coordinates, data_sharding

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
