"""Rank-side training cells: build a model under a distribution, fit it, report what happened.

These functions run on every rank of the pool (never in the pytest process) and return
plain data: losses, and for each variable its type, placements and local/global shapes.
The pytest side decides the verdict from that, so a cell's evidence is in its result.
"""

from __future__ import annotations

import numpy as np

from keras_dtensor_conformance import rank_context

#: The layouts a cell can ask for, as LayoutMap entries. Keys are matched with
#: re.fullmatch against paths such as "sequential/dense_1/kernel", hence the leading ".*".
LAYOUTS = {
    "colshard": {".*dense.*kernel": (None, "model")},
    "rowshard": {".*dense.*kernel": ("model", None)},
    "replicated": {},
}


def _model_parallel(entries: dict):
    import keras

    ctx = rank_context.current()
    mesh = keras.distribution.DeviceMesh((1, ctx.world_size), ["batch", "model"], ctx.device_names())
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, axes in entries.items():
        layout_map[key] = tuple(axes)
    distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    # Every rank feeds the whole (identical) batch; Keras must not shard arrays per process.
    distribution.auto_shard_dataset = False
    return distribution


def describe_variable(variable) -> dict:
    """What a variable really is on this rank: DTensor or not, placements, local and global shape."""
    from torch.distributed.tensor import DTensor

    value = getattr(variable, "value", variable)
    info = {"path": variable.path, "type": type(value).__name__, "shape": tuple(variable.shape)}
    data = getattr(value, "data", value)
    if isinstance(data, DTensor):
        info["placements"] = [str(p) for p in data.placements]
        info["local_shape"] = tuple(data.to_local().shape)
        info["dtensor"] = True
    else:
        info["dtensor"] = False
    return info


def fit_mlp(layout: str, steps: int = 4, batch: int = 8) -> dict:
    """A two-layer Dense MLP trained with SGD under ModelParallel with one of ``LAYOUTS``."""
    return fit_mlp_with_layout_map(LAYOUTS[layout], steps, batch)


def fit_mlp_with_layout_map(entries: dict, steps: int = 4, batch: int = 8) -> dict:
    """The same MLP under a LayoutMap given as ``{regex: axes}``."""
    import keras

    keras.distribution.set_distribution(_model_parallel(entries))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="dense_a"), keras.layers.Dense(4, name="dense_b")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((steps * batch, 8)).astype("float32")
    y = rng.standard_normal((steps * batch, 4)).astype("float32")
    history = model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    return {
        "loss": [float(v) for v in history.history["loss"]],
        "variables": [describe_variable(v) for v in model.trainable_variables],
        "weights_shapes": [tuple(w.shape) for w in model.get_weights()],
    }
