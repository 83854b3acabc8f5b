"""ModelParallel fit of a Dense MLP, one cell per kernel layout.

Each cell checks on every rank: fit ran; the ranks agree on the loss; every kernel the
layout shards is a DTensor with the intended placements and local shape; get_weights()
returns global shapes.
"""

from __future__ import annotations

import pytest

from conformance import rank_fit
from conformance.sharding import sharding_problems
from keras_dtensor_conformance.outcomes import RankFailure


@pytest.mark.parametrize("layout", sorted(rank_fit.LAYOUTS))
def test_fit_mlp(keras_ranks, layout):
    result = keras_ranks.run(rank_fit.fit_mlp, layout)
    if not result.ok:
        raise RankFailure(result)
    values = result.values
    losses = [v["loss"] for v in values]
    assert all(loss == losses[0] for loss in losses), f"ranks disagree on the loss: {losses}"
    for rank, value in enumerate(values):
        problems = sharding_problems(layout, value["variables"], keras_ranks.nproc)
        assert not problems, f"rank {rank}: sharding lost:\n" + "\n".join(problems)
        assert value["weights_shapes"] == [tuple(v["shape"]) for v in value["variables"]]
