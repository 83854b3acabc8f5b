"""A real ModelParallel fit on the default build (keras-nightly): kernels sharded as asked."""

from __future__ import annotations

from conformance import axes
from conformance.judge.sharding import sharding_problems
from conformance.ranks import train as rank_train

COLSHARD = axes.LAYOUTS["colshard"]


def test_model_parallel_fit_shards_kernels_as_asked(keras_ranks):
    spec = axes.cell_spec("mlp", "sgd", "arrays", "nojit", "colshard")
    result = keras_ranks.run(rank_train.train, spec)
    assert result.ok, result.story()
    n = keras_ranks.nproc
    for rank, value in enumerate(result.values):
        fitted = value["stages"]["fit"]
        kernel = next(v for v in fitted if v["path"].endswith("dense_a/kernel"))
        assert kernel["dtensor"], kernel
        assert kernel["placements"] == ["R", "S(1)"]
        # torch.chunk's rule: ceil(16 / n) columns per rank until they run out (6, 6, 4 over 3).
        assert kernel["local_shape"] == (8, max(0, min(-(-16 // n), 16 - rank * -(-16 // n))))
        assert sharding_problems(COLSHARD, fitted, n, rank=rank) == []


def test_sharding_check_notices_a_layout_that_matched_nothing(keras_ranks):
    """The LayoutMap pitfall: "dense.*kernel" (no leading ".*") silently shards nothing."""
    spec = axes.cell_spec("mlp", "sgd", "arrays", "nojit", "colshard")
    spec["layout"] = {"kind": "model-parallel", "map": {"dense.*kernel": [None, "model"]}}
    result = keras_ranks.run(rank_train.train, spec)
    assert result.ok, result.story()
    problems = sharding_problems(COLSHARD, result.values[0]["stages"]["fit"], keras_ranks.nproc)
    assert len(problems) == 2 and all("a plain Parameter" in p for p in problems), problems
