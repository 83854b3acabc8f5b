"""A real ModelParallel fit on the default build (keras-nightly): kernels sharded as asked."""

from __future__ import annotations

from conformance import rank_fit
from conformance.sharding import sharding_problems


def test_model_parallel_fit_shards_kernels_as_asked(keras_ranks):
    result = keras_ranks.run(rank_fit.fit_mlp, "colshard")
    assert result.ok, result.story()
    n = keras_ranks.nproc
    for value in result.values:
        kernel = next(v for v in value["variables"] if v["path"].endswith("dense_a/kernel"))
        assert kernel["dtensor"], kernel
        assert kernel["placements"] == ["R", "S(1)"]
        assert kernel["local_shape"] == (8, 16 // n)
        assert sharding_problems("colshard", value["variables"], n) == []


def test_sharding_check_notices_a_layout_that_matched_nothing(keras_ranks):
    """The LayoutMap pitfall: "dense.*kernel" (no leading ".*") silently shards nothing."""
    result = keras_ranks.run(rank_fit.fit_mlp_with_layout_map, {"dense.*kernel": [None, "model"]})
    assert result.ok, result.story()
    problems = sharding_problems("colshard", result.values[0]["variables"], keras_ranks.nproc)
    assert len(problems) == 2 and all("a plain Parameter" in p for p in problems), problems
