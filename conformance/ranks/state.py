"""Rank side of the state cells: what Keras itself must do with variables between processes.

``reconcile``: each rank seeds differently (as unseeded user code effectively does) before it
builds the model under the distribution, and reports every variable's local values, global view
and placements after build and after training; the single-process reference trains from the
weights the ranks agreed on, set into it (``start``), so random streams never matter.

``checkpoint``: one save side and one resume side of a checkpoint (``KINDS``): fit the first
``SAVED_STEPS`` steps, save (``model.save``, ``ModelCheckpoint`` or ``BackupAndRestore``, every
rank given the same path), load into a FRESH model under the resume side's distribution and train
the remaining steps; and, for comparison, the same training uninterrupted. The save and resume
sides run in the same call, or in two pools (the ranks and the single-process pool) for a
checkpoint that crosses the process count.
"""

from __future__ import annotations

import contextlib
import os
import sys

import numpy as np
from keras_dtensor_conformance import rank_context

from conformance import axes
from conformance import cell_data
from conformance.ranks import train as rank_train

#: Steps trained before the checkpoint; the rest of ``cell_data.STEPS`` after it.
SAVED_STEPS = 2
LEARNING_RATE = 0.01


def _rank() -> int:
    return rank_context.current().rank


def _barrier(distributed: bool) -> None:
    """Every rank's save has returned before any rank reads the file."""
    import torch.distributed as dist

    if distributed and dist.is_initialized():
        dist.barrier()


def _distribute(layout: dict, distributed: bool) -> None:
    import keras

    if distributed and layout["kind"] != "single":
        keras.distribution.set_distribution(rank_train.make_distribution(layout))
    else:
        keras.distribution.set_distribution(None)


def _local(variable) -> np.ndarray:
    """This rank's own values of ``variable``: a DTensor's local shard, or the whole plain tensor."""
    value = getattr(variable, "value", variable)
    data = getattr(value, "data", value)
    data = data.to_local() if hasattr(data, "to_local") else data
    return data.detach().cpu().numpy().copy()


def _initializer(layer, variable) -> str | None:
    """The class of the initializer ``layer`` built ``variable`` with (None: not known)."""
    for attr in ("kernel_initializer", "bias_initializer"):
        init = getattr(layer, attr, None)
        if init is not None and variable.name == attr.split("_")[0]:
            return type(init).__name__
    return None


def snapshot(model) -> list[dict]:
    """Every variable on this rank: what it is (``describe_variable``), its local values, its
    global view (``get_weights``) and its initializer's class."""
    owners = {id(v): layer for layer in model._flatten_layers() for v in layer._trainable_variables
              + layer._non_trainable_variables}
    out = []
    for variable, weight in zip(model.weights, model.get_weights(), strict=True):
        out.append({**rank_train.describe_variable(variable), "local": _local(variable),
                    "global": np.asarray(weight), "initializer": _initializer(owners.get(id(variable)), variable)})
    return out


def _data(distributed: bool, layout: dict, steps: slice) -> tuple[np.ndarray, np.ndarray, int]:
    """(x, y, local batch): this process' part of the global batches ``steps``."""
    part = rank_train._batch_part_here(layout, distributed)
    local_batch = cell_data.BATCH // part[1]
    rows = cell_data.local_rows(*part)[steps.start * local_batch:steps.stop * local_batch]
    x, y, _ = cell_data.make_arrays("mlp")
    return x[rows], y[rows], local_batch


def _fit(model, distributed: bool, layout: dict, steps: slice, epochs: int = 1, callbacks=()) -> list[float]:
    """Fit on ``steps`` of the global batches; the loss each step reported."""
    import keras

    losses: list[float] = []

    class StepLosses(keras.callbacks.Callback):
        """Each step's own loss: Keras logs the running mean over the epoch's steps so far, so
        step ``b`` (0-based) of an epoch is ``(b + 1) * mean_b - b * mean_(b-1)``."""

        def __init__(self):
            super().__init__()
            self.mean = 0.0

        def on_train_batch_end(self, batch, logs=None):
            mean = float(logs["loss"])
            losses.append((batch + 1) * mean - batch * (self.mean if batch else 0.0))
            self.mean = mean

    x, y, local_batch = _data(distributed, layout, steps)
    model.fit(x, y, batch_size=local_batch, shuffle=False, epochs=epochs, verbose=0,
              callbacks=[*callbacks, StepLosses()])
    return losses


def _compiled_model(seed: int = 0):
    import keras

    keras.utils.set_random_seed(seed)
    model = rank_train.build_model("mlp")
    model.compile(optimizer=keras.optimizers.Adam(LEARNING_RATE), loss="mse")
    return model


# ---------------------------------------------------------------- reconcile
def reconcile(spec: dict, distributed: bool = True, start: dict | None = None) -> dict:
    """Build the MLP under the distribution with a seed of this rank's own, then train it.

    ``start`` (the single-process reference): path -> the global weights the ranks agreed on,
    set into the model before training."""
    import keras

    _distribute(spec["layout"], distributed)
    keras.utils.set_random_seed(1000 + _rank() if distributed else 0)
    model = rank_train.build_model("mlp")
    if start is not None:
        model.set_weights([start[v.path] for v in model.weights])
    stages = {"built": snapshot(model)}
    model.compile(optimizer=keras.optimizers.Adam(LEARNING_RATE), loss="mse")
    losses = _fit(model, distributed, spec["layout"], slice(0, cell_data.STEPS))
    stages["fit"] = snapshot(model)
    return {"stages": stages, "step_losses": losses,
            "batch_part": list(rank_train._batch_part_here(spec["layout"], distributed))}


# ---------------------------------------------------------------- checkpoints
#: kind -> (how the checkpoint is written; the layout the resume side loads under: None for the
#: save side's, ``"single"`` for the single-process pool; where the save side runs: ``ranks`` or
#: ``single``; whether every rank is given the same path, as a user gives a callback one).
#: The one table of checkpoint kinds; ``test_state.py`` parametrizes over it.
KINDS = {
    "optimizer-roundtrip": ("save", None, "ranks", False),
    "reshard-to-rowshard": ("save", "rowshard", "ranks", False),
    "reshard-to-dataparallel": ("save", "dataparallel", "ranks", False),
    "reshard-to-single-process": ("save", "single", "ranks", False),
    "from-single-process": ("save", None, "single", False),
    "modelcheckpoint": ("modelcheckpoint", None, "ranks", True),
    "backupandrestore": ("backupandrestore", None, "ranks", True),
}


def optimizer_state(model) -> dict:
    """Every optimizer variable's global value by path (``iterations`` included)."""
    import keras

    return {v.path: np.asarray(keras.ops.convert_to_numpy(v.value)) for v in model.optimizer.variables}


def _uninterrupted(layout: dict, distributed: bool, steps: slice, epochs: int) -> dict:
    """The same training in one fit, no checkpoint: what a resumed run must equal."""
    _distribute(layout, distributed)
    model = _compiled_model()
    losses = _fit(model, distributed, layout, steps, epochs=epochs)
    return {"weights": rank_train.weights_by_path(model), "step_losses": losses, "optimizer": optimizer_state(model)}


#: Paths this process opens for writing while ``recording_writes`` is on (None: off).
_WRITES: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    """An audit hook (``sys.addaudithook``): every ``open`` for writing, by path. It reads the list
    through ``sys.modules``: a hook outlives a reimport of this module, which the list does not."""
    if event != "open":
        return
    writes = getattr(sys.modules.get(__name__), "_WRITES", None)
    if writes is None or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    path, mode, flags = args
    writing = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & (os.O_WRONLY | os.O_RDWR))
    if writing:
        writes.append(os.path.abspath(os.fsdecode(path)))


@contextlib.contextmanager
def recording_writes():
    """The files this process opens for writing inside the block (Python's ``open`` audit event:
    Keras writes a ``.keras`` archive and BackupAndRestore's metadata with ``open``)."""
    global _WRITES
    if not getattr(sys, "_keras_dtensor_conformance_audit", False):
        sys.addaudithook(_audit)  # once per process: an audit hook cannot be removed
        sys._keras_dtensor_conformance_audit = True
    _WRITES = writes = []
    try:
        yield writes
    finally:
        _WRITES = None


def checkpoint_path(spec: dict, distributed: bool) -> str:
    """Where this process writes: ``spec['path']`` on every rank for the checkpoints users give
    one path (``KINDS``' ``shared``), else a file of its own (``model-rank1.keras``): the only
    race-free way to save from every rank, which saving a sharded model needs (it gathers)."""
    if KINDS[spec["kind"]][3] or not distributed:
        return spec["path"]
    root, ext = os.path.splitext(spec["path"])
    return f"{root}-rank{_rank()}{ext}"


class Interrupted(Exception):
    """Raised by ``_Interrupt`` on every rank: the fit a BackupAndRestore must resume."""


def _interrupt_callback():
    import keras

    class Interrupt(keras.callbacks.Callback):
        """Stops the fit at the start of the second epoch, on every rank (Keras' own
        BackupAndRestore tests interrupt so)."""

        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                raise Interrupted(f"interrupted at epoch {epoch}")

    return Interrupt()


def save_side(spec: dict, distributed: bool = True) -> dict:
    """Train ``SAVED_STEPS`` steps and write the checkpoint (``checkpoint_path``); also train
    uninterrupted for comparison. Returns both, the optimizer state at the save, and the files
    this process opened for writing while it checkpointed (``wrote``)."""
    import keras

    how = KINDS[spec["kind"]][0]
    layout = spec["layout"]
    path = checkpoint_path(spec, distributed)
    if how == "backupandrestore":
        # Two epochs over the first SAVED_STEPS batches, interrupted after the first: the backup
        # holds epoch 1's state. Uninterrupted: the same two epochs in one fit.
        evidence = {"uninterrupted": _uninterrupted(layout, distributed, slice(0, SAVED_STEPS), 2)}
        _distribute(layout, distributed)
        model = _compiled_model()
        with recording_writes() as writes:
            try:
                _fit(model, distributed, layout, slice(0, SAVED_STEPS), epochs=2,
                     callbacks=[keras.callbacks.BackupAndRestore(path), _interrupt_callback()])
            except Interrupted:
                pass  # the interruption this cell makes itself; every rank raises it at the same epoch
    else:
        evidence = {"uninterrupted": _uninterrupted(layout, distributed, slice(0, cell_data.STEPS), 1)}
        _distribute(layout, distributed)
        model = _compiled_model()
        callbacks = [keras.callbacks.ModelCheckpoint(path)] if how == "modelcheckpoint" else []
        with recording_writes() as writes:
            _fit(model, distributed, layout, slice(0, SAVED_STEPS), callbacks=callbacks)
            if how == "save":
                model.save(path)
    evidence["saved_optimizer"] = optimizer_state(model)
    evidence["wrote"] = sorted(set(writes))
    _barrier(distributed)
    return evidence


def resume_side(spec: dict, distributed: bool = True) -> dict:
    """Load the checkpoint into a fresh model under ``spec['resume_layout']`` and train on: the
    loaded weights and optimizer state, the loaded variables' and slots' placements, and the
    numbers after the remaining steps. A process with no checkpoint of its own loads the one the
    single-process pool wrote, or rank 0's (the single-process pool resuming the ranks')."""
    import keras

    layout = spec["resume_layout"]
    path = checkpoint_path(spec, distributed)
    if not os.path.exists(path) and not os.path.exists(spec["path"]):
        root, ext = os.path.splitext(spec["path"])
        path = f"{root}-rank0{ext}"
    elif not os.path.exists(path):
        path = spec["path"]  # written by the single-process pool
    _distribute(layout, distributed)
    if KINDS[spec["kind"]][0] == "backupandrestore":
        model = _compiled_model(seed=7)  # fresh: other weights than the backup's
        loaded: dict = {}

        class Loaded(keras.callbacks.Callback):
            """After BackupAndRestore's on_train_begin restored the backup, before any step."""

            def on_train_begin(self, logs=None):
                loaded.update(variables=[rank_train.describe_variable(v) for v in model.weights],
                              optimizer=optimizer_state(model), slots=rank_train._describe_slots(model)[0])

        losses = _fit(model, distributed, layout, slice(0, SAVED_STEPS), epochs=2,
                      callbacks=[keras.callbacks.BackupAndRestore(path), Loaded()])
    else:
        model = keras.saving.load_model(path)
        loaded = {"variables": [rank_train.describe_variable(v) for v in model.weights],
                  "optimizer": optimizer_state(model), "slots": rank_train._describe_slots(model)[0]}
        losses = _fit(model, distributed, layout, slice(SAVED_STEPS, cell_data.STEPS))
    return {"loaded": loaded, "step_losses": losses, "weights": rank_train.weights_by_path(model),
            "variables": [rank_train.describe_variable(v) for v in model.weights],
            "batch_part": list(rank_train._batch_part_here(layout, distributed))}


def checkpoint(spec: dict, distributed: bool = True) -> dict:
    """Both sides in one call (the checkpoints that stay on the ranks). No rank resumes from a file
    that more than one rank wrote into: concurrent writers may leave it corrupt, so that the ranks
    would fail at random places (one raising at load, its peers waiting for it in the next
    collective); the judge fails the cell on the writers instead (``judge.state.writer_problems``)."""
    import torch.distributed as dist

    saved = save_side(spec, distributed)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, saved["wrote"])
    counts: dict[str, int] = {}
    for wrote in everyone:
        for path in wrote:
            counts[path] = counts.get(path, 0) + 1
    if any(n > 1 for n in counts.values()):
        return {"save": saved, "resume": None}
    return {"save": saved, "resume": resume_side(spec, distributed)}


def layout_of(name: str) -> dict:
    return {"kind": "single"} if name == "single" else axes.LAYOUTS[name]
