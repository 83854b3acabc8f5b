"""Rank side of the agreement cells: metrics compiled as a user would, and callbacks that decide.

Each rank feeds its LOCAL part of every global batch, training and validation data alike
(``cell_data.batch_part``, hand-fed: ``auto_shard_dataset = False``); the single-process
reference (``distributed=False``) feeds the global batch, eager. A rank returns what a user sees:
``History``, the ``logs`` each epoch's callbacks get, and ``evaluate(return_dict=True)``; a
callback cell also returns every decision its callback took, epoch by epoch.

A rank whose callback decides alone (stops while its peers go on) leaves them waiting in the next
epoch's collectives: its peers hang, and their return values never come back. So every epoch's
decision is also printed, as one line (``DECISION_PREFIX`` + JSON), in ``on_epoch_end`` before
the next epoch's first collective: each rank's stdout comes back in its story even after a hang,
and the judge (``conformance.judge.agreement``) reads the decisions from there.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from keras_dtensor_conformance import rank_context

from conformance.judge.agreement import DECISION_PREFIX
from conformance import cell_data
from conformance.ranks import train as rank_train

#: The offset added to the targets of the validation rows that the first half of every global
#: batch holds (rank 0's part under DataParallel and a 2x1 mesh): that part's validation loss is
#: about 10, the other part's about 1, the global one about 5.5. A callback's threshold between
#: the local values (``THRESHOLD``) then decides one way on the global value, which every rank
#: must see, and opposite ways on the per-rank values a build that does not reduce its metrics
#: reports: the decisions of its ranks part, which is what the callback cells must catch.
VALIDATION_OFFSET = 3.0
THRESHOLD = 3.0
#: More than the validation loss moves in an epoch at ``LEARNING_RATE`` (measured: < 0.2), so
#: improvements are decided by the threshold, not by training noise.
MIN_DELTA = 1.0
LEARNING_RATE = 0.01
CLASSES = 4

#: metric name -> (task, how it is compiled). ``max`` keeps a running maximum: a state that is
#: not additive, so summing it over ranks is wrong (keras-team/keras#23316's review).
METRICS = {
    "mae": ("regression", "metrics"),
    "accuracy": ("classification", "metrics"),
    # SparseTopKCategoricalAccuracy(k=2) over logits sharded on the model axis (issue 54): a top-k taken
    # over each rank's local columns finds other classes than one over all of them.
    "top2": ("classification", "metrics"),
    "weighted-mae": ("regression", "weighted_metrics"),
    "max": ("regression", "metrics"),
}
#: callback name -> epochs to run (enough for the callback to take a decision).
CALLBACKS = {"earlystopping": 3, "reducelronplateau": 2, "modelcheckpoint": 2}


def max_abs_error_class():
    """A user's custom metric: the largest absolute error seen since the last reset."""
    import keras

    class MaxAbsError(keras.metrics.Metric):
        def __init__(self, name="max_abs_error", **kwargs):
            super().__init__(name=name, **kwargs)
            self.maximum = self.add_variable(shape=(), initializer="zeros", name="maximum")

        def update_state(self, y_true, y_pred, sample_weight=None):
            error = keras.ops.max(keras.ops.abs(keras.ops.cast(y_true, y_pred.dtype) - y_pred))
            self.maximum.assign(keras.ops.maximum(self.maximum, error))

        def result(self):
            # A new tensor, as Keras' own metrics return: the variable itself would change under
            # History when evaluate() resets it (single-process logs then show the validation max).
            return keras.ops.add(self.maximum, 0.0)

    return MaxAbsError


def compiled_metrics(metric: str) -> dict:
    """``model.compile``'s metric arguments for the cell's metric."""
    if metric == "mae":
        return {"metrics": ["mae"]}
    if metric == "accuracy":
        return {"metrics": ["accuracy"]}
    if metric == "top2":
        import keras

        return {"metrics": [keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2")]}
    if metric == "weighted-mae":
        return {"weighted_metrics": ["mae"]}
    if metric == "max":
        return {"metrics": [max_abs_error_class()()]}
    raise ValueError(f"unknown metric {metric!r}")


def build_model(task: str):
    """An MLP; for classification its ``dense_b`` gives the logits, column-sharded under colshard."""
    import keras

    out = CLASSES if task == "classification" else 4
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="dense_a"),
                             keras.layers.Dense(out, name="dense_b")], name="agree")


def global_data(task: str) -> dict:
    """The global training and validation data, identical on every rank and in the reference."""
    x, y, w = cell_data.make_arrays("mlp")
    xv, yv, _ = cell_data.make_arrays("mlp", seed=1)
    first_half = (np.arange(len(yv)) % cell_data.BATCH) < cell_data.BATCH // 2
    yv = yv + VALIDATION_OFFSET * first_half[:, None].astype("float32")
    if task == "classification":
        y, yv = np.argmax(y, axis=1).astype("int32"), np.argmax(yv, axis=1).astype("int32")
    return {"x": x, "y": y, "w": w, "xv": xv, "yv": yv}


def make_callback(name: str, checkpoint_path: str | None):
    import keras

    if name == "earlystopping":
        # The first epoch's val_loss beats THRESHOLD or not; no later epoch improves by MIN_DELTA.
        # patience=2: a process that beat the threshold waits one epoch more than one that did not.
        return keras.callbacks.EarlyStopping(monitor="val_loss", baseline=THRESHOLD, patience=2,
                                             min_delta=MIN_DELTA)
    if name == "reducelronplateau":
        return keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1,
                                                 min_delta=MIN_DELTA)
    if name == "modelcheckpoint":
        # Every rank is given the same path, as a user's script would.
        return keras.callbacks.ModelCheckpoint(checkpoint_path, monitor="val_loss", save_best_only=True)
    raise ValueError(f"unknown callback {name!r}")


def _float(value) -> float:
    return float(np.asarray(value))


def _learning_rate(model) -> float:
    import keras

    return _float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))


def _file_state(path: str | None):
    if not path or not os.path.exists(path):
        return None
    stat = os.stat(path)
    return [stat.st_size, stat.st_mtime_ns]


def run(spec: dict, distributed: bool = True) -> dict:
    """Fit (with validation data) and evaluate one agreement cell; return what its user saw.

    ``spec``: ``layout`` (an ``axes.LAYOUTS`` entry, or ``{"kind": "single"}``), ``metric`` (a key
    of ``METRICS``) or ``callback`` (a key of ``CALLBACKS``), ``compile`` (``nojit`` or ``jit``),
    ``checkpoint`` (the path ``ModelCheckpoint`` writes, the same on every rank).
    """
    import keras

    layout = spec["layout"]
    if distributed and layout["kind"] != "single":
        keras.distribution.set_distribution(rank_train.make_distribution(layout))
    keras.utils.set_random_seed(0)
    metric, callback_name = spec.get("metric"), spec.get("callback")
    task = METRICS[metric][0] if metric else "regression"
    model = build_model(task)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True) if task == "classification" else "mse"
    compile_mode = spec.get("compile", "nojit")
    model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss=loss,
                  jit_compile=compile_mode == "jit" and distributed,
                  **(compiled_metrics(metric) if metric else {}))

    part = rank_train._batch_part_here(layout, distributed)
    rows, local_batch = cell_data.local_rows(*part), cell_data.BATCH // part[1]
    data = {k: v[rows] for k, v in global_data(task).items()}
    weighted = metric == "weighted-mae"
    fit_kwargs = {"sample_weight": data["w"]} if weighted else {}
    epochs = CALLBACKS[callback_name] if callback_name else 2

    user_callbacks = [make_callback(callback_name, spec.get("checkpoint"))] if callback_name else []
    epoch_logs: list[dict] = []
    decisions: list[dict] = []
    rank = rank_context.current().rank if distributed else None

    class Recorder(keras.callbacks.Callback):
        """Last in the list: sees each epoch's logs after the user's callback decided on them."""

        def __init__(self):
            super().__init__()
            self.best = None

        def on_epoch_end(self, epoch, logs=None):
            logs = {k: _float(v) for k, v in (logs or {}).items()}
            epoch_logs.append(logs)
            decision = {"epoch": epoch, "rank": rank, "stop_training": bool(self.model.stop_training),
                        "learning_rate": _learning_rate(self.model), "logs": logs}
            if callback_name == "modelcheckpoint":
                best = user_callbacks[0].best
                best = None if best is None or not np.isfinite(best) else _float(best)
                decision["wrote_checkpoint"] = best is not None and best != self.best
                decision["best"], self.best = best, best
                decision["file"] = _file_state(spec.get("checkpoint"))
            decisions.append(decision)
            # Before the next epoch's first collective: evidence even when a peer then hangs.
            print(DECISION_PREFIX + json.dumps(decision), flush=True)
            sys.stdout.flush()

    history = model.fit(data["x"], data["y"], batch_size=local_batch, epochs=epochs, shuffle=False, verbose=0,
                        validation_data=(data["xv"], data["yv"]), validation_batch_size=local_batch,
                        callbacks=[*user_callbacks, Recorder()], **fit_kwargs)
    result = {
        "history": {k: [_float(v) for v in values] for k, values in history.history.items()},
        "epoch_logs": epoch_logs,
        "decisions": decisions,
        "epochs_run": len(epoch_logs),
        "batch_part": list(part),
        "distribution": type(keras.distribution.distribution()).__name__,
    }
    if callback_name:
        # No evaluate: a rank whose peers stopped at another epoch must not enter a collective
        # they never join (it would pair with whatever they run next).
        if callback_name == "earlystopping":
            result["stopped_epoch"] = int(user_callbacks[0].stopped_epoch)
        result["checkpoint_exists"] = bool(spec.get("checkpoint")) and os.path.exists(spec["checkpoint"])
        return result
    evaluation = model.evaluate(data["x"], data["y"], batch_size=local_batch, verbose=0, return_dict=True,
                                **fit_kwargs)
    result["evaluate"] = {k: _float(v) for k, v in evaluation.items()}
    return result
