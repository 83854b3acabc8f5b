"""Rank functions that produce each failing verdict from a real cause, for tests/test_verdicts.py."""

from __future__ import annotations

import numpy as np
from keras_dtensor_conformance.rank import context as rank_context


def _model_parallel_dtensor():
    import keras
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    ctx = rank_context.current()
    mesh = keras.distribution.DeviceMesh((ctx.world_size,), ["model"], ctx.device_names())
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name="model")
    )
    x = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    return distribute_tensor(x, mesh.backend_mesh, [Shard(1)])


def subtract_without_promotion(compiled: bool):
    """The seed-era bug: a plain tensor meets a DTensor with the promotion mode off."""
    import keras
    import torch
    from keras.src.backend.torch import distribution_lib

    dtensor = _model_parallel_dtensor()
    distribution_lib.deactivate_dtensor_promotion()

    def step(w):
        return keras.ops.subtract(w, torch.ones(4, 4))

    run = torch.compile(step, backend="aot_eager") if compiled else step
    return np.asarray(keras.ops.convert_to_numpy(run(dtensor))).tolist()


def searchsorted_on_dtensor():
    """aten.searchsorted has no DTensor sharding strategy (torch 2.13)."""
    import keras

    dtensor = _model_parallel_dtensor()
    return keras.ops.convert_to_numpy(keras.ops.searchsorted(dtensor[0], dtensor[1])).tolist()
