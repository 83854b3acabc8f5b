"""Rank side of the workflow cells: the flows Keras users run between and around fits.

Every training cell builds a fresh model under the distribution, compiles it once and fits it
once. Users fine-tune between fits (Keras' transfer-learning guide: freeze, fit, unfreeze,
recompile with a low learning rate, fit), enable LoRA after a fit, recompile, change the batch
size, build or load a model before the distribution is set, and fit one model object under two
distributions. A build can pass every training cell and train these wrongly: a gradient hook or
a wrapper made at the first fit and never remade when the trainable set changes, a loaded
weight that is not laid out, a layout kept from the first distribution.

``FLOWS`` is the table: a flow is one entry (its function, the fits whose layouts are judged, and
whether it starts with no process group). A flow function drives a ``Run`` (build, compile, fit: each fit one *phase* of
evidence). The same function runs the single-process reference (``distributed=False``: no
distribution, not compiled) on the global batches, so the two differ only in the distribution.
Each process feeds its own part of every global batch (``cell_data.batch_part``, hand-fed as
the training cells are), of the fit's own batch size: a flow that changes the batch size feeds
the new one's parts, a last partial batch included.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from collections.abc import Callable

import numpy as np
from keras_dtensor_conformance import rank_context

from conformance.cell_data import BATCH, LORA_RANK, SAMPLES, batch_part, make_arrays, shard_size
from conformance.ranks.train import (
    _compile_counters,
    _compiled_during,
    _device_type,
    build_model,
    describe_variable,
    make_distribution,
    step_losses_callback,
    weights_by_path,
)

#: The flows' learning rates: the guide's fine-tuning phase trains with a lower one.
LEARNING_RATE = 0.01
FINE_TUNE_RATE = 0.001
#: The second fit of ``fit-new-batch-size``: 96 samples are four batches of 20 and a last one of 16,
#: each divisible by 1, 2 and 4 batch shards.
NEW_BATCH = 20
#: ``batch-not-divisible``'s global batch: 25 rows, which 2 or 4 batch shards do not divide.
INDIVISIBLE_BATCH = 25
#: The MLP's outputs (``ranks/train.build_model``); ``one-unit-output`` builds it with one.
OUTPUTS = 4
#: The seed of a "pretrained" model's weights (a fresh model is built from seed 0): a load that does
#: nothing leaves seed-0 weights, which train to other numbers than the reference's.
PRETRAINED_SEED = 1


class Skip(Exception):
    """The flow cannot run as asked on this process count (the cell skips with the reason)."""


def fit_rows(index: int, count: int, batch: int, uneven: bool = False) -> np.ndarray:
    """Global rows that batch shard ``index`` of ``count`` feeds, in order, for global batches of
    ``batch`` rows over the ``SAMPLES`` rows (the last batch partial): its ``1/count`` of each; with
    ``uneven``, its part by torch's chunking rule (25 rows over 2 shards: 13 and 12)."""
    rows = []
    for start in range(0, SAMPLES, batch):
        size = min(batch, SAMPLES - start)
        if not uneven and size % count:
            raise Skip(f"a global batch of {size} rows does not split into {count} equal batch shards")
        chunk = -(-size // count)
        low = min(size, index * chunk)
        rows.append(np.arange(start + low, start + low + shard_size(size, count, index)))
    return np.concatenate(rows)


@dataclasses.dataclass
class Run:
    """One flow on this process: what it builds, compiles and fits, and each fit's evidence.

    ``layout`` is the cell's (``{"kind": "single"}`` in the reference), ``compile`` its compile mode
    (``eager``: run_eagerly; ``jit``: jit_compile, on the ranks only)."""

    layout: dict
    compile_mode: str
    distributed: bool
    phases: list = dataclasses.field(default_factory=list)
    initial: dict = dataclasses.field(default_factory=dict)
    device: str = ""
    units: int = OUTPUTS
    #: Started as torchrun starts a user's script (``controller/bare_group.py``): no rank context, and
    #: the distribution over the devices ``keras.distribution.list_devices()`` names.
    bare: bool = False
    #: What ``keras.distribution.initialize()`` left, where a flow called it (``initialize_then_fit``).
    group: dict = dataclasses.field(default_factory=dict)

    # ---------------------------------------------------------------- set-up
    def distribute(self, layout: dict | None = None) -> dict:
        """Set the distribution of ``layout`` (the cell's by default); none in the reference."""
        import keras

        layout = self.layout if layout is None else layout
        if not self.distributed or layout["kind"] == "single":
            keras.distribution.set_distribution(None)
        elif self.bare:
            keras.distribution.set_distribution(
                make_distribution(layout, self._rank_and_world()[1], keras.distribution.list_devices()))
        else:
            keras.distribution.set_distribution(make_distribution(layout))
        return layout

    def build(self, seed: int = 0, units: int = OUTPUTS):
        """The MLP from ``seed`` (``ranks/train.build_model``), with ``units`` outputs; fits then
        train it on that many columns of the targets."""
        import keras

        keras.utils.set_random_seed(seed)
        self.units = units
        return build_model("mlp", outputs=units)

    @staticmethod
    def enable_lora(model) -> None:
        for name in ("dense_a", "dense_b"):
            model.get_layer(name).enable_lora(LORA_RANK)

    def compile(self, model, optimizer: str = "adam", learning_rate: float = LEARNING_RATE, loss: str = "mse"):
        import keras

        classes = {"adam": keras.optimizers.Adam, "sgd": keras.optimizers.SGD}
        model.compile(optimizer=classes[optimizer](learning_rate), loss=loss,
                      run_eagerly=self.compile_mode == "eager",
                      jit_compile=self.compile_mode == "jit" and self.distributed)

    def remember_initial(self, model) -> None:
        """The weights the flow's first fit starts from (the reference's must be the same)."""
        self.initial = weights_by_path(model)
        self.device = _device_type(model.weights[0])

    # ---------------------------------------------------------------- a fit
    def fit(self, model, name: str, batch: int = BATCH, layout: dict | None = None, uneven: bool = False) -> None:
        """``model.fit`` on this process' part of the global batches of ``batch`` rows under the
        distribution of ``layout`` (the cell's), parts of unequal sizes where ``uneven``; one phase
        of evidence: each step's reported loss, the variables frozen in it (their values before),
        every weight and variable after."""
        layout = self.layout if layout is None else layout
        if not self.initial:
            self.remember_initial(model)
        index, count = batch_part(layout, *self._rank_and_world()) if self.distributed else (0, 1)
        rows = fit_rows(index, count, batch, uneven)
        x, y, _ = make_arrays("mlp")
        y = y[:, :self.units]
        trainable = {v.path for v in model.trainable_weights}
        frozen = {path: w for path, w in weights_by_path(model).items() if path not in trainable}
        losses: list[float] = []
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The model does not have any trainable weights")
            model.fit(x[rows], y[rows], batch_size=shard_size(batch, count, index), shuffle=False, epochs=1,
                      verbose=0, callbacks=[step_losses_callback(losses)])
        self.phases.append({"name": name, "batch": batch, "layout": layout, "batch_part": [index, count],
                            "step_losses": losses, "frozen": frozen, "weights": weights_by_path(model),
                            "variables": [describe_variable(v) for v in model.weights]})

    def _rank_and_world(self) -> tuple[int, int]:
        if self.bare:  # torchrun's variables, as a user's script reads them
            return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        ctx = rank_context.current()
        return ctx.rank, ctx.world_size


def _own_file(spec: dict, name: str, run: Run) -> str:
    """A file of this process' own in the cell's folder (no two processes write one file)."""
    who = f"rank{run._rank_and_world()[0]}" if run.distributed else "single"
    return os.path.join(spec["folder"], f"{who}-{name}")


# ---------------------------------------------------------------- the flows
def freeze_fit_unfreeze_fit(run: Run, spec: dict) -> None:
    """Keras' transfer-learning guide: the base (the first layer) frozen, fit the head; unfreeze,
    recompile with a lower learning rate, fit everything."""
    run.distribute()
    model = run.build()
    model.get_layer("dense_a").trainable = False
    run.compile(model)
    run.fit(model, "head only")
    model.get_layer("dense_a").trainable = True
    run.compile(model, learning_rate=FINE_TUNE_RATE)
    run.fit(model, "fine-tuned")


def fit_freeze_fit(run: Run, spec: dict) -> None:
    """Fit everything, then freeze the first layer, recompile, fit the rest."""
    run.distribute()
    model = run.build()
    run.compile(model)
    run.fit(model, "all trained")
    model.get_layer("dense_a").trainable = False
    run.compile(model)
    run.fit(model, "first layer frozen")


def fit_lora_fit(run: Run, spec: dict) -> None:
    """Fit, then ``enable_lora`` on both layers (their kernels frozen, new LoRA kernels made under
    the distribution), recompile, fit."""
    run.distribute()
    model = run.build()
    run.compile(model)
    run.fit(model, "before LoRA")
    run.enable_lora(model)
    run.compile(model)
    run.fit(model, "LoRA")


def fit_recompile_fit(run: Run, spec: dict) -> None:
    """Fit with SGD and MSE, recompile with Adam and MAE (a new optimizer, its slots made anew), fit."""
    run.distribute()
    model = run.build()
    run.compile(model, optimizer="sgd", learning_rate=0.05)
    run.fit(model, "sgd mse")
    run.compile(model, optimizer="adam", loss="mae")
    run.fit(model, "adam mae")


def model_untrainable_fit(run: Run, spec: dict) -> None:
    """``model.trainable = False``: a fit that must change nothing; then True, recompile, fit."""
    run.distribute()
    model = run.build()
    model.trainable = False
    run.compile(model)
    run.fit(model, "untrainable")
    model.trainable = True
    run.compile(model)
    run.fit(model, "trainable")


def fit_new_batch_size(run: Run, spec: dict) -> None:
    """Fit on batches of ``BATCH``, then again (no recompile) on batches of ``NEW_BATCH``, the last partial."""
    run.distribute()
    model = run.build()
    run.compile(model)
    run.fit(model, f"batch {BATCH}")
    run.fit(model, f"batch {NEW_BATCH}", batch=NEW_BATCH)


def built_before_distribution(run: Run, spec: dict) -> None:
    """The model built and called with no distribution set; then the distribution set, compile, fit."""
    run.distribute({"kind": "single"})
    model = run.build()
    model(make_arrays("mlp")[0][:2])
    run.distribute()
    run.compile(model)
    run.fit(model, "fit under the distribution")


def _pretrained(spec: dict, run: Run, suffix: str) -> str:
    """A "pretrained" model saved by this process with no distribution (weights from
    ``PRETRAINED_SEED``, compiled with Adam, never fitted): its ``.keras`` or ``.weights.h5``."""
    run.distribute({"kind": "single"})
    model = run.build(seed=PRETRAINED_SEED)
    run.compile(model)
    path = _own_file(spec, f"pretrained{suffix}", run)
    if suffix == ".keras":
        model.save(path)
    else:
        model.save_weights(path)
    return path


def load_keras_fit(run: Run, spec: dict) -> None:
    """A ``.keras`` saved by one process without a distribution, loaded under the distribution
    (``keras.saving.load_model``, its compile config with it), then fit."""
    import keras

    path = _pretrained(spec, run, ".keras")
    run.distribute()
    model = keras.saving.load_model(path)
    run.fit(model, "loaded, fit")


def load_weights_fit(run: Run, spec: dict) -> None:
    """A model built under the distribution, ``load_weights`` of a single-process ``.weights.h5``, compile, fit."""
    path = _pretrained(spec, run, ".weights.h5")
    run.distribute()
    model = run.build()
    model.load_weights(path)
    run.compile(model)
    run.fit(model, "weights loaded, fit")


def fit_other_distribution_fit(run: Run, spec: dict) -> None:
    """One model object fitted under the cell's distribution, then (recompiled) under another
    (``spec['second_layout']``: DataParallel after a ModelParallel layout, column-sharded kernels
    after DataParallel; none in the reference)."""
    run.distribute()
    model = run.build()
    run.compile(model)
    run.fit(model, "first distribution")
    other = run.distribute(spec["second_layout"] if run.distributed else {"kind": "single"})
    run.compile(model)
    run.fit(model, "second distribution", layout=other)


def batch_not_divisible(run: Run, spec: dict) -> None:
    """A global batch the batch shards do not divide (25 rows: 13 and 12 on 2 processes, the last
    batch 21: 11 and 10): the one process's numbers, or a clear error; never rows lost silently."""
    run.distribute()
    model = run.build()
    run.compile(model)
    run.fit(model, f"batch {INDIVISIBLE_BATCH}", batch=INDIVISIBLE_BATCH, uneven=True)


def one_unit_output(run: Run, spec: dict) -> None:
    """The MLP with one output: its kernel's column-sharded dimension has one column for 2 or more
    ranks (local shapes 1, 0, ...), its bias is whole."""
    run.distribute()
    model = run.build(units=1)
    run.compile(model)
    run.fit(model, "one output")


def remat_fit(run: Run, spec: dict) -> None:
    """The model built under ``keras.RematScope(mode="full")``: every layer recomputes its
    activations in the backward pass instead of keeping them."""
    import keras

    if not hasattr(keras, "RematScope"):
        raise Skip("keras.RematScope does not exist in this build")
    run.distribute()
    with keras.RematScope(mode="full"):
        model = run.build()
        run.compile(model)
        run.fit(model, "rematerialised")


def initialize_then_fit(run: Run, spec: dict) -> None:
    """A user's script under torchrun: no process group until ``keras.distribution.initialize()``
    makes it from torchrun's variables; then a distribution over ``list_devices()``, build, fit."""
    import keras

    if run.distributed:
        import torch.distributed as dist

        before = dist.is_initialized()
        keras.distribution.initialize()
        after = dist.is_initialized()
        run.group = {"before": before, "after": after, "rank": dist.get_rank() if after else None,
                     "world_size": dist.get_world_size() if after else None,
                     "environment": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")},
                     "devices": list(keras.distribution.list_devices())}
    run.distribute()
    model = run.build()
    run.compile(model)
    run.fit(model, "after initialize()")


@dataclasses.dataclass(frozen=True)
class Flow:
    """One row of the workflow axis."""

    run: Callable[[Run, dict], None]
    #: The phases (fits, by index) whose variables are held to the layout the fit ran under (None:
    #: every one). Keras lays a variable out when it is created (``keras.distribution``'s docs: set
    #: the distribution before the model is created): a model built before the distribution, or one
    #: fitted under a second distribution, has no layout asked of it there; its numbers are judged.
    layout_phases: tuple | None = None
    #: Run by processes started as torchrun starts a script, with no group (``controller/bare_group.py``).
    bare: bool = False


#: flow -> its entry: the one place to add a flow (``test_workflows.py`` parametrizes over it).
FLOWS = {
    "freeze-fit-unfreeze-fit": Flow(freeze_fit_unfreeze_fit),
    "fit-freeze-fit": Flow(fit_freeze_fit),
    "fit-lora-fit": Flow(fit_lora_fit),
    "fit-recompile-fit": Flow(fit_recompile_fit),
    "model-untrainable-fit": Flow(model_untrainable_fit),
    "fit-new-batch-size": Flow(fit_new_batch_size),
    "built-before-distribution": Flow(built_before_distribution, layout_phases=()),
    "load-keras-fit": Flow(load_keras_fit),
    "load-weights-fit": Flow(load_weights_fit),
    "fit-other-distribution-fit": Flow(fit_other_distribution_fit, layout_phases=(0,)),
    "batch-not-divisible": Flow(batch_not_divisible),
    "one-unit-output": Flow(one_unit_output),
    "remat-fit": Flow(remat_fit),
    "initialize-from-torchrun": Flow(initialize_then_fit, bare=True),
}


def run_flow(spec: dict, distributed: bool = True) -> dict:
    """Run ``spec['flow']`` on this process; its evidence: the initial weights, each fit's phase,
    and what dynamo compiled over the whole flow (a ``jit`` cell is judged by it)."""
    flow = FLOWS[spec["flow"]]
    run = Run(spec["layout"], spec["compile"], distributed, bare=flow.bare and distributed)
    before = _compile_counters()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            flow.run(run, spec)
        except Skip as why:
            return {"skip": str(why)}
    after = _compile_counters()
    return {"flow": spec["flow"], "initial_weights": run.initial, "phases": run.phases, "group": run.group,
            "device": run.device,
            **_compiled_during(before, after),
            "warnings": [str(m.message) for m in caught if re.search("compile|jit", str(m.message), re.I)]}
