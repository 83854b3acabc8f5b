"""Rank side of a training cell: build model, data and optimizer from the cell's spec, train,
evaluate and predict, and return the evidence (losses, weights, layouts, compile counters).

The same function runs the single-process reference (``distributed=False``: no distribution,
eager, in a clean process of its own) so the two sides differ only in the distribution.
"""

from __future__ import annotations

import importlib.util
import re
import warnings

import numpy as np

from keras_dtensor_conformance import rank_context

STEPS = 4
BATCH = 8
SAMPLES = STEPS * BATCH
VOCAB = 20


def describe_variable(variable) -> dict:
    """What a variable really is on this rank: DTensor or not, placements, local and global shape."""
    from torch.distributed.tensor import DTensor

    value = getattr(variable, "value", variable)
    data = getattr(value, "data", value)
    info = {"path": variable.path, "type": type(value).__name__, "shape": tuple(variable.shape)}
    info["dtensor"] = isinstance(data, DTensor)
    if info["dtensor"]:
        info["placements"] = [str(p) for p in data.placements]
        info["local_shape"] = tuple(data.to_local().shape)
    return info


# ---------------------------------------------------------------- data (same on every rank)
def make_arrays(model: str, seed: int = 0) -> tuple[dict | np.ndarray, np.ndarray, np.ndarray]:
    """(x, y, sample_weight) for ``model``; identical on every rank and in the reference."""
    rng = np.random.default_rng(seed)
    y = rng.standard_normal((SAMPLES, 4)).astype("float32")
    weights = rng.uniform(0.5, 1.5, (SAMPLES,)).astype("float32")
    if model == "embedding":
        x = rng.integers(0, VOCAB, (SAMPLES, 6)).astype("int32")
    elif model == "attention":
        x = rng.standard_normal((SAMPLES, 6, 8)).astype("float32")
    elif model == "twoinput":
        x = {"a": rng.standard_normal((SAMPLES, 4)).astype("float32"),
             "b": rng.standard_normal((SAMPLES, 4)).astype("float32")}
    else:
        x = rng.standard_normal((SAMPLES, 8)).astype("float32")
    return x, y, weights


def _batches(x, y, w=None):
    for i in range(STEPS):
        s = slice(i * BATCH, (i + 1) * BATCH)
        xb = {k: v[s] for k, v in x.items()} if isinstance(x, dict) else x[s]
        yield (xb, y[s]) if w is None else (xb, y[s], w[s])


def fit_inputs(source: str, x, y, w) -> tuple[tuple, dict]:
    """(args, kwargs) for model.fit / evaluate that feed the data through ``source``.

    Every source yields the same batches in the same order (no shuffling), so losses and
    weights are comparable to the reference step by step.
    """
    import torch

    if source in ("arrays", "dict"):
        return (x, y), {"batch_size": BATCH, "shuffle": False}
    if source == "sample-weights":
        return (x, y), {"batch_size": BATCH, "shuffle": False, "sample_weight": w}
    if source == "tensors":
        return (torch.from_numpy(x), torch.from_numpy(y)), {"batch_size": BATCH, "shuffle": False}
    if source.startswith("dataloader"):
        from torch.utils.data import DataLoader, TensorDataset

        workers = 2 if source.endswith("workers") else 0
        loader = DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=BATCH,
                            shuffle=False, num_workers=workers)
        return (loader,), {}
    if source == "iterable":
        from torch.utils.data import DataLoader, IterableDataset

        class Samples(IterableDataset):
            def __iter__(self):
                for i in range(SAMPLES):
                    yield torch.from_numpy(x[i]), torch.from_numpy(y[i])

        return (DataLoader(Samples(), batch_size=BATCH),), {}
    if source.startswith("pydataset"):
        import keras

        class Batches(keras.utils.PyDataset):
            def __len__(self):
                return STEPS

            def __getitem__(self, i):
                return x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]

        workers = 2 if source.endswith("workers") else 1
        return (Batches(workers=workers, use_multiprocessing=False),), {}
    if source == "generator":
        return (_batches(x, y),), {"steps_per_epoch": STEPS}
    if source == "tfdata":
        import tensorflow as tf

        return (tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH),), {}
    if source == "grain":
        import grain

        ds = grain.MapDataset.source(list(zip(x, y, strict=True))).batch(BATCH)
        return (ds,), {}
    raise ValueError(f"unknown data source {source!r}")


# ---------------------------------------------------------------- models and optimizers
def build_model(name: str):
    import keras

    if name == "mlp":
        layers = [keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="dense_a"),
                  keras.layers.Dense(4, name="dense_b")]
        return keras.Sequential(layers, name="mlp")
    if name == "batchnorm":
        # No bias before BatchNormalization (it cancels it): a bias whose true gradient is zero
        # would make Adam amplify rounding noise into full steps, and the numerics check with it.
        layers = [keras.Input((8,)), keras.layers.Dense(16, use_bias=False, name="dense_a"),
                  keras.layers.BatchNormalization(),
                  keras.layers.Activation("relu"), keras.layers.Dense(4, name="dense_b")]
        return keras.Sequential(layers, name="bn")
    if name == "embedding":
        layers = [keras.Input((6,), dtype="int32"), keras.layers.Embedding(VOCAB, 8, name="embedding"),
                  keras.layers.Flatten(), keras.layers.Dense(4, name="dense_b")]
        return keras.Sequential(layers, name="emb")
    if name == "attention":
        inputs = keras.Input((6, 8))
        # use_bias=False: softmax ignores the key bias, so its true gradient is zero (see batchnorm).
        h = keras.layers.MultiHeadAttention(num_heads=4, key_dim=2, use_bias=False, name="attention")(inputs, inputs)
        h = keras.layers.LayerNormalization()(h + inputs)
        h = keras.layers.GlobalAveragePooling1D()(h)
        return keras.Model(inputs, keras.layers.Dense(4, name="dense_b")(h), name="attn")
    if name == "twoinput":
        a, b = keras.Input((4,), name="a"), keras.Input((4,), name="b")
        h = keras.layers.Dense(16, activation="relu", name="dense_a")(keras.layers.Concatenate()([a, b]))
        return keras.Model({"a": a, "b": b}, keras.layers.Dense(4, name="dense_b")(h), name="two")
    raise ValueError(f"unknown model {name!r}")


class NotInBuild(Exception):
    """The build under test does not have what the cell needs: the cell is skipped, not failed."""


def build_optimizer(spec: dict):
    import keras

    if not hasattr(keras.optimizers, spec["class"]):
        raise NotInBuild(f"keras.optimizers.{spec['class']} does not exist in this build")
    kwargs = dict(spec.get("kwargs", {}))
    if "schedule" in spec:
        kwargs["learning_rate"] = keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=2, decay_rate=0.5)
    optimizer = getattr(keras.optimizers, spec["class"])(**kwargs)
    if spec.get("loss_scale"):
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer


# ---------------------------------------------------------------- distributions
def make_distribution(layout: dict):
    """A Keras distribution over explicit device names (cpu:i / gpu:i), never list_devices()."""
    import keras

    ctx = rank_context.current()
    devices = ctx.device_names()
    if layout["kind"] == "data-parallel":
        mesh = keras.distribution.DeviceMesh((ctx.world_size,), ["batch"], devices)
        distribution = keras.distribution.DataParallel(device_mesh=mesh)
    else:
        shape = tuple(ctx.world_size if d == "nproc" else d for d in layout.get("mesh", (1, "nproc")))
        mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"], devices)
        layout_map = keras.distribution.LayoutMap(mesh)
        for key, axes in layout["map"].items():
            layout_map[key] = tuple(axes)
        distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    # Every rank feeds the same whole batches; Keras must not shard arrays per process.
    distribution.auto_shard_dataset = False
    return distribution


# ---------------------------------------------------------------- the cell
def _describe_slots(model) -> list[dict]:
    """Optimizer variables (slots, EMA copies) with the model variable each one shadows."""
    by_prefix = {v.path.replace("/", "_") + "_": v for v in model.trainable_variables}
    slots = []
    for var in model.optimizer.variables:
        ref = next((v for p, v in by_prefix.items() if var.name.startswith(p)), None)
        if ref is None or tuple(ref.shape) != tuple(var.shape):
            continue
        info = describe_variable(var)
        info["reference"] = ref.path
        slots.append(info)
    return slots


def _compile_counters() -> dict:
    import sys

    if "torch._dynamo" not in sys.modules:
        return {"unique_graphs": 0, "frames_ok": 0}
    from torch._dynamo.utils import counters

    return {"unique_graphs": int(counters["stats"]["unique_graphs"]),
            "frames_ok": int(counters["frames"]["ok"])}


def train(spec: dict, distributed: bool = True) -> dict:
    """Train, evaluate and predict one cell; return its evidence as plain data."""
    import keras

    compile_mode = spec["compile"]
    if distributed and spec["layout"]["kind"] != "single":
        keras.distribution.set_distribution(make_distribution(spec["layout"]))
    keras.utils.set_random_seed(0)
    model_name = "twoinput" if spec["data"] == "dict" else spec["model"]
    model = build_model(model_name)
    compile_kwargs = {"run_eagerly": compile_mode == "eager",
                      "jit_compile": compile_mode == "jit" and distributed,
                      "steps_per_execution": 4 if compile_mode == "spe4" else 1}
    model.compile(optimizer=build_optimizer(spec["optimizer"]), loss="mse", **compile_kwargs)
    x, y, w = make_arrays(model_name)
    args, kwargs = fit_inputs(spec["data"], x, y, w)

    step_losses: list[float] = []

    class StepLosses(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step_losses.append(float(logs["loss"]))

    stages = {"built": [describe_variable(v) for v in model.weights]}
    before = _compile_counters()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(*args, epochs=1, verbose=0, callbacks=[StepLosses()], **kwargs)
    after = _compile_counters()
    stages["fit"] = [describe_variable(v) for v in model.weights]
    slots = _describe_slots(model)
    eval_args, eval_kwargs = fit_inputs(spec["data"], x, y, w)
    eval_kwargs.pop("shuffle", None)
    eval_kwargs.pop("steps_per_epoch", None)
    if spec["data"] == "generator":
        eval_kwargs["steps"] = STEPS
    evaluation = model.evaluate(*eval_args, verbose=0, **eval_kwargs)
    stages["evaluate"] = [describe_variable(v) for v in model.weights]
    prediction = model.predict(x, batch_size=BATCH, verbose=0)
    stages["predict"] = [describe_variable(v) for v in model.weights]
    return {
        "step_losses": step_losses,
        "epoch_loss": [float(v) for v in history.history["loss"]],
        "evaluate": float(evaluation if np.isscalar(evaluation) else evaluation[0]),
        "predict": np.asarray(prediction),
        "weights": {v.path: np.asarray(w) for v, w in zip(model.weights, model.get_weights(), strict=True)},
        "stages": stages,
        "slots": slots,
        "compiled_graphs": after["unique_graphs"] - before["unique_graphs"],
        "warnings": [str(m.message) for m in caught if re.search("compile|jit", str(m.message), re.I)],
    }


def package_available(name: str) -> bool:
    return importlib.util.find_spec(name) is not None
