"""The matrix's axes, as data: adding an optimizer, a data source or a layout is one entry here.

Test ids are the cell's coordinates joined by "-" (``test_fit[adam-dataloader-jit-colshard]``),
so an id in a report or an expectations file says exactly which cell it is.
"""

from __future__ import annotations

import itertools

# ------------------------------------------------------------------ optimizers
#: name -> keras.optimizers class and arguments. Variants put scalars and extra state into the
#: update (momentum, amsgrad maxima, EMA copies, accumulators, schedules), where mixed
#: Tensor/DTensor errors have lived.
OPTIMIZERS = {
    "sgd": {"class": "SGD", "kwargs": {"learning_rate": 0.05}},
    "sgd-momentum": {"class": "SGD", "kwargs": {"learning_rate": 0.05, "momentum": 0.9}},
    "sgd-nesterov": {"class": "SGD", "kwargs": {"learning_rate": 0.05, "momentum": 0.9, "nesterov": True}},
    "sgd-weightdecay": {"class": "SGD", "kwargs": {"learning_rate": 0.05, "weight_decay": 0.01}},
    "sgd-schedule": {"class": "SGD", "schedule": "exponential-decay"},
    "adam": {"class": "Adam", "kwargs": {"learning_rate": 0.01}},
    "adam-amsgrad": {"class": "Adam", "kwargs": {"learning_rate": 0.01, "amsgrad": True}},
    "adam-clipnorm": {"class": "Adam", "kwargs": {"learning_rate": 0.01, "clipnorm": 0.1}},
    "adam-clipvalue": {"class": "Adam", "kwargs": {"learning_rate": 0.01, "clipvalue": 0.01}},
    "adam-globalclipnorm": {"class": "Adam", "kwargs": {"learning_rate": 0.01, "global_clipnorm": 0.1}},
    "adam-ema": {"class": "Adam", "kwargs": {"learning_rate": 0.01, "use_ema": True, "ema_momentum": 0.9}},
    "adam-accum": {"class": "Adam", "kwargs": {"learning_rate": 0.01, "gradient_accumulation_steps": 2}},
    "adamw": {"class": "AdamW", "kwargs": {"learning_rate": 0.01}},
    "adagrad": {"class": "Adagrad", "kwargs": {"learning_rate": 0.05}},
    "adadelta": {"class": "Adadelta", "kwargs": {"learning_rate": 1.0}},
    "adamax": {"class": "Adamax", "kwargs": {"learning_rate": 0.01}},
    "nadam": {"class": "Nadam", "kwargs": {"learning_rate": 0.01}},
    "rmsprop": {"class": "RMSprop", "kwargs": {"learning_rate": 0.01}},
    "rmsprop-centered": {"class": "RMSprop", "kwargs": {"learning_rate": 0.01, "centered": True}},
    "lion": {"class": "Lion", "kwargs": {"learning_rate": 0.001}},
    "ftrl": {"class": "Ftrl", "kwargs": {"learning_rate": 0.05}},
    "adafactor": {"class": "Adafactor", "kwargs": {"learning_rate": 0.01}},
    "lamb": {"class": "Lamb", "kwargs": {"learning_rate": 0.01}},
    "muon": {"class": "Muon", "kwargs": {"learning_rate": 0.01}},
    "schedulefreeadamw": {"class": "ScheduleFreeAdamW", "kwargs": {"learning_rate": 0.01}},
    "lossscale": {"class": "SGD", "kwargs": {"learning_rate": 0.05}, "loss_scale": True},
}

# ------------------------------------------------------------------ data sources
#: name -> the Python package it needs beyond torch and Keras (None: none).
DATA_SOURCES = {
    "arrays": None,
    "tensors": None,
    "dataloader": None,
    "iterable": None,
    "dataloader-workers": None,
    "pydataset": None,
    "pydataset-workers": None,
    "generator": None,
    "dict": None,
    "sample-weights": None,
    "tfdata": "tensorflow",
    "grain": "grain",
}

# ------------------------------------------------------------------ compile modes
COMPILE_MODES = {
    "eager": "run_eagerly=True",
    "nojit": "jit_compile=False",
    "jit": "jit_compile=True (must really compile: torch._dynamo counters are checked)",
    "spe4": "steps_per_execution=4",
}

# ------------------------------------------------------------------ layouts
_COLUMN = {
    ".*dense.*kernel": [None, "model"],
    ".*embeddings": [None, "model"],
    ".*attention.*(query|key|value).*kernel": [None, "model", None],
}
_ROW = {
    ".*dense.*kernel": ["model", None],
    ".*embeddings": ["model", None],
    ".*attention.*(query|key|value).*kernel": ["model", None, None],
}
#: name -> distribution. LayoutMap keys are regexes matched with re.fullmatch, hence ".*".
LAYOUTS = {
    "colshard": {"kind": "model-parallel", "map": _COLUMN},
    "rowshard": {"kind": "model-parallel", "map": _ROW},
    "replicated": {"kind": "model-parallel", "map": {}},
    "batchxmodel": {"kind": "model-parallel", "map": _COLUMN, "mesh": [2, 2]},
    # Every rank on the batch axis: input batches are DTensors sharded over a mesh axis > 1.
    "batchshard": {"kind": "model-parallel", "map": _COLUMN, "mesh": ["nproc", 1]},
    "dataparallel": {"kind": "data-parallel"},
}

MODELS = ("mlp", "embedding", "attention", "batchnorm")


def cell_spec(model: str, optimizer: str, data: str, compile_mode: str, layout: str) -> dict:
    return {
        "model": model,
        "optimizer": OPTIMIZERS[optimizer],
        "optimizer_name": optimizer,
        "data": data,
        "compile": compile_mode,
        "layout": LAYOUTS[layout],
        "layout_name": layout,
    }


def cell_id(model: str, optimizer: str, data: str, compile_mode: str, layout: str) -> str:
    """``adam-dataloader-jit-colshard``; the model is named only when it is not the MLP."""
    parts = [optimizer, data, compile_mode, layout]
    return "-".join(parts if model == "mlp" else [model, *parts])


def _product(models, optimizers, data, compile_modes, layouts):
    return list(itertools.product(models, optimizers, data, compile_modes, layouts))


def training_cells(full: bool) -> list[tuple]:
    """(model, optimizer, data, compile, layout) coordinates of the tier, without duplicates.

    Default tier: full products where bugs have lived, and a covering design for the rest:
      - every optimizer x every compile mode x {arrays, DataLoader}, MLP, column-sharded;
      - every data source x {eager, nojit, jit}, Adam, MLP, column-sharded;
      - every model x every layout, Adam, arrays, nojit; and every layout x compile mode, MLP.
    ``--full`` adds every optimizer x data source, and models x optimizers x compile modes.
    """
    cells = _product(["mlp"], OPTIMIZERS, ["arrays", "dataloader"], COMPILE_MODES, ["colshard"])
    cells += _product(["mlp"], ["adam"], DATA_SOURCES, ["eager", "nojit", "jit"], ["colshard"])
    cells += _product(MODELS, ["adam"], ["arrays"], ["nojit"], LAYOUTS)
    cells += _product(["mlp"], ["sgd", "adam"], ["arrays", "dataloader"], COMPILE_MODES, LAYOUTS)
    if full:
        cells += _product(["mlp"], OPTIMIZERS, DATA_SOURCES, ["nojit", "jit"], ["colshard"])
        cells += _product(MODELS, OPTIMIZERS, ["arrays", "dataloader"], COMPILE_MODES, ["colshard", "rowshard"])
        cells += _product(MODELS, ["adam"], DATA_SOURCES, COMPILE_MODES, LAYOUTS)
    return list(dict.fromkeys(cells))
