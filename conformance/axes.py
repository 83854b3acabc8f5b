"""The matrix's axes, as data: adding an optimizer, a data source or a layout is one entry here.

Test ids are the cell's coordinates joined by "-" (``test_fit[adam-dataloader-jit-colshard]``),
so an id in a report or an expectations file says exactly which cell it is.
"""

from __future__ import annotations

import dataclasses
import itertools

from conformance import cell_data


# ------------------------------------------------------------------ optimizers
@dataclasses.dataclass(frozen=True)
class Slots:
    """The optimizer state Keras keeps for one trainable variable, which ``judge/slots.py`` counts
    (how the counts were found, and why they are counted, is said there)."""

    full: int  #: slots shaped like the variable (momentum, velocity, EMA copy, accumulator)
    #: factored second moments (Adafactor's ``r`` and ``c``): only for variables of rank >= 2
    factored: int = 0
    #: Muon: one more full slot (a velocity) for each variable it hands to AdamW (``slots.muon_uses_adamw``)
    adamw_velocity: int = 0


#: What ``ranks/train.build_optimizer`` can put in place of a constant learning rate.
SCHEDULES = ("exponential-decay",)


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """One row of the optimizer axis: everything the suite needs to know about it, in one place.

    The cell's spec (``spec``) is what the ranks build; ``slots`` is what the slot check holds
    every sharded variable to; ``oracle`` names the NumPy oracle's rule that judges its cells
    (``judge/oracle.RULES``; None where no rule models it, and the oracle refuses, at import, an
    entry that a rule models but that names none, so a new entry cannot drop out of its core set
    unnoticed); ``benchmark`` puts it in the step-time benchmarks' optimizer axis.
    """

    keras_class: str  #: a ``keras.optimizers`` class name
    kwargs: dict  #: its arguments
    _: dataclasses.KW_ONLY
    slots: Slots
    oracle: str | None = None
    benchmark: bool = False
    schedule: str | None = None  #: one of SCHEDULES, as the learning rate
    loss_scale: bool = False  #: wrapped in keras.optimizers.LossScaleOptimizer
    #: The row's (data, compile mode) cells in the default tier, column-sharded MLP; None: all of
    #: {arrays, dataloader} x every compile mode. Rows that exist for their numbers (a variant whose
    #: scale an SGD update does not cancel) name one cell: the data source and compile mode are
    #: covered by the other rows, and ``--full`` runs the rest.
    default_cells: tuple | None = None

    @property
    def spec(self) -> dict:
        """The optimizer as cell data (in the report, on the ranks, in a reproducer's SPEC)."""
        spec = {"class": self.keras_class}
        if self.kwargs:
            spec["kwargs"] = dict(self.kwargs)
        if self.schedule is not None:
            spec["schedule"] = self.schedule
        if self.loss_scale:
            spec["loss_scale"] = True
        return spec


#: name -> the optimizer of that row: the one place to add one. Variants put scalars and extra
#: state into the update (momentum, amsgrad maxima, EMA copies, accumulators, schedules), where
#: mixed Tensor/DTensor errors have lived. Slot counts are from each optimizer's ``build()`` in
#: ``keras/src/optimizers/`` (see judge/slots.py).
OPTIMIZERS = {
    "sgd": Optimizer("SGD", {"learning_rate": 0.05}, slots=Slots(0), oracle="sgd", benchmark=True),
    "sgd-momentum": Optimizer("SGD", {"learning_rate": 0.05, "momentum": 0.9}, slots=Slots(1), oracle="sgd"),
    "sgd-nesterov": Optimizer("SGD", {"learning_rate": 0.05, "momentum": 0.9, "nesterov": True}, slots=Slots(1)),
    "sgd-weightdecay": Optimizer("SGD", {"learning_rate": 0.05, "weight_decay": 0.01}, slots=Slots(0)),
    "sgd-schedule": Optimizer("SGD", {}, slots=Slots(0), schedule="exponential-decay"),
    "adam": Optimizer("Adam", {"learning_rate": 0.01}, slots=Slots(2), oracle="adam", benchmark=True),
    "adam-amsgrad": Optimizer("Adam", {"learning_rate": 0.01, "amsgrad": True}, slots=Slots(3)),  # + velocity_hat
    "adam-clipnorm": Optimizer("Adam", {"learning_rate": 0.01, "clipnorm": 0.1}, slots=Slots(2)),
    "adam-clipvalue": Optimizer("Adam", {"learning_rate": 0.01, "clipvalue": 0.01}, slots=Slots(2)),
    "adam-globalclipnorm": Optimizer("Adam", {"learning_rate": 0.01, "global_clipnorm": 0.1}, slots=Slots(2)),
    # + the EMA copy ("average")
    "adam-ema": Optimizer("Adam", {"learning_rate": 0.01, "use_ema": True, "ema_momentum": 0.9}, slots=Slots(3)),
    # + the gradient accumulator
    "adam-accum": Optimizer("Adam", {"learning_rate": 0.01, "gradient_accumulation_steps": 2}, slots=Slots(3)),
    "adamw": Optimizer("AdamW", {"learning_rate": 0.01}, slots=Slots(2), oracle="adamw", benchmark=True),
    "adagrad": Optimizer("Adagrad", {"learning_rate": 0.05}, slots=Slots(1)),  # accumulator
    "adadelta": Optimizer("Adadelta", {"learning_rate": 1.0}, slots=Slots(2)),  # accumulated_grad, _delta_var
    "adamax": Optimizer("Adamax", {"learning_rate": 0.01}, slots=Slots(2)),  # m, u
    "nadam": Optimizer("Nadam", {"learning_rate": 0.01}, slots=Slots(2)),  # momentum, velocity (u_product: a scalar)
    "rmsprop": Optimizer("RMSprop", {"learning_rate": 0.01}, slots=Slots(1), oracle="rmsprop"),  # velocity
    # + average_gradient
    "rmsprop-centered": Optimizer("RMSprop", {"learning_rate": 0.01, "centered": True}, slots=Slots(2)),
    "lion": Optimizer("Lion", {"learning_rate": 0.001}, slots=Slots(1), benchmark=True),  # momentum
    "ftrl": Optimizer("Ftrl", {"learning_rate": 0.05}, slots=Slots(2)),  # accumulator, linear
    # velocity; r and c for rank >= 2
    "adafactor": Optimizer("Adafactor", {"learning_rate": 0.01}, slots=Slots(1, factored=2)),
    "lamb": Optimizer("Lamb", {"learning_rate": 0.01}, slots=Slots(2)),
    # momentum; + velocity where AdamW does the update
    "muon": Optimizer("Muon", {"learning_rate": 0.01}, slots=Slots(1, adamw_velocity=1)),
    # momentum (starts as a copy of the variable), velocity
    "schedulefreeadamw": Optimizer("ScheduleFreeAdamW", {"learning_rate": 0.01}, slots=Slots(2)),
    # inner SGD without momentum: LossScaleOptimizer adds only scalars of its own
    "lossscale": Optimizer("SGD", {"learning_rate": 0.05}, slots=Slots(0), loss_scale=True),
    # Scale-sensitive variants with SGD (issue 20): Adam divides by sqrt(v), so it cancels a constant
    # factor on the gradient (an accumulation that forgets to divide by its steps, a clip that scales
    # wrong) and its variants cannot show one; SGD's update is lr * g. Judged against the JAX
    # reference (JAX has its own accumulation and EMA code). amsgrad exists only in the Adam family
    # (adam-amsgrad); loss scaling is ``lossscale`` above. One default cell each (``default_cells``).
    "sgd-ema": Optimizer("SGD", {"learning_rate": 0.05, "use_ema": True, "ema_momentum": 0.9}, slots=Slots(1),
                         default_cells=(("arrays", "nojit"),)),  # + the EMA copy
    "sgd-accum": Optimizer("SGD", {"learning_rate": 0.05, "gradient_accumulation_steps": 2}, slots=Slots(1),
                           default_cells=(("arrays", "nojit"),)),  # + the gradient accumulator
    "sgd-clipnorm": Optimizer("SGD", {"learning_rate": 0.05, "clipnorm": 0.1}, slots=Slots(0),
                              default_cells=(("arrays", "nojit"),)),
    "sgd-clipvalue": Optimizer("SGD", {"learning_rate": 0.05, "clipvalue": 0.01}, slots=Slots(0),
                               default_cells=(("arrays", "nojit"),)),
    "sgd-globalclipnorm": Optimizer("SGD", {"learning_rate": 0.05, "global_clipnorm": 0.1}, slots=Slots(0),
                                    default_cells=(("arrays", "nojit"),)),
}



def _optimizer_problem(entry) -> str | None:
    """What is wrong with one row of OPTIMIZERS, or None."""
    if not isinstance(entry, Optimizer):
        return f"must be an Optimizer, not {entry!r}"
    if not isinstance(entry.kwargs, dict):
        return f"kwargs must be a dict of {entry.keras_class}'s arguments, not {entry.kwargs!r}"
    if not isinstance(entry.slots, Slots):
        return f"slots must be a Slots, not {entry.slots!r}"
    for field in dataclasses.fields(entry.slots):
        count = getattr(entry.slots, field.name)
        if type(count) is not int or count < 0:
            return f"Slots.{field.name} must be a count (an int >= 0), not {count!r}"
    if entry.schedule is not None and entry.schedule not in SCHEDULES:
        return f"schedule {entry.schedule!r} is not one the ranks build ({', '.join(SCHEDULES)})"
    for cell in entry.default_cells or ():
        if not (isinstance(cell, tuple) and len(cell) == 2 and cell[0] in DATA_SOURCES and cell[1] in COMPILE_MODES):
            return f"default_cells: {cell!r} is not a (data source, compile mode) pair"
    return None


def check_optimizers(table: dict) -> None:
    """Every row of ``table`` is a whole ``Optimizer``; raises ValueError naming the first that is not.
    (Its oracle rule is held to the oracle's rules by ``judge/oracle.check_named_rules``.)"""
    for name, entry in table.items():
        problem = _optimizer_problem(entry)
        if problem:
            raise ValueError(f"axes.OPTIMIZERS[{name!r}]: {problem}")


#: name -> its slot counts, as plain data: ``judge/slots.py`` reads this, and a training cell's
#: reproducer, which inlines that module, gets it by value.
SLOTS = {name: dataclasses.asdict(entry.slots) for name, entry in OPTIMIZERS.items()}
#: The optimizers of the step-time benchmarks (``test_benchmarks.py``), in table order.
BENCHMARKED = tuple(name for name, entry in OPTIMIZERS.items() if entry.benchmark)

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
#: A map as users write one for a model they did not write (issue 64, item 4): the token embeddings and the
#: feed-forward block split Megatron-style (the first projections by column, the last by row), attention, the
#: norms and the rest left replicated. One map for every model it is run on: its keys name the feed-forward
#: layers of the suite's transformer (``dense_ff*``), of KerasHub's Gemma (``ffw_*``), Llama and Qwen
#: (``feedforward_*``); KerasHub's cells run it as their ``ffn-only`` layout (``ranks/hub.LAYOUTS``).
FFN_ONLY_MAP = {
    ".*token_embedding/embeddings": [None, "model"],
    ".*(dense_ff1|ffw_gating|ffw_gating_2|feedforward_gate_dense|feedforward_intermediate_dense)/kernel":
        [None, "model"],
    ".*(dense_ff2|ffw_linear|feedforward_output_dense)/kernel": ["model", None],
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
    # Meshes whose axes are ordered or named otherwise (issue 54): the model axis first, split or of one
    # device; the batch axis called "data" (the LayoutMap's batch_dim_name). Keras finds a mesh axis by
    # its name, so a build that takes the batch axis for the first one, or for one called "batch", fails
    # here. Not in the training cells' products (MATRIX_LAYOUTS): MESH_NAMING_CELLS are theirs.
    "colshard-modelfirst": {"kind": "model-parallel", "map": _COLUMN, "axes": ["model", "batch"], "mesh": ["nproc", 1]},
    "batchshard-modelfirst": {"kind": "model-parallel", "map": _COLUMN, "axes": ["model", "batch"],
                              "mesh": [1, "nproc"]},
    "colshard-data": {"kind": "model-parallel", "map": _COLUMN, "axes": ["data", "model"], "batch_axis": "data"},
    # A user's map (``FFN_ONLY_MAP``): on the language models it was written for, not in the products (the MLP's
    # and the attention model's layers are named otherwise: it would leave them whole).
    "ffn-only": {"kind": "model-parallel", "map": FFN_ONLY_MAP, "models": "language"},
}
#: The KerasHub cells' layouts (``test_hub.py``, issue 64): ``"map": AUTHORS`` is the backbone's own
#: ``get_layout_map(mesh)``, made on each rank (``ranks/hub.Run.distribute``) and recorded in its evidence, which
#: the judge reads; ``ffn-only`` is the user's map above.
AUTHORS = "get_layout_map"
HUB_LAYOUTS = {
    "authors": {"kind": "model-parallel", "map": AUTHORS},
    "authors-2x2": {"kind": "model-parallel", "map": AUTHORS, "mesh": [2, 2]},
    "ffn-only": {"kind": "model-parallel", "map": FFN_ONLY_MAP},
    "dataparallel": {"kind": "data-parallel"},
}
#: The layouts of the training cells' products: every layout but the meshes named or ordered otherwise and the
#: users' maps.
MATRIX_LAYOUTS = tuple(name for name, layout in LAYOUTS.items() if "axes" not in layout and "models" not in layout)
#: The training cells on those meshes (model, optimizer, data, compile, layout): in the default tier,
#: Adam on arrays and SGD from a DataLoader, eagerly; ``--full`` adds the MLP's product over them.
MESH_NAMING_CELLS = tuple(cell for layout in LAYOUTS if "axes" in LAYOUTS[layout]
                          for cell in (("mlp", "adam", "arrays", "nojit", layout), ("mlp", "sgd", "dataloader", "eager", layout)))

MODELS = ("mlp", "embedding", "attention", "batchnorm")
#: A causal language model's transformer block, with dropout, and with its LayerNormalizations frozen
#: (``cell_data.TRANSFORMER_MODELS``; issue 54). Trained with SGD: their attention keeps Keras' default
#: biases, and the key bias's true gradient is zero (softmax ignores it), so Adam would turn rounding noise
#: into whole steps of its own on each side of a comparison (the attention model leaves its biases off).
TRANSFORMER_MODELS = cell_data.TRANSFORMER_MODELS
#: The default tier's transformer cells (model, compile, layout; SGD, arrays), held to its budget (a cell
#: costs about 5 s: the JAX reference compiles the block): the block and its dropout twin on split columns
#: (a mask for activations every rank holds) and under DataParallel (each rank's own rows), frozen
#: LayerNorms on split columns. ``--full``: every transformer model x SGD x {arrays, DataLoader} x {nojit,
#: jit} x every layout.
TRANSFORMER_DEFAULT = (
    ("transformer", "nojit", "colshard"), ("transformer", "nojit", "dataparallel"),
    ("transformer-dropout", "nojit", "colshard"), ("transformer-dropout", "nojit", "dataparallel"),
    ("transformer-frozen-ln", "nojit", "colshard"),
    # issue 64, item 4: a user's map, the one KerasHub's cells run too.
    ("transformer", "nojit", "ffn-only"),
)
#: LoRA fine-tuning (issue 27, item 2): the MLP with LoRA on both Dense layers, its LoRA kernels left
#: to the build by the LayoutMap (``lora``) or sharded with their kernel (``lora-sharded``).
LORA_MODELS = cell_data.LORA_MODELS

#: Mixed precision (issue 27, item 1): every training cell runs under one of these dtype policies
#: (``cell_data.POLICIES``), float32 unless its id names another (``mixed_bfloat16-adam-arrays-nojit-colshard``).
POLICIES = cell_data.POLICIES
#: The optimizers whose state meets the compute precision (moments of 16-bit gradients, a decoupled
#: decay, the loss scale's own variables), which the mixed-precision cells run.
MIXED_OPTIMIZERS = ("sgd", "adam", "adamw", "lossscale")
#: The default tier's mixed cells (policy, optimizer, layout; the MLP, arrays, nojit), a covering
#: design held to issue 27's budget (docs/matrix.md, "Tiers"): each policy on column-sharded kernels
#: and under DataParallel (gradients all-reduced by DDP), a reduction split across the ranks (rowshard:
#: partial sums in 16 bits), SGD, Adam and the loss scale; ``--full`` takes MIXED_OPTIMIZERS x every
#: layout x {arrays, DataLoader} x every compile mode.
MIXED_DEFAULT = (
    ("mixed_bfloat16", "sgd", "colshard"), ("mixed_float16", "adam", "colshard"),
    ("mixed_float16", "lossscale", "colshard"), ("mixed_bfloat16", "adam", "rowshard"),
    ("mixed_bfloat16", "adam", "dataparallel"), ("mixed_float16", "adam", "dataparallel"),
)
#: The default tier's LoRA cells (model, layout; Adam, arrays, nojit): the LoRA kernels left to the
#: build on column-sharded kernels and under DataParallel, sharded with a row-split kernel and on the
#: 2x2 mesh (its gating leg); ``--full`` takes both models on every layout.
LORA_DEFAULT = (("lora", "colshard"), ("lora", "dataparallel"), ("lora-sharded", "rowshard"),
                ("lora-sharded", "batchxmodel"))
#: The layouts the default tier runs the on-batch APIs on: one batch shard (colshard), a batch shard
#: per process under ModelParallel (batchshard) and under DataParallel, and the 2x2 mesh (its gating
#: leg); ``--full`` takes every layout, compiled too.
ON_BATCH_DEFAULT_LAYOUTS = ("colshard", "batchshard", "dataparallel", "batchxmodel")

check_optimizers(OPTIMIZERS)  # here: a row's default_cells are checked against the axes above


def lora_layout(layout: dict) -> dict:
    """``layout`` whose LayoutMap also shards each Dense kernel's LoRA kernels along the kernel's own
    split: ``a`` (inputs x rank) on the kernel's input axis, ``b`` (rank x units) on its output axis."""
    extra = {}
    for key, axes in layout.get("map", {}).items():
        if key.endswith("dense.*kernel"):
            stem = key[:-len("kernel")]
            for name, lora_axes in (("lora_kernel_a", [axes[0], None]), ("lora_kernel_b", [None, axes[1]])):
                if any(lora_axes):  # the other one stays the build's (replicated)
                    extra[stem + name] = lora_axes
    return {**layout, "map": {**extra, **layout["map"]}} if extra else layout


def cell_spec(model: str, optimizer: str, data: str, compile_mode: str, layout: str, policy: str = POLICIES[0]) -> dict:
    """A training cell as data; ``policy`` only where it is not float32, so a float32 cell's spec
    (its references' keys, its reproducer) is what it was before the policy axis."""
    return {
        "model": model,
        "optimizer": OPTIMIZERS[optimizer].spec,
        "optimizer_name": optimizer,
        "data": data,
        "compile": compile_mode,
        "layout": lora_layout(LAYOUTS[layout]) if model == "lora-sharded" else LAYOUTS[layout],
        "layout_name": layout,
        **({"policy": policy} if policy != POLICIES[0] else {}),
    }


def row_parts(model: str, optimizer: str, policy: str = POLICIES[0]) -> list[str]:
    """What names a training cell's row: the policy and the model only when they are not float32 and
    the MLP, then the optimizer (``["mixed_bfloat16", "lora", "adam"]``, ``["adam"]``)."""
    return [*([policy] if policy != POLICIES[0] else []), *([model] if model != "mlp" else []), optimizer]


def cell_id(model: str, optimizer: str, data: str, compile_mode: str, layout: str, policy: str = POLICIES[0]) -> str:
    """``adam-dataloader-jit-colshard``, ``mixed_bfloat16-lora-adam-arrays-nojit-colshard``: the row's
    parts (``row_parts``), then the column's."""
    return "-".join([*row_parts(model, optimizer, policy), data, compile_mode, layout])


def _product(models, optimizers, data, compile_modes, layouts, policies=POLICIES[:1]):
    """(model, optimizer, data, compile, layout, policy) of every combination."""
    return list(itertools.product(models, optimizers, data, compile_modes, layouts, policies))


#: Sample weights, dict inputs, PyDataset, a generator and an IterableDataset each under
#: DataParallel or batch-sharded ModelParallel (Adam, nojit), where the batch axis has one shard per
#: process: column-sharded cells alone (batch axis of size 1) never make ``_distribute_data`` split
#: them. Each source meets at least one of the two layouts, sample weights (a third tensor the
#: trainer must distribute alongside x and y) both; ``--full`` has the whole product.
HAND_FED_SOURCES_OFF_COLUMN = [
    ("mlp", "adam", "sample-weights", "nojit", "dataparallel"), ("mlp", "adam", "sample-weights", "nojit", "batchshard"),
    ("mlp", "adam", "dict", "nojit", "batchshard"), ("mlp", "adam", "pydataset", "nojit", "dataparallel"),
    ("mlp", "adam", "generator", "nojit", "batchshard"), ("mlp", "adam", "iterable", "nojit", "dataparallel"),
]


def training_cells(full: bool) -> list[tuple]:
    """(model, optimizer, data, compile, layout, policy) coordinates of the tier, without duplicates.

    Default tier: full products where bugs have lived, and a covering design for the rest:
      - every optimizer x every compile mode x {arrays, DataLoader}, MLP, column-sharded (a row's
        ``default_cells`` where it names fewer);
      - every data source x {eager, nojit, jit}, Adam, MLP, column-sharded;
      - every model x every layout, Adam, arrays, nojit; and every layout x compile mode, MLP;
      - the sources other than arrays and DataLoader off the column-sharded layout
        (``HAND_FED_SOURCES_OFF_COLUMN``: a covering design over DataParallel and batchshard);
      - the LoRA models on ``LORA_DEFAULT``'s layouts and the mixed cells of ``MIXED_DEFAULT``;
      - ``MESH_NAMING_CELLS`` on the meshes named or ordered otherwise (the products take ``MATRIX_LAYOUTS``);
      - the transformer block's ``TRANSFORMER_DEFAULT``.
    ``--full`` adds every optimizer x data source, and models x optimizers x compile modes.
    """
    cells = []
    for name, entry in OPTIMIZERS.items():
        pairs = entry.default_cells or itertools.product(["arrays", "dataloader"], COMPILE_MODES)
        cells += [("mlp", name, data, compile_mode, "colshard", POLICIES[0]) for data, compile_mode in pairs]
    cells += _product(["mlp"], ["adam"], DATA_SOURCES, ["eager", "nojit", "jit"], ["colshard"])
    cells += _product(MODELS, ["adam"], ["arrays"], ["nojit"], MATRIX_LAYOUTS)
    cells += _product(["mlp"], ["sgd", "adam"], ["arrays", "dataloader"], COMPILE_MODES, MATRIX_LAYOUTS)
    cells += [(*cell, POLICIES[0]) for cell in HAND_FED_SOURCES_OFF_COLUMN]  # issue 19 item 4
    cells += [(model, "adam", "arrays", "nojit", layout, POLICIES[0]) for model, layout in LORA_DEFAULT]  # issue 27
    cells += [("mlp", optimizer, "arrays", "nojit", layout, policy) for policy, optimizer, layout in MIXED_DEFAULT]
    cells += [(*cell, POLICIES[0]) for cell in MESH_NAMING_CELLS]  # issue 54
    cells += [(model, "sgd", "arrays", mode, layout, POLICIES[0]) for model, mode, layout in TRANSFORMER_DEFAULT]
    mixed = POLICIES[1:]
    if full:
        cells += _product(LORA_MODELS, ["adam"], ["arrays"], ["nojit"], MATRIX_LAYOUTS)
        cells += _product(["mlp"], MIXED_OPTIMIZERS, ["arrays", "dataloader"], COMPILE_MODES, MATRIX_LAYOUTS, mixed)
        # The other models with SGD: Adam turns 16-bit rounding in a near-zero gradient into a whole step
        # (docs/measurements.md, "Mixed precision"), SGD's step is the gradient's own size.
        cells += _product(MODELS, ["sgd"], ["arrays"], ["nojit", "jit"], MATRIX_LAYOUTS, mixed)
        cells += _product(LORA_MODELS, ["sgd", "adam", "adamw"], ["arrays"], ["nojit", "jit"], MATRIX_LAYOUTS, mixed)
        cells += _product(LORA_MODELS, ["sgd", "adam", "adamw"], ["arrays", "dataloader"], COMPILE_MODES, MATRIX_LAYOUTS)
        cells += _product(["mlp"], OPTIMIZERS, DATA_SOURCES, ["nojit", "jit"], ["colshard"])
        cells += _product(MODELS, OPTIMIZERS, ["arrays", "dataloader"], COMPILE_MODES, ["colshard", "rowshard"])
        cells += _product(MODELS, ["adam"], DATA_SOURCES, COMPILE_MODES, MATRIX_LAYOUTS)
        cells += _product(["mlp"], ["sgd", "adam"], ["arrays", "dataloader"], COMPILE_MODES,
                          [name for name, layout in LAYOUTS.items() if "axes" in layout])
        cells += _product(TRANSFORMER_MODELS, ["sgd"], ["arrays", "dataloader"], ["nojit", "jit"],
                          [*MATRIX_LAYOUTS, "ffn-only"])
    # Dict inputs build the two-input MLP whatever the row's model (ranks/train.model_name): another
    # model's dict cell would run the MLP's cell again under the other model's name.
    cells = [cell for cell in cells if cell[2] != "dict" or cell[0] == "mlp"]
    return list(dict.fromkeys(cells))


# ------------------------------------------------------------------ Keras-sharded data (issue 19)
#: The sources a Keras-sharded cell (``test_data_sharding.py``) hands ``fit`` / ``evaluate`` /
#: ``predict`` whole, for Keras to shard per process: name -> whether ``fit`` shuffles it
#: (``fit(shuffle=True)``, or the DataLoader's RandomSampler), so epoch 2 must be reordered. Their
#: builders are ``ranks/data_sharding.sources``. A generator is not here: nothing can shard one
#: without reading all of it on every process, so Keras' adapter does not try.
KERAS_SHARDED_SOURCES = {
    "arrays": True,
    "tensors": True,
    "dataloader": False,
    "dataloader-sampler": True,
    "dataloader-workers": False,
    "iterable": False,
    "pydataset": True,
    "pydataset-workers": True,
}
#: Layouts with a batch axis of every size: one shard per process (DataParallel, batchshard), one
#: shard for all (colshard: a (1, n) mesh), and two shards of two ranks each (batchxmodel, 4 ranks).
KERAS_SHARDED_LAYOUTS = ("dataparallel", "batchshard", "colshard", "batchxmodel")
#: The default tier's Keras-sharded cells (source, uneven, layout): every source family once on a
#: batch axis of one shard per process, and PyDataset (which the default build shards) on the three
#: 2-rank layouts; ``--full`` takes the product, the uneven row counts with it (on the default build
#: an uneven PyDataset cell crashes, and the pool's restart costs more than the default tier's budget).
#: On the 2x2 mesh (``--nproc 4``, the gating leg's ``-m mesh``; skipped with 2 ranks, so free there):
#: PyDataset, arrays and a sampled DataLoader, the one place where 1 < batch shards < processes, so a
#: shard count taken from the process count shows (keras-team/keras#23045's review).
DEFAULT_KERAS_SHARDED = (
    ("arrays", False, "dataparallel"), ("tensors", False, "batchshard"), ("dataloader", False, "dataparallel"),
    ("dataloader-sampler", False, "batchshard"), ("iterable", False, "dataparallel"),
    ("pydataset", False, "dataparallel"), ("pydataset", False, "batchshard"), ("pydataset", False, "colshard"),
    ("pydataset", False, "batchxmodel"), ("arrays", False, "batchxmodel"), ("dataloader-sampler", False, "batchxmodel"),
)


def keras_sharded_cells(full: bool) -> list[tuple[str, bool, str]]:
    """(source, uneven, layout) of the Keras-sharded cells of the tier, without duplicates."""
    cells = list(DEFAULT_KERAS_SHARDED)
    if full:
        cells += itertools.product(KERAS_SHARDED_SOURCES, (False, True), KERAS_SHARDED_LAYOUTS)
    return list(dict.fromkeys(cells))


def keras_sharded_id(source: str, uneven: bool, layout: str) -> str:
    """``dataloader-sampler-batchshard``, ``pydataset-uneven-dataparallel``."""
    return "-".join([source, "uneven", layout] if uneven else [source, layout])
