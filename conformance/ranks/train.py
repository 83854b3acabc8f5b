"""Rank side of a training cell: build model, data and optimizer from the cell's spec, train,
evaluate and predict, and return the evidence (losses, weights, layouts, compile counters).

The same function runs the single-process reference (``distributed=False``: no distribution,
eager, in a clean process of its own) so the two sides differ only in the distribution.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
from keras_dtensor_conformance import rank_context

from conformance.cell_data import (
    BATCH,
    LORA_MODELS,
    DROPOUT,
    LORA_RANK,
    SAMPLES,
    SEQUENCE,
    TRANSFORMER_MODELS,
    STEPS,
    VOCAB,
    batch_axis,
    batch_part,
    local_part,
    local_rows,
    make_arrays,
    mesh_axes,
    policy,
)
from conformance.ranks.feeding import fit_inputs
from conformance.ranks.step_communication import measure_step_communication

#: What the other rank modules and the tests read from here. The cell's data, its feeding and the step's
#: communication are read where they live (``conformance.cell_data``, ``ranks/feeding.py``,
#: ``ranks/step_communication.py``).
__all__ = ["build_model", "build_optimizer", "describe_variable", "frozen_paths", "loss_for", "make_distribution",
           "model_name", "set_policy", "step_losses_callback", "train", "weights_by_path"]


def _device_type(variable) -> str:
    """Where a variable's values live (``cpu``, ``cuda``): a DTensor's local shard says it."""
    value = getattr(variable, "value", variable)
    return value.device.type


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


# ---------------------------------------------------------------- models and optimizers
def model_name(spec: dict) -> str:
    """The model a cell builds: its ``model``, or the two-input MLP its dict inputs need."""
    return "twoinput" if spec["data"] == "dict" else spec["model"]


def frozen_paths(model) -> list[str]:
    """The kernels LoRA froze and the variables of layers made untrainable: what training must leave
    exactly as it was."""
    lora = [layer._kernel.path for layer in model._flatten_layers() if getattr(layer, "lora_enabled", False)]
    frozen = [v.path for layer in model._flatten_layers(include_self=False) if not layer.trainable
              for v in layer.weights]
    return list(dict.fromkeys(lora + frozen))


def loss_for(name: str):
    """The loss a model trains with: next-token cross-entropy for the language models, else MSE."""
    import keras

    if name in TRANSFORMER_MODELS:
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return "mse"


def _transformer(name: str):
    """A causal language model's transformer block (``cell_data.TRANSFORMER_MODELS``)."""
    import keras

    rate = DROPOUT if name == "transformer-dropout" else 0.0

    class TokenAndPosition(keras.layers.Layer):
        """Token embeddings plus learned position embeddings (Keras' transformer examples' layer)."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.token = keras.layers.Embedding(VOCAB, 8, name="token_embedding")
            self.position = keras.layers.Embedding(SEQUENCE, 8, name="position_embedding")

        def call(self, tokens):
            return self.token(tokens) + self.position(keras.ops.arange(keras.ops.shape(tokens)[-1]))

    tokens = keras.Input((SEQUENCE,), dtype="int32")
    h = TokenAndPosition(name="embed")(tokens)
    a = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, dropout=rate, name="attention")(
        h, h, use_causal_mask=True)
    h = keras.layers.LayerNormalization(name="ln_attention")(h + keras.layers.Dropout(rate)(a))
    f = keras.layers.Dense(16, activation="relu", name="dense_ff1")(h)
    f = keras.layers.Dense(8, name="dense_ff2")(f)
    h = keras.layers.LayerNormalization(name="ln_ff")(h + keras.layers.Dropout(rate)(f))
    model = keras.Model(tokens, keras.layers.Dense(VOCAB, name="dense_logits")(h), name="lm")
    if name == "transformer-frozen-ln":
        for layer in ("ln_attention", "ln_ff"):
            model.get_layer(layer).trainable = False
    return model


def set_policy(spec: dict) -> None:
    """The cell's dtype policy (``cell_data.policy``) for the layers built next; the rank resets it
    to float32 after the cell (``fixtures/rank/isolation``)."""
    import keras

    keras.config.set_dtype_policy(policy(spec))


def step_losses_callback(losses: list[float]):
    """A Keras callback that appends the loss Keras logs at the end of each train step to ``losses``."""
    import keras

    class StepLosses(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            losses.append(float(logs["loss"]))

    return StepLosses()


def weights_by_path(model) -> dict:
    """Every weight's global value (``get_weights``), by its variable's path."""
    return {v.path: np.asarray(w) for v, w in zip(model.weights, model.get_weights(), strict=True)}


def build_model(name: str, outputs: int = 4):
    """The model ``name``; the MLP with ``outputs`` units in its last layer (the workflow cells' one-column
    output: a sharded dimension of size 1)."""
    import keras

    if name == "mlp":
        layers = [keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="dense_a"),
                  keras.layers.Dense(outputs, name="dense_b")]
        return keras.Sequential(layers, name="mlp")
    if name in LORA_MODELS:
        # The MLP fine-tuned with LoRA of rank 2 on both Dense layers: their kernels frozen, the LoRA
        # kernels (a: inputs x 2, he_uniform; b: 2 x units, zeros) trained; biases trained as well.
        model = build_model("mlp")
        for layer in ("dense_a", "dense_b"):
            model.get_layer(layer).enable_lora(LORA_RANK)
        return model
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
    if name in TRANSFORMER_MODELS:
        return _transformer(name)
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
def make_distribution(layout: dict, world_size: int | None = None, devices: list[str] | None = None):
    """A Keras distribution over explicit device names (cpu:i / gpu:i), never list_devices().

    By default over this rank's group; the JAX reference (``ranks/jax_reference.py``) passes the
    ranks' count and its virtual CPU devices, so both backends build the same distribution."""
    import keras

    if world_size is None:
        ctx = rank_context.current()
        world_size, devices = ctx.world_size, ctx.device_names()
    if layout["kind"] == "data-parallel":
        mesh = keras.distribution.DeviceMesh((world_size,), ["batch"], devices)
        distribution = keras.distribution.DataParallel(device_mesh=mesh)
    else:
        shape = tuple(world_size if d == "nproc" else d for d in layout.get("mesh", (1, "nproc")))
        mesh = keras.distribution.DeviceMesh(shape, list(mesh_axes(layout)), devices)
        layout_map = keras.distribution.LayoutMap(mesh)
        for key, axes in layout["map"].items():
            layout_map[key] = tuple(axes)
        distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name=batch_axis(layout))
    # Each rank feeds its own part of every global batch (see batch_part): the data is already
    # sharded across processes, which the Keras docs say to declare with auto_shard_dataset=False.
    distribution.auto_shard_dataset = False
    return distribution


# ---------------------------------------------------------------- the cell
def _describe_slots(model, describe=describe_variable) -> tuple[list[dict], list[str]]:
    """(slots, unmatched): optimizer variables (slots, EMA copies, accumulators, factored moments)
    with the model variable each one belongs to, and the paths of the optimizer variables that
    belong to none (the judge counts slots per variable and names these when a count is short).

    A full slot is found by Keras' slot naming, ``<variable path, "/" -> "_">_<slot>``, whatever
    its shape (the judge checks the shape). Adafactor's factored moments carry only the
    variable's bare name (``kernel``): a variable's ``r`` and ``c`` are the first unclaimed
    optimizer variables with that name and shape, in creation order (Keras creates them variable
    by variable), so two kernels whose vectors share a shape each get their own. ``describe`` says
    what a variable is (the JAX reference passes its own: its layouts are not DTensors).
    """
    from conformance.judge.slots import factored_shapes

    claimed: set[int] = set()
    slots = []
    optimizer_variables = list(model.optimizer.variables)

    def claim(var, ref, factor):
        claimed.add(id(var))
        slots.append({**describe(var), "reference": ref.path, "factor": factor})

    for var in optimizer_variables:
        # The longest prefix: "dense/kernel_2"'s slots also start with "dense_kernel_".
        refs = [v for v in model.trainable_variables if var.name.startswith(v.path.replace("/", "_") + "_")]
        if refs:
            claim(var, max(refs, key=lambda v: len(v.path)), None)
    for ref in model.trainable_variables:
        if len(ref.shape) < 2:
            continue
        for factor, shape in enumerate(factored_shapes(tuple(ref.shape))):
            var = next((v for v in optimizer_variables if id(v) not in claimed and v.name == ref.name
                        and tuple(v.shape) == shape), None)
            if var is not None:
                claim(var, ref, factor)
    return slots, [v.path for v in optimizer_variables if id(v) not in claimed]


def _compile_counters() -> dict:
    """A snapshot of torch._dynamo's own instrumentation, to diff around ``fit`` (``_compiled_during``):
    graphs compiled, graph breaks by reason, frames seen and compiled, graphs AOTAutograd made,
    and the per-frame compilation records (which code, how many ops, the graph break it
    restarted at, whether its compile failed)."""
    import sys

    if "torch._dynamo" not in sys.modules:
        return {"unique_graphs": 0, "frames_total": 0, "frames_ok": 0, "aot_graphs": 0, "breaks": {}, "records": []}
    from torch._dynamo.utils import counters, get_compilation_metrics

    return {"unique_graphs": int(counters["stats"]["unique_graphs"]),
            "frames_total": int(counters["frames"]["total"]),
            "frames_ok": int(counters["frames"]["ok"]),
            "aot_graphs": int(counters["aot_autograd"]["ok"]),
            "breaks": dict(counters["graph_break"]),
            "records": get_compilation_metrics()}


def _reason_head(reason: str) -> str:
    """A dynamo reason's first line and its explanation (the whole text runs to ten lines)."""
    lines = [line.strip() for line in str(reason).splitlines() if line.strip()]
    explanation = next((line for line in lines[1:] if line.startswith("Explanation:")), "")
    return " ".join([lines[0] if lines else "", explanation]).strip()


def _compiled_during(before: dict, after: dict) -> dict:
    """What dynamo did during ``fit``, as plain data for the judge (``conformance.judge.compile_evidence``):

    - ``compiled_graphs``: graphs compiled; ``aot_graphs``: graphs AOTAutograd compiled (or
      loaded from its cache) with their backward;
    - ``graph_breaks``: reason -> {"count", "frames"}: each break, with the frames
      (``co_name file:line``) that restarted at it;
    - ``failed_frames``: frames whose compile failed (dynamo ran them eagerly);
    - ``frames_not_compiled``: frames dynamo saw and left to run eagerly (e.g. generators);
    - ``compiled_frames``: ``co_name file:line (ops)`` of every frame compiled with a graph.

    Per-frame records come from ``torch._dynamo.utils.get_compilation_metrics()`` (a bounded
    deque, so the new ones are those not in the snapshot before, by identity).
    """
    seen = {id(record) for record in before["records"]}
    records = [r for r in after["records"] if id(r) not in seen]

    def where(record) -> str:
        path = (record.co_filename or "?").split("site-packages/")[-1]
        return f"{record.co_name} {path}:{record.co_firstlineno}"

    breaks = {}
    for reason, count in after["breaks"].items():
        if count > before["breaks"].get(reason, 0):
            frames = [where(r) for r in records if reason in (r.restart_reasons or ())]
            breaks[_reason_head(reason)] = {"count": count - before["breaks"].get(reason, 0),
                                            "frames": list(dict.fromkeys(frames))}
    return {
        "compiled_graphs": after["unique_graphs"] - before["unique_graphs"],
        "aot_graphs": after["aot_graphs"] - before["aot_graphs"],
        "graph_breaks": breaks,
        "failed_frames": [f"{where(r)}: {r.fail_type}: {_reason_head(r.fail_reason or '')}"
                          for r in records if r.fail_type],
        "frames_not_compiled": (after["frames_total"] - before["frames_total"])
        - (after["frames_ok"] - before["frames_ok"]),
        "compiled_frames": [f"{where(r)} ({r.graph_op_count} ops)" for r in records if r.graph_op_count],
    }


def _batch_part_here(layout: dict, distributed: bool) -> tuple[int, int]:
    """This process' ``batch_part``; the single-process reference feeds the global batch."""
    if not distributed:
        return 0, 1
    ctx = rank_context.current()
    return batch_part(layout, ctx.rank, ctx.world_size)


def train(spec: dict, distributed: bool = True) -> dict:
    """Train, evaluate and predict one cell; return its evidence as plain data."""
    import keras

    compile_mode = spec["compile"]
    if distributed and spec["layout"]["kind"] != "single":
        keras.distribution.set_distribution(make_distribution(spec["layout"]))
    keras.utils.set_random_seed(spec.get("seed", 0))
    set_policy(spec)
    name = model_name(spec)
    model = build_model(name)
    # Before fit, as numpy by path: the NumPy oracle (conformance/oracle.py) starts from them.
    initial_weights = weights_by_path(model)
    compile_kwargs = {"run_eagerly": compile_mode == "eager",
                      "jit_compile": compile_mode == "jit" and distributed,
                      "steps_per_execution": 4 if compile_mode == "spe4" else 1}
    model.compile(optimizer=build_optimizer(spec["optimizer"]), loss=loss_for(name), **compile_kwargs)
    part = _batch_part_here(spec["layout"], distributed)
    rows, local_batch = local_rows(*part), BATCH // part[1]
    x, y, w = (local_part(a, rows) for a in make_arrays(name, seed=spec.get("seed", 0)))
    args, kwargs = fit_inputs(spec["data"], x, y, w, local_batch)

    step_losses: list[float] = []
    stages = {"built": [describe_variable(v) for v in model.weights]}
    before = _compile_counters()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(*args, epochs=1, verbose=0, callbacks=[step_losses_callback(step_losses)], **kwargs)
    after = _compile_counters()
    stages["fit"] = [describe_variable(v) for v in model.weights]
    slots, unmatched = _describe_slots(model)
    eval_args, eval_kwargs = fit_inputs(spec["data"], x, y, w, local_batch)
    eval_kwargs.pop("shuffle", None)
    eval_kwargs.pop("steps_per_epoch", None)
    if spec["data"] == "generator":
        eval_kwargs["steps"] = STEPS
    evaluation = model.evaluate(*eval_args, verbose=0, **eval_kwargs)
    stages["evaluate"] = [describe_variable(v) for v in model.weights]
    prediction = model.predict(x, batch_size=local_batch, verbose=0)
    stages["predict"] = [describe_variable(v) for v in model.weights]
    evidence = {
        "step_losses": step_losses,
        "epoch_loss": [float(v) for v in history.history["loss"]],
        "evaluate": float(evaluation if np.isscalar(evaluation) else evaluation[0]),
        "predict": np.asarray(prediction),
        "rows": rows,
        "batch_part": list(part),
        "distribution": type(keras.distribution.distribution()).__name__,
        "unsynchronized_batch_norm": [layer.path for layer in model._flatten_layers()
                                      if isinstance(layer, keras.layers.BatchNormalization)
                                      and not layer.synchronized],
        "initial_weights": initial_weights,
        "frozen": frozen_paths(model),
        "device": _device_type(model.weights[0]),
        "weights": weights_by_path(model),
        "stages": stages,
        "slots": slots,
        "unmatched_optimizer_variables": unmatched,
        **_compiled_during(before, after),
        "warnings": [str(m.message) for m in caught if re.search("compile|jit", str(m.message), re.I)],
    }
    # Last: the extra step trains on, after every figure above is taken. Not in the single-process
    # reference: with no process group there is nothing to communicate, and nothing reads it there.
    if distributed:
        first = np.arange(local_batch)
        evidence["communication"] = measure_step_communication(model, local_part(x, first), y[first])
    return evidence

