"""Rank side of the on-batch cells: ``train_on_batch``, ``test_on_batch``, ``predict_on_batch``,
``evaluate`` and ``predict`` called as a user's loop calls them, hand-fed.

Each process passes its LOCAL part of every global batch (``cell_data.local_rows``, with
``auto_shard_dataset = False``): the on-batch APIs take the batch as given, with no data adapter to
shard it (the JAX backend's ``distribute_data_input`` reads it as the per-process batch too). The
single-process reference (``distributed=False``) passes the global batch. A rank returns what its
user sees: the logs each call returned, the predictions, and the weights after the calls.

``APIS`` is the table: adding an API is one entry (how it is called, and what it returns).
"""

from __future__ import annotations

import numpy as np

from conformance.cell_data import BATCH, STEPS, local_part, local_rows, make_arrays
from conformance.ranks import train as rank_train

LEARNING_RATE = 0.05


def _logs(logs: dict) -> dict:
    return {k: float(np.asarray(v)) for k, v in logs.items()}


def _per_batch(call):
    """``call(model, x, y)`` on each of the ``STEPS`` local batches, in order: their results."""
    def on_each(model, x, y, local_batch):
        return [call(model, x[s * local_batch:(s + 1) * local_batch], y[s * local_batch:(s + 1) * local_batch])
                for s in range(STEPS)]
    return on_each


#: api -> (the evidence key of what it returns: ``calls``, the logs of each call; ``evaluate``, its
#: one dict; ``predict``, the predictions of the rows fed, in order), and how it is called on the
#: local arrays with the local batch size.
APIS = {
    "train_on_batch": ("calls", _per_batch(lambda m, x, y: _logs(m.train_on_batch(x, y, return_dict=True)))),
    "test_on_batch": ("calls", _per_batch(lambda m, x, y: _logs(m.test_on_batch(x, y, return_dict=True)))),
    "predict_on_batch": ("predict", lambda m, x, y, b: np.concatenate(
        _per_batch(lambda m, x, y: np.asarray(m.predict_on_batch(x)))(m, x, y, b))),
    "evaluate": ("evaluate", lambda m, x, y, b: _logs(m.evaluate(x, y, batch_size=b, verbose=0, return_dict=True))),
    "predict": ("predict", lambda m, x, y, b: np.asarray(m.predict(x, batch_size=b, verbose=0))),
}


def run(spec: dict, distributed: bool = True) -> dict:
    """Build and compile the MLP (SGD, MSE, an MAE metric) and call ``spec['api']`` on this
    process's part of the data; return what it gave.

    ``spec``: ``api`` (a key of ``APIS``), ``layout`` (an ``axes.LAYOUTS`` entry, or
    ``{"kind": "single"}``), ``compile`` (``nojit`` or ``jit``).
    """
    import keras

    layout = spec["layout"]
    if distributed and layout["kind"] != "single":
        keras.distribution.set_distribution(rank_train.make_distribution(layout))
    keras.utils.set_random_seed(0)
    model = rank_train.build_model("mlp")
    model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss="mse", metrics=["mae"],
                  jit_compile=spec.get("compile") == "jit" and distributed)
    part = rank_train._batch_part_here(layout, distributed)
    rows, local_batch = local_rows(*part), BATCH // part[1]
    x, y, _ = (local_part(a, rows) for a in make_arrays("mlp"))
    initial = [np.asarray(w) for w in model.get_weights()]
    key, call = APIS[spec["api"]]
    returned = call(model, x, y, local_batch)
    return {
        "api": spec["api"],
        key: returned,
        "rows": rows,
        "batch_part": list(part),
        "initial_weights": initial,
        "weights": rank_train.weights_by_path(model),
        "distribution": type(keras.distribution.distribution()).__name__,
    }
